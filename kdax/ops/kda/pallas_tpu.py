"""Chunked KDA as Mosaic TPU kernels (``backend="pallas_tpu"``): forward.

Layout inside the kernels: head-major ``[B, heads, slots, D]`` with K and V padded to
multiples of 128, one chunk of C slots per grid step, the state kept transposed
(``St = S^T``, ``[V, K]``) so the per-key decay scales its lanes. GVA maps value
head h to q/k head ``h // (HV // H)`` in the index maps (q and k are never repeated).
Variable-length batches come in through scalar prefetch: per chunk, whether it starts
or ends its sequence and which sequence it belongs to.

The chunk math is :mod:`kdax.ops.kda.tiles` (full-tile operations only, shared with the
GPU kernels). Two kernel pipelines compute the forward (docs/kda_tpu.md):

- ``fused``: one kernel per (batch, head, V-block) walking the chunks, everything
  on chip (default);
- ``staged``: intra-chunk kernel -> state kernel -> output kernel, through HBM.

Off TPU the kernels run in the Pallas TPU interpreter (for tests; slow).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kdax.ops.common.varlen import ChunkLayout
from kdax.ops.kda.tiles import Tiles, head_major, pad_last, round_up
from kdax.ops.kda.xla import LOG2E

LANE = 128
_TILES = Tiles(precision=lax.Precision.HIGHEST, matmul_reductions=True)  # see Precision in docs/kda_tpu.md


@dataclasses.dataclass(frozen=True)
class Config:
    """How the forward runs: ``pipeline`` "fused" or "staged"; ``block_v`` (a multiple of
    128) splits V over grid programs; ``interpret`` None = interpret unless on TPU."""

    pipeline: str = "fused"
    block_v: int = 128
    interpret: bool | None = None
    detect_races: bool = False

    def resolved(self) -> Config:
        """This config, its fields checked, with ``interpret`` None replaced by what it means here."""
        if self.pipeline not in ("fused", "staged"):
            raise ValueError(f"config.pipeline: expected 'fused' or 'staged', got {self.pipeline!r}")
        if self.block_v % LANE:
            raise ValueError(f"config.block_v: expected a multiple of {LANE}, got {self.block_v}")
        interpret = jax.default_backend() != "tpu" if self.interpret is None else self.interpret
        return dataclasses.replace(self, interpret=interpret)


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
    v_new = u - _TILES.dot_t(w, S)
    S_next = S * decay + _TILES.t_dot(v_new, k_d)
    St[...] = S_next

    @pl.when(last[c] == 1)
    def _():
        fin_ref[0, 0, 0] = S_next

    return S, v_new


def _fused_kernel(first, last, seq, q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, o_ref, fin_ref, *rest):
    """Grid (B, HV, V-blocks, chunks). Blocks: q, k, g [C, K]; v, o [C, BV]; beta [C, 1];
    h0, final (and S_in if stored) [BV, K]; scratch St [BV, K] carried across chunks."""
    *s_in_ref, St = rest
    I = _TILES.intra(q_ref[0, 0], k_ref[0, 0], v_ref[0, 0], g_ref[0, 0] * LOG2E, b_ref[0, 0])
    S, v_new = _state_step(first, last, h0_ref, fin_ref, St, I.w, I.u, I.k_d, I.decay)
    if s_in_ref:
        s_in_ref[0][0, 0, 0] = S
    o_ref[0, 0] = (_TILES.dot_t(I.q_g, S) + _TILES.dot(I.Aqk, v_new)).astype(o_ref.dtype)


def _intra_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, aqk_ref, w_ref, u_ref, qg_ref, kd_ref, dec_ref):
    """Grid (B, HV, chunks), all parallel. Writes the chunk's Aqk [C, C], w, q_g, k_d [C, K],
    u [C, V] and its decay [8, K] (row 0, broadcast)."""
    I = _TILES.intra(q_ref[0, 0], k_ref[0, 0], v_ref[0, 0], g_ref[0, 0] * LOG2E, b_ref[0, 0])
    aqk_ref[0, 0], w_ref[0, 0], u_ref[0, 0], qg_ref[0, 0], kd_ref[0, 0] = I.Aqk, I.w, I.u, I.q_g, I.k_d
    dec_ref[0, 0] = jnp.broadcast_to(I.decay, dec_ref.shape[2:])


def _state_kernel(first, last, seq, w_ref, u_ref, kd_ref, dec_ref, h0_ref, vn_ref, sin_ref, fin_ref, St):
    """Grid (B, HV, V-blocks, chunks): the state pass alone, storing S_in and v_new."""
    S, v_new = _state_step(first, last, h0_ref, fin_ref, St, w_ref[0, 0], u_ref[0, 0], kd_ref[0, 0], dec_ref[0, 0][:1])
    sin_ref[0, 0, 0] = S
    vn_ref[0, 0] = v_new


def _output_kernel(aqk_ref, qg_ref, vn_ref, sin_ref, o_ref):
    """Grid (B, HV, chunks, V-blocks), all parallel: o = q_g S + Aqk v_new."""
    o = _TILES.dot_t(qg_ref[0, 0], sin_ref[0, 0, 0]) + _TILES.dot(aqk_ref[0, 0], vn_ref[0, 0])
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

    q, k, v, beta, S = q_ref[0, 0], k_ref[0, 0], v_ref[0, 0], b_ref[0, 0], s_ref[0, 0, 0]
    I = _TILES.intra(q, k, v, g_ref[0, 0] * LOG2E, beta)
    r = _TILES.grads(q, k, v, beta, I, _TILES.v_new(I, S), S, do_ref[0, 0], dSt[...])
    dq_ref[0, 0], dk_ref[0, 0], dv_ref[0, 0], dg_ref[0, 0], db_ref[0, 0] = r.dq, r.dk, r.dv, r.dg, r.dbeta
    dSt[...] = r.dS_in

    @pl.when(first[c] == 1)
    def _():
        dh0_ref[0, 0, 0] = r.dS_in


# ----------------------------------------------------------------------------- wrapper


def _interpret(cfg: Config):
    return pltpu.InterpretParams(detect_races=cfg.detect_races) if cfg.interpret else False


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


def chunk_kda_pallas_tpu(q, k, v, g, beta, h0, layout: ChunkLayout, cfg: Config = Config()):
    """Core chunked KDA with the TPU kernels, on prepared float32 inputs.

    q, k: [B, T, H, K] (q scaled, not repeated over value heads); v: [B, T, HV, V];
    g: [B, T, HV, K] natural-log decay; beta: [B, T, HV]; h0: [B, N, HV, K, V].
    Returns (o [B, T, HV, V], final [B, N, HV, K, V])."""
    cfg = cfg.resolved()
    H, K = q.shape[2:]
    HV, V = v.shape[2:]
    Kp = round_up(K, LANE)
    Vp = round_up(V, max(LANE, cfg.block_v))
    cfg = dataclasses.replace(cfg, block_v=min(cfg.block_v, Vp))
    qh, kh, gh = (head_major(layout, x, Kp) for x in (q, k, g))
    vh = head_major(layout, v, Vp)
    bh = head_major(layout, beta[..., None], None)
    h0t = pad_last(jnp.swapaxes(pad_last(h0, Vp), -1, -2), Kp)  # [B, N, HV, Vp, Kp]
    i32 = jnp.int32
    sched = (layout.chunk_first.astype(i32), layout.chunk_last.astype(i32), layout.chunk_seq)
    o, final = _core(qh, kh, vh, gh, bh, h0t, sched, layout.seq_empty, HV // H, cfg)
    o = layout.unpack(jnp.moveaxis(o[..., :V], 1, 2))
    return o, jnp.swapaxes(final, -1, -2)[..., :K, :V]
