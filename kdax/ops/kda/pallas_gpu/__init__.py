"""Chunked KDA as Pallas kernels lowered through Triton (``backend="pallas_gpu"``).

The same full-tile chunk math as the TPU kernels (:mod:`kdax.ops.kda.tiles`, states transposed
``St = S^T`` ``[V, K]``), in the staged form that suits a GPU (docs/kda_gpu.md). Inputs, o and the
gradients are token-major ``[B, slots, heads, D]`` as the caller has them; the intermediates the
kernels pass each other head-major ``[B, HV, slots, D]``:

forward   diag (B, HV, row blocks) -> intra (B, HV, chunks) -> state (B, N, HV, V-blocks)
          -> output (B, HV, chunks, V-blocks)
backward  recompute (B, HV, chunks) -> state cotangent (B, N, HV, V-blocks) -> values (B, HV, chunks)
          -> keys (B, HV, chunks) -> diag grads (B, HV, row blocks) -> levels (B, HV, chunks, K-blocks)

The two sequential kernels give one program to each (sequence, head, V-block), which
walks that sequence's chunks with ``lax.fori_loop``, the state in registers. The others
work on blocks of key columns (``Config.block_k``, by default :data:`BLOCK_K`'s per
kernel; values and keys also of value columns, ``Config.block_v``), and the diag, intra
and levels kernels on row blocks of ``SUB`` (the diagonal blocks apart, the off-diagonal
ones, nothing above the diagonal), so that few tiles are live at once (registers, shared
memory: scripts/gpu_compile_report.py). K and V are padded to powers of two >= 16
(Triton's tile rule). Off GPU the kernels run in the Pallas interpreter (for tests; slow).

Modules: :mod:`.launch` (config, launch table, shared-memory model), :mod:`.kernels` (the
kernel bodies), :mod:`.calls` (one helper per pallas_call, the forward and backward),
:mod:`.vjp` (the custom VJP); this one the entry points.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

from kdax.ops.common.arrays import pad_last
from kdax.ops.common.varlen import ChunkLayout
from kdax.ops.kda import decode
from kdax.ops.kda.capabilities import Capabilities
from kdax.ops.kda.pallas_gpu import launch
from kdax.ops.kda.pallas_gpu.calls import Static
from kdax.ops.kda.pallas_gpu.kernels import QK, SUB, Gate
from kdax.ops.kda.pallas_gpu.launch import (
    BLOCK_K,
    LAUNCH,
    PRECISIONS,
    SHARED_MEMORY_KIB,
    Config,
    blocks,
    fit_launch,
    pow2,
    shared_memory,
    shared_memory_limit,
    stored_dtype,
    tiles_for,
)
from kdax.ops.kda.pallas_gpu.vjp import core
from kdax.ops.kda.tiles import chunk_states

__all__ = [
    "BLOCK_K",
    "LAUNCH",
    "PRECISIONS",
    "SHARED_MEMORY_KIB",
    "SUB",
    "DECODE_VERIFIED_ON_GPU",
    "VERIFIED_ON_GPU",
    "Config",
    "chunk_fits",
    "chunk_kda_pallas_gpu",
    "decode_pads",
    "fused_recurrent_pallas_gpu",
    "fused_recurrent_slots_pallas_gpu",
    "shared_memory",
    "shared_memory_limit",
]

# Whether the compiled kernels have passed the shared cases' error bars on a GPU
# (`scripts/gpu_session.sh tests`, recorded in BENCHMARKS.md). Until then backend="auto" runs
# xla on a GPU; backend="pallas_gpu" runs these kernels all the same.
VERIFIED_ON_GPU = False
# The same for the decode kernel (fused_recurrent_kda), which "auto" runs on a GPU only once it has
# passed there (tests/ops/kda/test_decode.py under scripts/gpu_session.sh).
DECODE_VERIFIED_ON_GPU = False


def _gate_params(gate, HV: int, K: int, Kp: int):  # [HV, 2, Kp]: exp(A_log), dt_bias (zeros when g is the decay)
    f32 = jnp.float32
    if gate is None:
        return jnp.zeros((HV, 2, Kp), f32)
    A_log, dt_bias, _ = gate
    a = jnp.ones((HV,), f32) if A_log is None else jnp.exp(A_log.astype(f32))
    b = jnp.zeros((HV, K), f32) if dt_bias is None else dt_bias.astype(f32).reshape(HV, K)
    return jnp.stack([jnp.broadcast_to(a[:, None], (HV, Kp)), pad_last(b, Kp)], axis=1)


def chunk_fits(input_dtype, chunk_size: int, cfg: Config = Config(), K: int = 128, V: int = 128) -> str | None:
    """Whether the kernels fit this GPU's shared memory (:func:`shared_memory` against
    :func:`shared_memory_limit`). On an H100 every size fits with bfloat16 intermediates, and
    chunk sizes up to 64 with float32 ones (the values kernel's [C, C] tiles).

    Args:
        input_dtype: the inputs' dtype (with ``cfg.precision`` it sets the intermediates').
        chunk_size: C.
        cfg: the config.
        K, V: the head dims.

    Returns:
        None where they fit, else why not (which kernel needs how much, what the GPU allows).
    """
    cfg = cfg.resolved()
    return launch.too_large(cfg, tiles_for(cfg, input_dtype), chunk_size, K, V)


def chunk_kda_pallas_gpu(
    q,
    k,
    v,
    g,
    beta,
    h0,
    layout: ChunkLayout,
    input_dtype=jnp.float32,
    cfg: Config = Config(),
    gate=None,
    g_dtype=None,
    l2norm_qk: bool = False,
    scale: float = 1.0,
    disable_recompute: bool = False,
    intermediate_states: bool = False,
):
    """Core chunked KDA with the GPU kernels, on prepared float32 inputs.

    q, k: [B, T, H, K] (not repeated over value heads; the kernels take the L2 norm of both
    when ``l2norm_qk`` and scale q by ``scale``); v: [B, T, HV, V];
    g: [B, T, HV, K] natural-log decay, or with ``gate = (A_log [HV] | None, dt_bias [HV * K] | None,
    lower_bound | None)`` the raw logits that the kernels turn into the decay as
    :func:`~kdax.ops.kda.gate.kda_gate` does; beta: [B, T, HV]; h0: [B, N, HV, K, V];
    input_dtype: the caller's dtype (chooses the matmul precision under "auto");
    g_dtype: the caller's dtype of g (bfloat16 or float16 g is read as such);
    disable_recompute: the forward keeps the intra kernel's outputs and v_new for the backward,
    which then runs neither again.
    Returns (o [B, T, HV, V], final [B, N, HV, K, V]) and with ``intermediate_states`` the state
    entering each chunk [B, NC, HV, K, V] (differentiable; chunks no sequence uses are 0); o and
    those states in bfloat16 under precision "bf16".

    The kernels read q, k, v (rounded to :func:`stored_dtype` dtype), g and beta token-major as they
    come: with no cu_seqlens, T a multiple of the chunk and K, V powers of two >= 16, XLA
    makes no copy of them (under "bf16", the float32 the caller upcast to folds back)."""
    cfg = cfg.resolved()
    tiles = tiles_for(cfg, input_dtype)
    H, K = q.shape[2:]
    HV, V = v.shape[2:]
    if why := launch.too_large(cfg, tiles, layout.chunk_size, K, V):
        raise ValueError(
            f"chunk_size: pallas_gpu with {jnp.dtype(stored_dtype(tiles))} intermediates at chunk_size="
            f"{layout.chunk_size}, K={K}, V={V} does not fit: {why}; use a smaller chunk_size, bfloat16 "
            f"inputs or backend='xla'"
        )
    Kp, Vp = pow2(K), pow2(V)
    cfg = blocks(cfg, tiles, K, V)
    sd = stored_dtype(tiles)
    cfg = fit_launch(cfg, layout.chunk_size, Kp, jnp.dtype(sd).itemsize)
    qt, kt = (pad_last(layout.pack(x.astype(sd)), Kp) for x in (q, k))
    kgate = Gate(gate is not None, None if gate is None else gate[2])
    if g_dtype in (jnp.bfloat16, jnp.float16):
        g = g.astype(g_dtype)
    vt, gt = pad_last(layout.pack(v.astype(sd)), Vp), pad_last(layout.pack(g, kgate.fill), Kp, kgate.fill)
    bt = layout.pack(beta[..., None])
    h0t = pad_last(jnp.swapaxes(pad_last(h0, Vp), -1, -2), Kp)  # [B, N, HV, Vp, Kp]
    ranges = (layout.seq_chunk_start, layout.seq_chunk_end)
    gp = _gate_params(gate, HV, K, Kp)
    static = Static(layout.chunk_size, HV // H, tiles, cfg, kgate, QK(l2norm_qk, float(scale)))
    o, final, S_in = core(qt, kt, vt, gt, gp, bt, h0t, ranges, static, disable_recompute, intermediate_states)
    o, final = layout.unpack(o[..., :V]), jnp.swapaxes(final, -1, -2)[..., :K, :V]
    if not intermediate_states:
        return o, final
    return o, final, chunk_states(layout, S_in, K, V)


DECODE_BLOCK_V = 32  # V-block of the decode kernel: a [32, Kp] float32 state block in registers
DECODE_LAUNCH = (4, 1)  # its (num_warps, num_stages); the chunk kernels' are LAUNCH


def decode_pads(K: int, V: int) -> tuple[int, int]:
    """K and V as the decode kernel pads them: powers of two >= 16."""
    return pow2(K), pow2(V)


def _decode_launch(q, Vp: int, cfg: Config) -> dict:
    cfg = cfg.resolved()
    params = pltriton.CompilerParams(num_warps=DECODE_LAUNCH[0], num_stages=DECODE_LAUNCH[1])
    Tp = 1 << (q.shape[1] - 1).bit_length()
    return {"BV": min(cfg.block_v or DECODE_BLOCK_V, Vp), "Tp": Tp, "interpret": cfg.interpret, "params": params}


def fused_recurrent_pallas_gpu(*args, opt: decode.Options, gate_params, cfg: Config):
    """Core recurrent KDA (decoding, draft verification) with the GPU decode kernel
    (:func:`kdax.ops.kda.decode.fused_recurrent`, its arguments and outputs): K, V and T padded to
    powers of two (>= 16 for K and V), :data:`DECODE_LAUNCH` a program."""
    Kp, Vp = decode_pads(args[0].shape[-1], args[2].shape[-1])
    launch = _decode_launch(args[0], Vp, cfg)
    return decode.fused_recurrent(*args, opt=opt, gate_params=gate_params, Kp=Kp, Vp=Vp, **launch)


def fused_recurrent_slots_pallas_gpu(*args, opt: decode.Options, gate_params, cfg: Config, v_first: bool):
    """The GPU decode kernel on a state pool it loads from and stores to at each row's slots
    (:func:`kdax.ops.kda.decode.fused_recurrent_slots`, its arguments and outputs)."""
    launch = _decode_launch(args[0], pow2(args[2].shape[-1]), cfg)
    return decode.fused_recurrent_slots(*args, opt=opt, gate_params=gate_params, v_first=v_first, dma=False, **launch)


def _refuse(dtype, config, asked, chunk_size=None, head_dims=(128, 128)) -> str | None:
    """Why "auto" (``asked`` False) or a call does not take these kernels (None: it does)."""
    if not asked and not VERIFIED_ON_GPU:
        return "the GPU kernels are not yet verified on a GPU (pallas_gpu.VERIFIED_ON_GPU)"
    if why := chunk_fits(dtype, chunk_size, config or Config(), *head_dims):
        return f"chunk_size={chunk_size} with {jnp.dtype(dtype)} inputs does not fit the GPU kernels: {why}"
    return None


def _refuse_decode(asked) -> str | None:
    if not asked and not DECODE_VERIFIED_ON_GPU:
        return "the GPU decode kernel is not yet verified on a GPU (pallas_gpu.DECODE_VERIFIED_ON_GPU)"
    return None


CAPABILITIES = Capabilities(
    "pallas_gpu",
    config=Config,
    cores={"chunk": chunk_kda_pallas_gpu},
    input_dtype=True,
    raw_inputs=True,
    decode=fused_recurrent_pallas_gpu,
    decode_slots=(decode_pads, fused_recurrent_slots_pallas_gpu),
    refuse=_refuse,
    refuse_decode=_refuse_decode,
)
