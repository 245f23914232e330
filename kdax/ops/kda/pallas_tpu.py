"""Chunked KDA as Mosaic TPU kernels (``backend="pallas_tpu"``): forward.

Layout inside the kernels: head-major ``[B, heads, slots, D]`` with K and V padded to
multiples of 128, one chunk of C slots per grid step, the state kept transposed
(``St = S^T``, ``[V, K]``) so the per-key decay scales its lanes. GVA maps value
head h to q/k head ``h // (HV // H)`` in the index maps (q and k are never repeated).
Variable-length batches come in through scalar prefetch: per chunk, whether it starts
or ends its sequence and which sequence it belongs to.

The chunk math (:func:`chunk_intra`) uses only full-tile operations (matmuls, masks
from iotas, element-wise maps): no sub-tile slicing or reshapes, which Mosaic handles
poorly. Two kernel pipelines compute the forward (docs/kda_tpu.md):

- ``fused``: one kernel per (batch, head, V-block) walking the chunks, everything
  on chip (default);
- ``staged``: intra-chunk kernel -> state kernel -> output kernel, through HBM.

Off TPU the kernels run in the Pallas TPU interpreter (for tests; slow).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kdax.ops.common.varlen import ChunkLayout
from kdax.ops.kda.xla import LOG2E, dyadic_levels

LANE = 128
_HIGHEST = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Config:
    """How the forward runs: ``pipeline`` "fused" or "staged"; ``block_v`` (a multiple of
    128) splits V over grid programs; ``interpret`` None = interpret unless on TPU."""

    pipeline: str = "fused"
    block_v: int = 128
    interpret: bool | None = None
    detect_races: bool = False


CONFIG = Config()  # what chunk_kda(backend="pallas_tpu") uses; replace it to choose another


# ----------------------------------------------------------------------------- chunk math


def _dot(a, b):  # a @ b
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_HIGHEST, preferred_element_type=jnp.float32)


def _dot_t(a, b):  # a @ b^T
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HIGHEST, preferred_element_type=jnp.float32)


def _t_dot(a, b):  # a^T @ b
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_HIGHEST, preferred_element_type=jnp.float32)


def _iota(shape, axis):
    return lax.broadcasted_iota(jnp.int32, shape, axis)


def _rowsum(x):  # [C, D] -> [C, 1], as a matmul with ones
    return _dot_t(x, jnp.ones((1, x.shape[1]), jnp.float32))


def _ones_where(cond):  # float32 0/1 matrix (explicit dtype: no float64 under jax_enable_x64)
    return jnp.where(cond, jnp.float32(1), jnp.float32(0))


def _block(x, s: int):  # x // s for a power of two s (shifts: integer division lowers through sign on TPU)
    return x >> (s.bit_length() - 1)


def _in_block(x, s: int):  # x % s
    return x & (s - 1)


def unit_lower_inverse_masked(A: jax.Array) -> jax.Array:
    """``(I + strict_lower(A))^-1`` for A: [C, C], C a power of two, by masked full-size matmuls.

    Doubling h = 1, 2, ..., C/2 with T block diagonal in blocks of h: T <- T - T A_h T,
    A_h holding the lower-left h x h block of every 2h diagonal block. That is the block
    forward substitution [[T11, 0], [-T22 A21 T11, T22]] for all blocks at once; the
    masked-out entries only add exact zeros."""
    C = A.shape[-1]
    i, j = _iota((C, C), 0), _iota((C, C), 1)
    T = _ones_where(i == j)
    h = 1
    while h < C:
        s = 2 * h
        off = (_block(i, s) == _block(j, s)) & (_in_block(i, s) >= h) & (_in_block(j, s) < h)
        T = T - _dot(T, _dot(jnp.where(off, A, 0.0), T))
        h = s
    return T


class Intra(NamedTuple):
    """One chunk's state-free quantities."""

    G: jax.Array  # [C, K] cumulative log2 gate
    Aqk: jax.Array  # [C, C] inclusive lower
    Kkk: jax.Array  # [C, C] strictly lower, before beta
    T: jax.Array  # [C, C] (I + beta Kkk)^-1
    w: jax.Array  # [C, K]
    u: jax.Array  # [C, V]
    q_g: jax.Array  # [C, K] q 2^G
    k_g: jax.Array  # [C, K] k 2^G
    k_d: jax.Array  # [C, K] k 2^(G_C - G)
    decay: jax.Array  # [1, K] 2^G_C


