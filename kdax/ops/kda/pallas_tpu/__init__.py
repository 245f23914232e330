"""Chunked KDA as Mosaic TPU kernels (``backend="pallas_tpu"``): forward.

Layout: the kernels read head-major ``[B, heads, slots, D]`` inputs with K and V padded to
multiples of 128 (XLA fuses the transpose with the cast to float32) and write the outputs (o, and
dq, dk, dv, dg) token-major, as ``[B, slots, heads * D]``, each head's columns lane-aligned (XLA's
relayout to ``[B, T, heads, D]`` costs a third of a transpose; docs/kda_tpu.md, Layout). One
chunk of C slots per grid step, the state kept transposed
(``St = S^T``, ``[V, K]``) so the per-key decay scales its lanes. GVA maps value
head h to q/k head ``h // (HV // H)`` in the index maps (q and k are never repeated).
Variable-length batches come in through scalar prefetch: per chunk, whether it starts
or ends its sequence and which sequence it belongs to.

The chunk math is :mod:`kdax.ops.kda.tiles` (full-tile operations only, shared with the
GPU kernels). Two kernel pipelines compute the forward (docs/kda_tpu.md):

- ``fused``: one kernel per (batch, head, V-block) walking the chunks, everything
  on chip (default);
- ``staged``: intra-chunk kernel -> state kernel -> output kernel, through HBM.

Precision (``Config.precision``, docs/kda_tpu.md, Precision): "auto" runs "bf16" for bfloat16
inputs (bulk matmuls on bfloat16 operands with float32 accumulation, the triangular inverse's on
two bfloat16 parts of each operand) and "highest" otherwise (float32 as six bfloat16 passes); the
0/1 sums (exponents, cumsums) take three bfloat16 parts, exact, in every mode.

Off TPU the kernels run in the Pallas TPU interpreter (for tests; slow). The recurrent form's
decode kernel (``fused_recurrent_kda``) is :mod:`kdax.ops.kda.decode`'s, launched here.

Modules: :mod:`.config` (Config, the heads and VMEM tables, :func:`~.config.plan`), :mod:`.kernels`
(the kernel bodies), :mod:`.calls` (block specs, one helper per pallas_call, the forward and
backward), :mod:`.vjp` (the custom VJP); this one the entry points.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from kdax.ops.common.arrays import pad_last, round_up
from kdax.ops.common.varlen import ChunkLayout
from kdax.ops.kda import decode
from kdax.ops.kda.capabilities import Capabilities
from kdax.ops.kda.pallas_tpu.config import (
    KERNELS,
    LANE,
    LOCKSTEP,
    ROOMY_LIMIT,
    VMEM_LIMIT,
    Config,
    cores_per_device,
    heads_per_step,
    interpret_params,
    plan,
    scaled,
    tiles_for,
    vmem_limit,
)
from kdax.ops.kda.pallas_tpu.vjp import core
from kdax.ops.kda.tiles import chunk_states, head_major

Config.__module__ = __name__  # its public name, kdax.ops.kda.pallas_tpu.Config (in messages and docs)

__all__ = [
    "CAPABILITIES",
    "KERNELS",
    "LOCKSTEP",
    "ROOMY_LIMIT",
    "VMEM_LIMIT",
    "Config",
    "chunk_kda_pallas_tpu",
    "cores_per_device",
    "decode_pads",
    "fused_recurrent_pallas_tpu",
    "fused_recurrent_slots_pallas_tpu",
    "heads_per_step",
    "scaled",
    "tiles_for",
    "vmem_limit",
]


def chunk_kda_pallas_tpu(
    q,
    k,
    v,
    g,
    beta,
    h0,
    layout: ChunkLayout,
    cfg: Config = Config(),
    disable_recompute: bool = False,
    intermediate_states: bool = False,
    input_dtype=jnp.float32,
):
    """Core chunked KDA with the TPU kernels, on prepared float32 inputs (``input_dtype`` the
    caller's, which ``cfg.precision="auto"`` follows).

    q, k: [B, T, H, K] (q scaled, not repeated over value heads); v: [B, T, HV, V];
    g: [B, T, HV, K] natural-log decay; beta: [B, T, HV]; h0: [B, N, HV, K, V].
    disable_recompute: besides the products of levels and inverse the forward saves for a gradient
    (SAVED), it writes G, R, w, u and v_new (KEPT), which the backward then reads instead of
    taking them by 0/1 sums and three matmuls.
    Returns (o [B, T, HV, V], final [B, N, HV, K, V]) and with ``intermediate_states`` the
    state entering each chunk [B, NC, HV, K, V] (differentiable; chunks no sequence uses are 0)."""
    H, K = q.shape[2:]
    HV, V = v.shape[2:]
    cfg = plan(cfg, input_dtype, K, V)
    Kp, Vp = round_up(K, LANE), round_up(V, cfg.block_v)
    qh, kh, gh = (head_major(layout, x, Kp) for x in (q, k, g))
    vh = head_major(layout, v, Vp)
    bh = layout.pack(beta)[:, None]  # [B, 1, L, HV]: every step reads all heads' (_beta_spec)
    h0t = pad_last(jnp.swapaxes(pad_last(h0, Vp), -1, -2), Kp)  # [B, N, HV, Vp, Kp]
    i32 = jnp.int32
    sched = (layout.chunk_first.astype(i32), layout.chunk_last.astype(i32), layout.chunk_seq)
    o, final, S_in = core(
        qh,
        kh,
        vh,
        gh,
        bh,
        h0t,
        sched,
        layout.seq_empty,
        HV // H,
        cfg,
        disable_recompute,
        intermediate_states,
        jnp.dtype(input_dtype),
    )
    o = layout.unpack(o.reshape(*o.shape[:2], HV, Vp)[..., :V])
    final = jnp.swapaxes(final, -1, -2)[..., :K, :V]
    if not intermediate_states:
        return o, final
    return o, final, chunk_states(layout, S_in, K, V)


def decode_pads(K: int, V: int) -> tuple[int, int]:
    """K and V as the decode kernel pads them: multiples of 128."""
    return round_up(K, LANE), round_up(V, LANE)


def _decode_launch(q, cfg: Config) -> dict:
    cfg = cfg.resolved()
    params = pltpu.CompilerParams(dimension_semantics=("parallel",) * 3)
    return {"BV": LANE, "Tp": q.shape[1], "interpret": interpret_params(cfg), "params": params}


def fused_recurrent_pallas_tpu(*args, opt: decode.Options, gate_params, cfg: Config):
    """Core recurrent KDA (decoding, draft verification) with the TPU decode kernel
    (:func:`kdax.ops.kda.decode.fused_recurrent`, its arguments and outputs): K and V padded to
    multiples of 128."""
    Kp, Vp = decode_pads(args[0].shape[-1], args[2].shape[-1])
    return decode.fused_recurrent(*args, opt=opt, gate_params=gate_params, Kp=Kp, Vp=Vp, **_decode_launch(args[0], cfg))


def fused_recurrent_slots_pallas_tpu(*args, opt: decode.Options, gate_params, cfg: Config, v_first: bool):
    """The TPU decode kernel on a state pool in HBM, each row's state copied in and out by DMA
    (:func:`kdax.ops.kda.decode.fused_recurrent_slots`, its arguments and outputs)."""
    launch = _decode_launch(args[0], cfg)
    return decode.fused_recurrent_slots(*args, opt=opt, gate_params=gate_params, v_first=v_first, dma=True, **launch)


CAPABILITIES = Capabilities(
    "pallas_tpu",
    config=Config,
    cores={"chunk": chunk_kda_pallas_tpu},
    input_dtype=True,
    decode=fused_recurrent_pallas_tpu,
    decode_slots=(decode_pads, fused_recurrent_slots_pallas_tpu),
)
