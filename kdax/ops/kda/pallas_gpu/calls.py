"""The pallas_calls of the GPU kernels, one helper each, and the forward and backward that
chain them (docs/kda_gpu.md, "Kernels").

Inputs, o and the gradients are token-major ``[B, L, heads, D]`` as the caller has them (no
layout copies); the intermediates the kernels pass each other are head-major ``[B, HV, L, D]``.
L is the padded slot axis (a multiple of the chunk C), Kp and Vp the padded head dims.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kdax.ops.kda.pallas_gpu import kernels
from kdax.ops.kda.pallas_gpu.kernels import QK, SUB, Gate
from kdax.ops.kda.pallas_gpu.launch import Config, block_k, interpreted, params, stored_dtype
from kdax.ops.kda.tiles import Tiles


@dataclasses.dataclass(frozen=True)
class Static:
    """What every pallas_call of one op call shares: the chunk size C, value heads per q/k head,
    the matmuls (:class:`~kdax.ops.kda.tiles.Tiles`), the config (blocks resolved), and how the
    kernels take g and q, k (:class:`~kdax.ops.kda.pallas_gpu.kernels.Gate`, :class:`QK`)."""

    C: int
    groups: int
    tiles: Tiles
    cfg: Config
    gate: Gate
    qk: QK

    def block_k(self, kernel: str, Kp: int) -> int:  # the key-column block of ``kernel``
        return block_k(self.cfg, self.tiles, kernel, Kp)

    def call(self, kernel, name: str, *args, **kwargs):  # pl.pallas_call of ``kernel`` with this call's tiles
        launch = kwargs.pop("launch", name)
        return pl.pallas_call(
            functools.partial(kernel, self.tiles, *args),
            name=f"kda_{name}",
            compiler_params=params(self.cfg, launch),
            interpret=interpreted(self.cfg),
            **kwargs,
        )


def _per_chunk(C: int, d: int):  # chunk c of head-major [B, HV, L, d] on grid (b, h, c)
    return pl.BlockSpec((None, None, C, d), lambda b, h, c: (b, h, c, 0))


def _head(h, groups: int):  # the q/k head of value head h
    return lax.div(h, jnp.int32(groups))


def _tokens(C: int, d: int, groups: int = 1):  # chunk c of token-major [B, L, heads, d] on grid (b, h, c)
    return pl.BlockSpec((None, C, None, d), lambda b, h, c: (b, c, _head(h, groups), 0))


def _token_cols(C: int, d: int, groups: int = 1):  # its column block j on grid (b, h, c, j)
    return pl.BlockSpec((None, C, None, d), lambda b, h, c, j: (b, c, _head(h, groups), j))


def _chunk_state(Vp: int, Kp: int):  # [B, HV, NC, Vp, Kp] -> the state of chunk c [Vp, Kp] on grid (b, h, c)
    return pl.BlockSpec((None, None, None, Vp, Kp), lambda b, h, c: (b, h, c, 0, 0))


# Specs of the sequential kernels, grid (b, n, h, vb): they see the whole slot (or chunk) axis.


def _whole(*tail):  # [B, HV, rows, D] -> [rows, D]
    return pl.BlockSpec((None, None, *tail), lambda b, n, h, vb: (b, h, 0, 0))


def _whole_vblock(rows: int, BV: int):  # [B, HV, rows, Vp] -> [rows, BV]
    return pl.BlockSpec((None, None, rows, BV), lambda b, n, h, vb: (b, h, 0, vb))


def _whole_tokens(L: int, BV: int):  # token-major [B, L, HV, Vp] -> [L, BV]
    return pl.BlockSpec((None, L, None, BV), lambda b, n, h, vb: (b, 0, h, vb))


def _chunk_states(NC: int, BV: int, Kp: int):  # [B, HV, NC, Vp, Kp] -> [NC, BV, Kp]
    return pl.BlockSpec((None, None, NC, BV, Kp), lambda b, n, h, vb: (b, h, 0, vb, 0))


def _seq_state(BV: int, Kp: int):  # [B, N, HV, Vp, Kp] -> [BV, Kp] of sequence n
    return pl.BlockSpec((None, None, None, BV, Kp), lambda b, n, h, vb: (b, n, h, vb, 0))


def _seq_range(N: int):  # [N] int32, whole
    return pl.BlockSpec((N,), lambda *_: (0,))


def _per_chunk_row(d: int):  # row c of [B, HV, NC, d] on grid (b, h, c)
    return pl.BlockSpec((None, None, 1, d), lambda b, h, c: (b, h, c, 0))


def _gate_spec(Kp: int):  # per-head gate parameters [HV, 2, Kp] on grid (b, h, c)
    return pl.BlockSpec((None, 2, Kp), lambda b, h, c: (h, 0, 0))


def _shape(B: int, HV: int, L: int, d: int, dtype):  # head-major [B, HV, L, d]
    return jax.ShapeDtypeStruct((B, HV, L, d), dtype)


# ----------------------------------------------------------------------------- forward


def diag(s: Static, q, k, g, gp, beta):
    """The diagonal S x S blocks of Aqk, Kkk and T [B, HV, L, S] (S = SUB) and with the L2 norm
    the rows' factors [B, HV, L, 2] (``kda_diag``)."""
    B, L, HV, _ = beta.shape
    Kp, S, f32, sd = k.shape[-1], min(SUB, s.C), jnp.float32, stored_dtype(s.tiles)
    return s.call(
        kernels.diag_kernel,
        "diag",
        s.gate,
        s.qk,
        s.block_k("diag", Kp),
        grid=(B, HV, L // S),
        in_specs=[_tokens(S, Kp, s.groups)] * 2 + [_tokens(S, Kp), _gate_spec(Kp), _tokens(S, 1)],
        out_specs=[_per_chunk(S, S)] * 3 + [_per_chunk(S, 2)] * s.qk.l2norm,
        out_shape=[_shape(B, HV, L, S, t) for t in (sd, f32, f32)] + [_shape(B, HV, L, 2, f32)] * s.qk.l2norm,
    )(q, k, g, gp, beta)


def _intra(s: Static, name: str, q, k, v, g, gp, beta, ins, widths, outs):
    """The intra kernel as ``name`` ("intra": ins are diag's outputs; "recompute": the kept T),
    its outputs ``outs`` [(width, dtype)] with the decay [B, HV, NC, Kp] after the first ``widths``."""
    B, L, HV, Vp = v.shape
    Kp, C = k.shape[-1], s.C
    spec, tok = functools.partial(_per_chunk, C), functools.partial(_tokens, C)
    out_specs = [spec(d) for d, _ in outs]
    out_shape = [_shape(B, HV, L, d, t) for d, t in outs]
    out_specs.insert(widths, _per_chunk_row(Kp))
    out_shape.insert(widths, jax.ShapeDtypeStruct((B, HV, L // C, Kp), jnp.float32))
    return s.call(
        kernels.intra_kernel,
        name,
        s.gate,
        s.qk,
        s.block_k(name, Kp),
        s.cfg.block_v,
        interpreted(s.cfg),
        name == "intra",
        grid=(B, HV, L // C),
        in_specs=[tok(Kp, s.groups), tok(Kp, s.groups), tok(Vp), tok(Kp), _gate_spec(Kp), tok(1)]
        + [spec(x.shape[-1]) for x in ins],
        out_specs=out_specs,
        out_shape=out_shape,
    )(q, k, v, g, gp, beta, *ins)


def intra(s: Static, q, k, v, g, gp, beta, diagonal, backward: bool):
    """From :func:`diag`'s outputs: Aqk [B, HV, L, C], w [.., Kp], u [.., Vp], q_g, k_d [.., Kp],
    decay [B, HV, NC, Kp], and with ``backward`` also Kkk (float32) and T [B, HV, L, C]; the
    [.., D] ones in :func:`~kdax.ops.kda.pallas_gpu.launch.stored_dtype` dtype (``kda_intra``)."""
    Kp, Vp, C, sd = k.shape[-1], v.shape[-1], s.C, stored_dtype(s.tiles)
    outs = [(C, sd), (Kp, sd), (Vp, sd), (Kp, sd), (Kp, sd)] + ([(C, jnp.float32), (C, sd)] if backward else [])
    return _intra(s, "intra", q, k, v, g, gp, beta, diagonal, 5, outs)


def recompute(s: Static, q, k, v, g, gp, beta, T):
    """w, u, q_g, k_d and decay as :func:`intra` writes them, from the forward's T (``kda_recompute``)."""
    Kp, Vp, sd = k.shape[-1], v.shape[-1], stored_dtype(s.tiles)
    return _intra(s, "recompute", q, k, v, g, gp, beta, [T], 4, [(Kp, sd), (Vp, sd), (Kp, sd), (Kp, sd)])


def state(s: Static, w, u, k_d, dec, h0t, ranges):
    """The chunk recurrence: v_new [B, HV, L, Vp], the states entering the chunks S_in
    [B, HV, NC, Vp, Kp] (both stored dtype) and the final states [B, N, HV, Vp, Kp] (float32)."""
    B, HV, L, Vp = u.shape
    Kp, NC, N, BV, sd = w.shape[-1], L // s.C, h0t.shape[1], s.cfg.block_v, stored_dtype(s.tiles)
    seq, st = _seq_range(N), _seq_state(BV, Kp)
    return s.call(
        kernels.state_kernel,
        "state",
        s.C,
        grid=(B, N, HV, Vp // BV),
        in_specs=[seq, seq, _whole(L, Kp), _whole_vblock(L, BV), _whole(L, Kp), _whole(NC, Kp), st],
        out_specs=[_whole_vblock(L, BV), _chunk_states(NC, BV, Kp), st],
        out_shape=[
            _shape(B, HV, L, Vp, sd),
            jax.ShapeDtypeStruct((B, HV, NC, Vp, Kp), sd),
            jax.ShapeDtypeStruct(h0t.shape, jnp.float32),
        ],
    )(*ranges, w, u, k_d, dec, h0t)


def output(s: Static, aqk, q_g, v_new, s_in, dtype):
    """o = q_g S_in + Aqk v_new, token-major [B, L, HV, Vp] in ``dtype``."""
    B, HV, L, Vp = v_new.shape
    C, Kp, BV = s.C, q_g.shape[-1], s.cfg.block_v
    return s.call(
        kernels.output_kernel,
        "output",
        grid=(B, HV, L // C, Vp // BV),
        in_specs=[
            pl.BlockSpec((None, None, C, C), lambda b, h, c, vb: (b, h, c, 0)),
            pl.BlockSpec((None, None, C, Kp), lambda b, h, c, vb: (b, h, c, 0)),
            pl.BlockSpec((None, None, C, BV), lambda b, h, c, vb: (b, h, c, vb)),
            pl.BlockSpec((None, None, None, BV, Kp), lambda b, h, c, vb: (b, h, c, vb, 0)),
        ],
        out_specs=_token_cols(C, BV),
        out_shape=jax.ShapeDtypeStruct((B, L, HV, Vp), dtype),
    )(aqk, q_g, v_new, s_in)


def forward(s: Static, q, k, v, g, gp, beta, h0t, ranges, keep):
    """Token-major inputs on the padded slot axis: q, k [B, L, H, Kp] (as :class:`QK` ``s.qk`` takes
    them), v [B, L, HV, Vp] (stored dtype); g [B, L, HV, Kp] (natural-log decay or logits,
    :class:`Gate`) and its parameters gp [HV, 2, Kp]; beta [B, L, HV, 1] (float32);
    h0t [B, N, HV, Vp, Kp]; ranges (start, end) int32 [N] chunk range of each sequence.
    Returns o [B, L, HV, Vp] (v's dtype), final [B, N, HV, Vp, Kp], S_in [B, HV, NC, Vp, Kp]
    (stored dtype), and what ``keep`` says the backward is to get: None (nothing), "pairs" (Aqk,
    Kkk and T, from which it recomputes the rest) or "all" (:func:`intra`'s outputs with
    ``backward``, and v_new)."""
    parts = intra(s, q, k, v, g, gp, beta, diag(s, q, k, g, gp, beta), backward=keep is not None)
    aqk, w, u, q_g, k_d, dec = parts[:6]
    v_new, s_in, final = state(s, w, u, k_d, dec, h0t, ranges)
    o = output(s, aqk, q_g, v_new, s_in, v.dtype)
    return o, final, s_in, {None: None, "pairs": parts[:1] + parts[6:], "all": (*parts, v_new)}[keep]


# ----------------------------------------------------------------------------- backward


def state_cotangent(s: Static, ranges, aqk, q_g, k_d, w, dec, do, dfinal_t, dS_in):
    """The chunk recurrence backwards: the cotangents of the states leaving the chunks
    [B, HV, NC, Vp, Kp] (stored dtype) and of h0t (float32); dS_in: cotangent of S_in, or None."""
    B, L, HV, Vp = do.shape
    Kp, NC, N, BV, C = w.shape[-1], L // s.C, dfinal_t.shape[1], s.cfg.block_v, s.C
    seq, st = _seq_range(N), _seq_state(BV, Kp)
    dh = [] if dS_in is None else [dS_in]
    return s.call(
        kernels.dstate_kernel,
        "state_cotangent",
        C,
        launch="dstate",
        grid=(B, N, HV, Vp // BV),
        in_specs=[
            seq,
            seq,
            _whole(L, C),
            _whole(L, Kp),
            _whole(L, Kp),
            _whole(L, Kp),
            _whole(NC, Kp),
            _whole_tokens(L, BV),
            st,
        ]
        + [_chunk_states(NC, BV, Kp)] * len(dh),
        out_specs=[_chunk_states(NC, BV, Kp), st],
        out_shape=[
            jax.ShapeDtypeStruct((B, HV, NC, Vp, Kp), stored_dtype(s.tiles)),
            jax.ShapeDtypeStruct(dfinal_t.shape, jnp.float32),
        ],
    )(*ranges, aqk, q_g, k_d, w, dec, do, dfinal_t, *dh)


def values(s: Static, aqk, T, w, k_d, u, v, beta, S_in, do, dS_out, v_new):
    """The value-side terms (``kda_values``): v_new (unless given), dv_new (stored dtype), dv
    (token-major, v's dtype), dAqk, dbv u^T [B, HV, L, C], dbeta's value share and dAqk's
    diagonal [B, HV, L, 1] (float32)."""
    B, L, HV, Vp = v.shape
    C, Kp = s.C, w.shape[-1]
    spec, tok = functools.partial(_per_chunk, C), functools.partial(_tokens, C)
    st = _chunk_state(Vp, Kp)
    kept = [] if v_new is None else [v_new]
    n_out = 2 - len(kept)  # v_new (unless kept) and dv_new
    f32, sd = jnp.float32, stored_dtype(s.tiles)
    return s.call(
        kernels.values_kernel,
        "values",
        s.block_k("values", Kp),
        s.cfg.block_v,
        bool(kept),
        grid=(B, HV, L // C),
        in_specs=[spec(C), spec(C), spec(Kp), spec(Kp), spec(Vp), tok(Vp), tok(1), st, tok(Vp), st]
        + [spec(Vp)] * len(kept),
        out_specs=[spec(Vp)] * n_out + [tok(Vp)] + [spec(C)] * 2 + [spec(1)] * 2,
        out_shape=[_shape(B, HV, L, Vp, sd)] * n_out
        + [jax.ShapeDtypeStruct(v.shape, v.dtype)]
        + [_shape(B, HV, L, d, f32) for d in (C, C, 1, 1)],
    )(aqk, T, w, k_d, u, v, beta, S_in, do, dS_out, *kept)


def keys(s: Static, q, k, g, gp, beta, kkk, T, w, S_in, dS_out, do, v_new, dv_new, d, dakk_u, dbeta_v):
    """The key-side terms (``kda_keys``): dKkk [B, HV, L, C], dbeta (token-major [B, L, HV, 1]), and
    the partial dq, dk, dG [B, HV, L, Kp] (float32) that :func:`diag_grads` and :func:`levels` add to."""
    B, L, HV, Vp = do.shape
    C, Kp, f32 = s.C, k.shape[-1], jnp.float32
    spec, tok = functools.partial(_per_chunk, C), functools.partial(_tokens, C)
    st = _chunk_state(Vp, Kp)
    return s.call(
        kernels.keys_kernel,
        "keys",
        s.gate,
        s.block_k("keys", Kp),
        s.cfg.block_v,
        grid=(B, HV, L // C),
        in_specs=[
            tok(Kp, s.groups),
            tok(Kp, s.groups),
            tok(Kp),
            _gate_spec(Kp),
            tok(1),
            spec(C),
            spec(C),
            spec(Kp),
            st,
            st,
            tok(Vp),
            spec(Vp),
            spec(Vp),
            spec(1),
            spec(C),
            spec(1),
        ],
        out_specs=[spec(C), tok(1), spec(Kp), spec(Kp), spec(Kp)],
        out_shape=[_shape(B, HV, L, C, f32), jax.ShapeDtypeStruct(beta.shape, f32)] + [_shape(B, HV, L, Kp, f32)] * 3,
    )(q, k, g, gp, beta, kkk, T, w, S_in, dS_out, do, v_new, dv_new, d, dakk_u, dbeta_v)


def diag_grads(s: Static, q, k, g, gp, daqk, dkkk, dq, dk, dG):
    """dq, dk, dG [B, HV, L, Kp] with the diagonal blocks' share added, in place (``kda_diag_grads``)."""
    B, HV, L, Kp = dq.shape
    C, S = s.C, min(SUB, s.C)
    rows = _per_chunk(S, Kp)
    block = pl.BlockSpec((None, None, S, S), lambda b, h, r: (b, h, r, lax.rem(r, jnp.int32(C // S))))
    return s.call(
        kernels.diag_grads_kernel,
        "diag_grads",
        s.gate,
        s.block_k("diag_grads", Kp),
        grid=(B, HV, L // S),
        in_specs=[_tokens(S, Kp, s.groups)] * 2 + [_tokens(S, Kp), _gate_spec(Kp), block, block, rows, rows, rows],
        out_specs=[rows] * 3,
        out_shape=[jax.ShapeDtypeStruct(dq.shape, jnp.float32)] * 3,
        input_output_aliases={6: 0, 7: 1, 8: 2},
    )(q, k, g, gp, daqk, dkkk, dq, dk, dG)


def levels(s: Static, q, k, g, gp, daqk, dkkk, dq, dk, dG):
    """dq, dk (q's dtype, float32 with grouped heads), dg (float32), token-major [B, L, HV, Kp], with
    the off-diagonal blocks' share added (``kda_levels``)."""
    B, HV, L, Kp = dq.shape
    C, BK, f32 = s.C, s.block_k("levels", Kp), jnp.float32
    cols = pl.BlockSpec((None, None, C, BK), lambda b, h, c, kb: (b, h, c, kb))
    pair = pl.BlockSpec((None, None, C, C), lambda b, h, c, kb: (b, h, c, 0))
    gp_cols = pl.BlockSpec((None, 2, BK), lambda b, h, c, kb: (h, 0, kb))
    dqk = q.dtype if s.groups == 1 else f32  # summed over the group in XLA otherwise
    return s.call(
        kernels.levels_kernel,
        "levels",
        s.gate,
        grid=(B, HV, L // C, Kp // BK),
        in_specs=[_token_cols(C, BK, s.groups)] * 2 + [_token_cols(C, BK), gp_cols, pair, pair, cols, cols, cols],
        out_specs=[_token_cols(C, BK)] * 3,
        out_shape=[jax.ShapeDtypeStruct((B, L, HV, Kp), t) for t in (dqk, dqk, f32)],
    )(q, k, g, gp, daqk, dkkk, dq, dk, dG)


def backward(s: Static, q, k, v, g, gp, beta, ranges, S_in, kept, do, dfinal_t, dS_in):
    """Cotangents of q, k (prepared: :meth:`QK.prepare`), v, the decay (float32), beta and h0t
    (dq, dk summed over each group's value heads). kept: what :func:`forward` kept ("pairs": w,
    u, q_g, k_d and decay are recomputed from T; "all"); dS_in: cotangent of S_in, or None."""
    B, L = v.shape[:2]
    H, Kp = k.shape[2], k.shape[-1]
    if len(kept) == 3:
        aqk, kkk, T = kept
        w, u, q_g, k_d, dec = recompute(dataclasses.replace(s, qk=QK()), q, k, v, g, gp, beta, T)
        v_new = None  # the values kernel computes it
    else:
        aqk, w, u, q_g, k_d, dec, kkk, T, v_new = kept
    dS_out, dh0t = state_cotangent(s, ranges, aqk, q_g, k_d, w, dec, do, dfinal_t, dS_in)
    *v_new_out, dv_new, dv, daqk, dakk_u, dbeta_v, d = values(s, aqk, T, w, k_d, u, v, beta, S_in, do, dS_out, v_new)
    v_new = v_new if v_new is not None else v_new_out[0]
    dkkk, dbeta, dq, dk, dG = keys(s, q, k, g, gp, beta, kkk, T, w, S_in, dS_out, do, v_new, dv_new, d, dakk_u, dbeta_v)
    dq, dk, dG = diag_grads(s, q, k, g, gp, daqk, dkkk, dq, dk, dG)
    dq, dk, dg = levels(s, q, k, g, gp, daqk, dkkk, dq, dk, dG)
    dq, dk = (x.reshape(B, L, H, s.groups, Kp).sum(3).astype(q.dtype) for x in (dq, dk))
    return dq, dk, dv, dg, dbeta, dh0t