def _level(G: jax.Array, s: int):
    """Dyadic level s of the pairwise factorisation (docs/kda_xla.md), as full tiles.

    Row i in the lower half of its s-block scales by el = 2^(G_i - G_r), row j in the
    upper half by eu = 2^(G_r - G_j), r the block's middle row: both exponents are <= 0
    where used, -inf elsewhere. ``block`` [C, C] marks the (lower, upper) pairs of the level."""
    C = G.shape[0]
    i, j = _iota((C, C), 0), _iota((C, C), 1)
    h = s // 2
    R = _dot(_ones_where(j == i - _in_block(i, s) + h), G)  # [C, K] G of each row's reference row (exact)
    lower = _in_block(_iota((C, 1), 0), s) >= h  # [C, 1]
    el = jnp.exp2(jnp.where(lower, G - R, -jnp.inf))
    eu = jnp.exp2(jnp.where(lower, -jnp.inf, R - G))
    block = (_block(i, s) == _block(j, s)) & (_in_block(i, s) >= h) & (_in_block(j, s) < h)
    return el, eu, block


def _diag(x, y):  # [C, C] with the row dot products x_i . y_i on the diagonal
    C = x.shape[0]
    return jnp.where(_iota((C, C), 0) == _iota((C, C), 1), _rowsum(x * y), 0.0)


def _last_row(x):  # [C, D] -> [1, D]
    return jnp.sum(jnp.where(_iota((x.shape[0], 1), 0) == x.shape[0] - 1, x, 0.0), axis=0, keepdims=True)


def chunk_intra(q, k, v, g, beta) -> Intra:
    """q, k: [C, K]; v: [C, V]; g: [C, K] per-step log2 gate; beta: [C, 1] (all float32).

    Aqk[i, j] = sum_d q_id k_jd 2^(G_id - G_jd) (j <= i) and Kkk likewise (j < i), one
    masked [C, K] x [K, C] matmul per dyadic level (:func:`_level`)."""
    C = k.shape[0]
    i, j = _iota((C, C), 0), _iota((C, C), 1)
    G = _dot(_ones_where(i >= j), g)  # [C, K] inclusive cumsum
    Aqk = _diag(q, k)
    Kkk = jnp.zeros((C, C), jnp.float32)
    for s in dyadic_levels(C):
        el, eu, block = _level(G, s)
        k_u = k * eu
        Aqk = Aqk + jnp.where(block, _dot_t(q * el, k_u), 0.0)
        Kkk = Kkk + jnp.where(block, _dot_t(k * el, k_u), 0.0)
    T = unit_lower_inverse_masked(beta * Kkk)
    eG = jnp.exp2(G)
    G_end = _last_row(G)
    k_g = k * eG
    w = _dot(T, beta * k_g)
    u = _dot(T, beta * v)
    return Intra(G, Aqk, Kkk, T, w, u, q * eG, k_g, k * jnp.exp2(G_end - G), jnp.exp2(G_end))


class Grads(NamedTuple):
    dq: jax.Array  # [C, K]
    dk: jax.Array  # [C, K]
    dv: jax.Array  # [C, V]
    dg: jax.Array  # [C, K] w.r.t. the natural-log gate
    dbeta: jax.Array  # [C, 1]
    dS_in: jax.Array  # [V, K] cotangent of the state entering the chunk (transposed)


