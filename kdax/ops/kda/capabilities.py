"""What each KDA backend takes and does (:mod:`kdax.ops.common.capabilities`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kdax.ops.common import capabilities


@dataclasses.dataclass(frozen=True)
class Capabilities(capabilities.Capabilities):
    """One KDA backend. ``cores``: "chunk", ``chunk(q, k, v, g, beta, h0, layout, *, cfg,
    disable_recompute, intermediate_states, **takes)``, and "recurrent", ``recurrent(q, k, v, g,
    beta, h0, cu, *, token_states)``, on prepared inputs (a backend without "recurrent" runs the
    recurrent op on its decode kernel).

    Attributes:
        repeats_qk: its cores take q and k repeated to the value heads (grouped heads).
        input_dtype: its chunked core takes the caller's dtype (``input_dtype=``), which its
            precision "auto" follows.
        raw_inputs: its chunked core takes the gate logits and unnormalised, unscaled q and k,
            and applies the gate, the L2 norm and the scale itself (``g_dtype``, ``gate``,
            ``l2norm_qk``, ``scale``).
        decode: the decode kernel (rows of up to ``decode.MAX_TOKENS`` tokens; the gate, L2 norm,
            beta's sigmoid and the scale in the kernel), ``decode(*args, opt, gate_params, cfg)``.
        decode_slots: (padded K and V, the decode kernel on a state pool in place).
        refuse: ``refuse(dtype, config, asked, chunk_size, head_dims)``: why the chunked core does
            not take the inputs (None: it does).
        refuse_decode: ``refuse_decode(asked)``: why "auto" does not run the decode kernel here.
    """

    repeats_qk: bool = False
    input_dtype: bool = False
    raw_inputs: bool = False
    decode: Callable | None = None
    decode_slots: tuple[Callable, Callable] | None = None
    refuse: Callable[..., str | None] | None = None
    refuse_decode: Callable[[bool], str | None] | None = None