def chunk_grads(q, k, v, g, beta, St, do, dSt) -> Grads:
    """Backward of one chunk. St, dSt: [V, K] the entering state and the cotangent of the
    leaving one (both transposed); do: [C, V]; the rest as :func:`chunk_intra`.
    The formulas are those of docs/kda_xla.md (Backward)."""
    C = k.shape[0]
    i, j = _iota((C, C), 0), _iota((C, C), 1)
    I = chunk_intra(q, k, v, g, beta)
    v_new = I.u - _dot_t(I.w, St)  # [C, V]
    dv_new = _t_dot(I.Aqk, do) + _dot_t(I.k_d, dSt)
    dS_in = _t_dot(do, I.q_g) + dSt * I.decay - _t_dot(dv_new, I.w)  # [V, K]
    dq_g = _dot(do, St)
    dAqk = jnp.where(i >= j, _dot_t(do, v_new), 0.0)
    dk_d = _dot(v_new, dSt)
    dw = -_dot(dv_new, St)
    ddecay = I.decay * jnp.sum(St * dSt, axis=0, keepdims=True)  # [1, K]
    dbk_g, dbv = _t_dot(I.T, dw), _t_dot(I.T, dv_new)  # (I + Akk)^-T [dw du]
    dAkk = jnp.where(i > j, -(_dot_t(dbk_g, I.w) + _dot_t(dbv, I.u)), 0.0)
    dbeta = _rowsum(v * dbv) + _rowsum(I.k_g * dbk_g) + _rowsum(dAkk * I.Kkk)
    dk_g, dKkk = beta * dbk_g, beta * dAkk
    dq_p = dk_p = dk_x = dk_y = jnp.zeros_like(k)
    for s in dyadic_levels(C):
        el, eu, block = _level(I.G, s)
        dQ, dK = jnp.where(block, dAqk, 0.0), jnp.where(block, dKkk, 0.0)
        k_u = k * eu
        dq_p = dq_p + _dot(dQ, k_u) * el
        dk_p = dk_p + _t_dot(dQ, q * el) * eu
        dk_x = dk_x + _dot(dK, k_u) * el
        dk_y = dk_y + _t_dot(dK, k * el) * eu
    d = _rowsum(jnp.where(i == j, dAqk, 0.0))  # [C, 1] diagonal of dAqk
    eG = jnp.exp2(I.G)
    dq = eG * dq_g + dq_p + d * k
    dk = eG * dk_g + jnp.exp2(_last_row(I.G) - I.G) * dk_d + dk_p + d * q + dk_x + dk_y
    dG = I.q_g * dq_g + I.k_g * dk_g - I.k_d * dk_d + q * dq_p - k * dk_p + k * dk_x - k * dk_y
    dG_end = jnp.sum(I.k_d * dk_d, axis=0, keepdims=True) + ddecay  # [1, K]
    dg = _dot(_ones_where(i <= j), dG) + dG_end  # reverse cumsum
    return Grads(dq, dk, beta * dbv, dg, dbeta, dS_in)


# ----------------------------------------------------------------------------- kernels
# Scalar-prefetch refs, per chunk: first (starts its sequence), last (ends it), seq (its id).


def _state_step(first, last, h0_ref, fin_ref, St, w, u, k_d, decay):
    """One chunk of the sequential state pass: reset St to h0 at a sequence start,
    v_new = u - w S, St <- St decay + v_new^T k_d, write the final state at a sequence end.
    Returns (S entering the chunk [BV, K], v_new [C, BV])."""
    c = pl.program_id(3)

    @pl.when(first[c] == 1)
    def _():
        St[...] = h0_ref[0, 0, 0]

    S = St[...]
    v_new = u - _dot_t(w, S)
    S_next = S * decay + _t_dot(v_new, k_d)
    St[...] = S_next

    @pl.when(last[c] == 1)
    def _():
        fin_ref[0, 0, 0] = S_next

    return S, v_new


def _fused_kernel(first, last, seq, q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, o_ref, fin_ref, *rest):
    """Grid (B, HV, V-blocks, chunks). Blocks: q, k, g [C, K]; v, o [C, BV]; beta [C, 1];
    h0, final (and S_in if stored) [BV, K]; scratch St [BV, K] carried across chunks."""
    *s_in_ref, St = rest
    I = chunk_intra(q_ref[0, 0], k_ref[0, 0], v_ref[0, 0], g_ref[0, 0] * LOG2E, b_ref[0, 0])
    S, v_new = _state_step(first, last, h0_ref, fin_ref, St, I.w, I.u, I.k_d, I.decay)
    if s_in_ref:
        s_in_ref[0][0, 0, 0] = S
    o_ref[0, 0] = (_dot_t(I.q_g, S) + _dot(I.Aqk, v_new)).astype(o_ref.dtype)


def _intra_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, aqk_ref, w_ref, u_ref, qg_ref, kd_ref, dec_ref):
    """Grid (B, HV, chunks), all parallel. Writes the chunk's Aqk [C, C], w, q_g, k_d [C, K],
    u [C, V] and its decay [8, K] (row 0, broadcast)."""
    I = chunk_intra(q_ref[0, 0], k_ref[0, 0], v_ref[0, 0], g_ref[0, 0] * LOG2E, b_ref[0, 0])
    aqk_ref[0, 0], w_ref[0, 0], u_ref[0, 0], qg_ref[0, 0], kd_ref[0, 0] = I.Aqk, I.w, I.u, I.q_g, I.k_d
    dec_ref[0, 0] = jnp.broadcast_to(I.decay, dec_ref.shape[2:])


def _state_kernel(first, last, seq, w_ref, u_ref, kd_ref, dec_ref, h0_ref, vn_ref, sin_ref, fin_ref, St):
    """Grid (B, HV, V-blocks, chunks): the state pass alone, storing S_in and v_new."""
    S, v_new = _state_step(first, last, h0_ref, fin_ref, St, w_ref[0, 0], u_ref[0, 0], kd_ref[0, 0], dec_ref[0, 0][:1])
    sin_ref[0, 0, 0] = S
    vn_ref[0, 0] = v_new


def _output_kernel(aqk_ref, qg_ref, vn_ref, sin_ref, o_ref):
    """Grid (B, HV, chunks, V-blocks), all parallel: o = q_g S + Aqk v_new."""
    o = _dot_t(qg_ref[0, 0], sin_ref[0, 0, 0]) + _dot(aqk_ref[0, 0], vn_ref[0, 0])
    o_ref[0, 0] = o.astype(o_ref.dtype)


def _bwd_kernel(first, last, seq, q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, do_ref, df_ref,
                dq_ref, dk_ref, dv_ref, dg_ref, db_ref, dh0_ref, dSt):  # fmt: skip
    """Grid (B, HV, chunks), chunks walked last to first; the cotangent of the state
    (transposed, [V, K]) carried in scratch. dq, dk come out per value head."""
    n = pl.num_programs(2)
    c = n - 1 - pl.program_id(2)

    @pl.when(pl.program_id(2) == 0)
    def _():
        dSt[...] = jnp.zeros_like(dSt)

    @pl.when(last[c] == 1)
    def _():
        dSt[...] = df_ref[0, 0, 0]

    r = chunk_grads(q_ref[0, 0], k_ref[0, 0], v_ref[0, 0], g_ref[0, 0] * LOG2E, b_ref[0, 0], s_ref[0, 0, 0], do_ref[0, 0],
                    dSt[...])  # fmt: skip
    dq_ref[0, 0], dk_ref[0, 0], dv_ref[0, 0], dg_ref[0, 0], db_ref[0, 0] = r.dq, r.dk, r.dv, r.dg, r.dbeta
    dSt[...] = r.dS_in

    @pl.when(first[c] == 1)
    def _():
        dh0_ref[0, 0, 0] = r.dS_in


# ----------------------------------------------------------------------------- wrapper


def _interpret(cfg: Config):
    interpret = jax.default_backend() != "tpu" if cfg.interpret is None else cfg.interpret
    return pltpu.InterpretParams(detect_races=cfg.detect_races) if interpret else False


def _pad_last(x: jax.Array, n: int) -> jax.Array:
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n - x.shape[-1])])


def _forward(q, k, v, g, beta, h0t, sched, groups: int, cfg: Config, save_states: bool):
    """Head-major padded inputs: q, k [B, H, L, Kp]; v [B, HV, L, Vp]; g [B, HV, L, Kp] (natural log);
    beta [B, HV, L, 1]; h0t [B, N, HV, Vp, Kp]; sched (first, last, seq) int32 [NC].
    Returns o [B, HV, L, Vp], final [B, N, HV, Vp, Kp], S_in [B, HV, NC, Vp, Kp] or None."""
    B, HV, L, Vp = v.shape
    Kp = k.shape[-1]
    NC = sched[0].shape[0]
    C = L // NC
    BV = cfg.block_v
    NV = Vp // BV
    f32 = jnp.float32
    interpret = _interpret(cfg)
    qk_spec = pl.BlockSpec((1, 1, C, Kp), lambda b, h, vb, c, *_: (b, lax.div(h, jnp.int32(groups)), c, 0))
    k_spec = pl.BlockSpec((1, 1, C, Kp), lambda b, h, vb, c, *_: (b, h, c, 0))
    v_spec = pl.BlockSpec((1, 1, C, BV), lambda b, h, vb, c, *_: (b, h, c, vb))
    b_spec = pl.BlockSpec((1, 1, C, 1), lambda b, h, vb, c, *_: (b, h, c, 0))
    st_spec = pl.BlockSpec((1, 1, 1, BV, Kp), lambda b, h, vb, c, first, last, seq: (b, seq[c], h, vb, 0))
    sin_spec = pl.BlockSpec((1, 1, 1, BV, Kp), lambda b, h, vb, c, *_: (b, h, c, vb, 0))
    o_shape = jax.ShapeDtypeStruct((B, HV, L, Vp), f32)
    fin_shape = jax.ShapeDtypeStruct(h0t.shape, f32)
    sin_shape = jax.ShapeDtypeStruct((B, HV, NC, Vp, Kp), f32)
    sequential = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))

    if cfg.pipeline == "fused":
        out_specs = [v_spec, st_spec] + ([sin_spec] if save_states else [])
        out_shape = [o_shape, fin_shape] + ([sin_shape] if save_states else [])
        outs = pl.pallas_call(
            _fused_kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=3, grid=(B, HV, NV, NC),
                in_specs=[qk_spec, qk_spec, v_spec, k_spec, b_spec, st_spec],
                out_specs=out_specs, scratch_shapes=[pltpu.VMEM((BV, Kp), f32)],
            ),
            out_shape=out_shape, compiler_params=sequential, interpret=interpret,
        )(*sched, q, k, v, g, beta, h0t)  # fmt: skip
        return outs[0], outs[1], (outs[2] if save_states else None)

    # staged: intra (parallel) -> state (sequential over chunks) -> output (parallel)
    par3 = pltpu.CompilerParams(dimension_semantics=("parallel",) * 3)
    spec3 = lambda d, f=lambda b, h, c: (b, h, c, 0): pl.BlockSpec((1, 1, C, d), f)
    aqk, w, u, q_g, k_d, dec = pl.pallas_call(
        _intra_kernel,
        grid=(B, HV, NC),
        in_specs=[spec3(Kp, lambda b, h, c: (b, lax.div(h, jnp.int32(groups)), c, 0))] * 2 + [spec3(Vp), spec3(Kp), spec3(1)],
        out_specs=[spec3(C), spec3(Kp), spec3(Vp), spec3(Kp), spec3(Kp), pl.BlockSpec((1, 1, 8, Kp), lambda b, h, c: (b, h, c, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, HV, L, d), f32) for d in (C, Kp, Vp, Kp, Kp)]
        + [jax.ShapeDtypeStruct((B, HV, NC * 8, Kp), f32)],
        compiler_params=par3, interpret=interpret,
    )(q, k, v, g, beta)  # fmt: skip
    dec_spec = pl.BlockSpec((1, 1, 8, Kp), lambda b, h, vb, c, *_: (b, h, c, 0))
    v_new, s_in, final = pl.pallas_call(
        _state_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(B, HV, NV, NC),
            in_specs=[k_spec, v_spec, k_spec, dec_spec, st_spec],
            out_specs=[v_spec, sin_spec, st_spec], scratch_shapes=[pltpu.VMEM((BV, Kp), f32)],
        ),
        out_shape=[jax.ShapeDtypeStruct((B, HV, L, Vp), f32), sin_shape, fin_shape],
        compiler_params=sequential, interpret=interpret,
    )(*sched, w, u, k_d, dec, h0t)  # fmt: skip
    o = pl.pallas_call(
        _output_kernel,
        grid=(B, HV, NC, NV),
        in_specs=[
            pl.BlockSpec((1, 1, C, C), lambda b, h, c, vb: (b, h, c, 0)),
            pl.BlockSpec((1, 1, C, Kp), lambda b, h, c, vb: (b, h, c, 0)),
            pl.BlockSpec((1, 1, C, BV), lambda b, h, c, vb: (b, h, c, vb)),
            pl.BlockSpec((1, 1, 1, BV, Kp), lambda b, h, c, vb: (b, h, c, vb, 0)),
        ],
        out_specs=pl.BlockSpec((1, 1, C, BV), lambda b, h, c, vb: (b, h, c, vb)),
        out_shape=o_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 4), interpret=interpret,
    )(aqk, q_g, v_new, s_in)  # fmt: skip
    return o, final, (s_in if save_states else None)


def _backward(q, k, v, g, beta, sched, S_in, do, dfinal_t, groups: int, cfg: Config):
    """Cotangents of the head-major padded inputs of :func:`_forward` (dq, dk summed over
    each group's value heads). do: [B, HV, L, Vp]; dfinal_t: [B, N, HV, Vp, Kp]."""
    B, HV, L, Vp = v.shape
    H, Kp = k.shape[1], k.shape[-1]
    NC = sched[0].shape[0]
    C = L // NC
    f32 = jnp.float32

    def spec(d, head=lambda h: h):
        return pl.BlockSpec((1, 1, C, d), lambda b, h, c, *_: (b, head(h), NC - 1 - c, 0))

    qk = spec(Kp, lambda h: lax.div(h, jnp.int32(groups)))
    st = pl.BlockSpec((1, 1, 1, Vp, Kp), lambda b, h, c, first, last, seq: (b, seq[NC - 1 - c], h, 0, 0))
    sin = pl.BlockSpec((1, 1, 1, Vp, Kp), lambda b, h, c, *_: (b, h, NC - 1 - c, 0, 0))
    dq, dk, dv, dg, dbeta, dh0t = pl.pallas_call(
        _bwd_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(B, HV, NC),
            in_specs=[qk, qk, spec(Vp), spec(Kp), spec(1), sin, spec(Vp), st],
            out_specs=[spec(Kp), spec(Kp), spec(Vp), spec(Kp), spec(1), st],
            scratch_shapes=[pltpu.VMEM((Vp, Kp), f32)],
        ),
        out_shape=[jax.ShapeDtypeStruct((B, HV, L, d), f32) for d in (Kp, Kp, Vp, Kp, 1)]
        + [jax.ShapeDtypeStruct(dfinal_t.shape, f32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=_interpret(cfg),
    )(*sched, q, k, v, g, beta, S_in, do, dfinal_t)  # fmt: skip
    dq, dk = (x.reshape(B, H, groups, L, Kp).sum(2) for x in (dq, dk))
    return dq, dk, dv, dg, dbeta, dh0t


def _if_empty(empty, x, y):
    """Per sequence: x where the sequence has no tokens (no chunk of its own, so the kernels
    never write its final state or dh0), else y. empty: [N]; x, y: [B, N, ...]."""
    return jnp.where(empty.reshape((1, -1) + (1,) * (x.ndim - 2)), x, y)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _core(q, k, v, g, beta, h0t, sched, empty, groups, cfg):
    o, final, _ = _forward(q, k, v, g, beta, h0t, sched, groups, cfg, save_states=False)
    return o, _if_empty(empty, h0t, final)


def _core_fwd(q, k, v, g, beta, h0t, sched, empty, groups, cfg):
    o, final, S_in = _forward(q, k, v, g, beta, h0t, sched, groups, cfg, save_states=True)
    return (o, _if_empty(empty, h0t, final)), (q, k, v, g, beta, sched, empty, S_in)


def _core_bwd(groups, cfg, res, cts):
    q, k, v, g, beta, sched, empty, S_in = res
    do, dfinal_t = cts
    dq, dk, dv, dg, dbeta, dh0t = _backward(q, k, v, g, beta, sched, S_in, do, dfinal_t, groups, cfg)
    return dq, dk, dv, dg, dbeta, _if_empty(empty, dfinal_t, dh0t), (None, None, None), None


_core.defvjp(_core_fwd, _core_bwd)


def _head_major(layout: ChunkLayout, x: jax.Array, width: int | None) -> jax.Array:
    """[B, T, heads, D] -> [B, heads, NC * C, width] (packed, D zero-padded to width)."""
    x = jnp.moveaxis(layout.pack(x), 2, 1)
    return x if width is None else _pad_last(x, width)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def chunk_kda_pallas_tpu(q, k, v, g, beta, h0, layout: ChunkLayout, cfg: Config | None = None):
    """Core chunked KDA with the TPU kernels, on prepared float32 inputs.

    q, k: [B, T, H, K] (q scaled, not repeated over value heads); v: [B, T, HV, V];
    g: [B, T, HV, K] natural-log decay; beta: [B, T, HV]; h0: [B, N, HV, K, V].
    Returns (o [B, T, HV, V], final [B, N, HV, K, V])."""
    cfg = CONFIG if cfg is None else cfg
    if cfg.pipeline not in ("fused", "staged"):
        raise ValueError(f"cfg.pipeline: expected 'fused' or 'staged', got {cfg.pipeline!r}")
    if cfg.block_v % LANE:
        raise ValueError(f"cfg.block_v: expected a multiple of {LANE}, got {cfg.block_v}")
    H, K = q.shape[2:]
    HV, V = v.shape[2:]
    Kp = _round_up(K, LANE)
    Vp = _round_up(V, max(LANE, cfg.block_v))
    cfg = dataclasses.replace(cfg, block_v=min(cfg.block_v, Vp))
    qh, kh, gh = (_head_major(layout, x, Kp) for x in (q, k, g))
    vh = _head_major(layout, v, Vp)
    bh = _head_major(layout, beta[..., None], None)
    h0t = _pad_last(jnp.swapaxes(_pad_last(h0, Vp), -1, -2), Kp)  # [B, N, HV, Vp, Kp]
    i32 = jnp.int32
    sched = (layout.chunk_first.astype(i32), layout.chunk_last.astype(i32), layout.chunk_seq)
    o, final = _core(qh, kh, vh, gh, bh, h0t, sched, layout.seq_empty, HV // H, cfg)
    o = layout.unpack(jnp.moveaxis(o[..., :V], 1, 2))
    return o, jnp.swapaxes(final, -1, -2)[..., :K, :V]
