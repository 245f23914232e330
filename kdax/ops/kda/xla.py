"""Chunked KDA in plain XLA: WY forward, ``lax.scan`` over chunks, chunkwise custom VJP.

Per chunk of C tokens (G = in-chunk cumulative log2 gate, r = reference rows):
  Aqk[i, j] = sum_d q_id k_jd 2^(G_id - G_jd)       (j <= i)
  Akk[i, j] = beta_i sum_d k_id k_jd 2^(G_id - G_jd)  (j < i)
  (I + Akk) [w u] = [beta k 2^G, beta v]              (exact triangular solve)
  v_new = u - w S;  o = (q 2^G) S + Aqk v_new;  S' = 2^G_C S + (k 2^(G_C - G))^T v_new
The pairwise matrices come from matmuls: off-diagonal sub-blocks factor the decay as
2^(G_i - G_r) 2^(G_r - G_j) around the first row r of the row's sub-block (both
factors <= 1); diagonal sub-blocks use exact pairwise differences. No 2^(-G) is ever
formed, so cumulative gates far below -88 (natural log) are safe. See docs/kda_xla.md.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kdax.ops.common.varlen import ChunkLayout

LOG2E = 1.4426950408889634
SUB_BLOCK = 16  # diagonal sub-block size of the pairwise matrices


def _mm(eq: str, *xs: jax.Array) -> jax.Array:
    return jnp.einsum(eq, *xs, precision=lax.Precision.HIGHEST)


class _PairFactors(NamedTuple):
    """Decay factors for pairwise matrices of one chunk; n = C // c sub-blocks of c rows."""

    left: jax.Array  # [..., n, c, K] 2^(G_i - G_r(i)), <= 1
    right: jax.Array  # [..., n, C, K] 2^(G_rI - G_j) for j < r_I (clamped to <= 1 elsewhere)
    diag: jax.Array  # [..., n, c, c, K] 2^(G_i - G_j) for j <= i inside a sub-block, else 0
    off_mask: jax.Array  # [n, c, C] j lies in an earlier sub-block than i


def _pair_factors(G: jax.Array, c: int) -> _PairFactors:
    C, K = G.shape[-2:]
    n = C // c
    Gb = G.reshape(G.shape[:-2] + (n, c, K))
    Gr = Gb[..., :, :1, :]  # [..., n, 1, K] reference row of each sub-block
    left = jnp.exp2(Gb - Gr)
    right = jnp.exp2(jnp.minimum(Gr - G[..., None, :, :], 0.0))
    tri = jnp.tril(jnp.ones((c, c), bool))[:, :, None]
    diag = jnp.exp2(jnp.where(tri, Gb[..., :, :, None, :] - Gb[..., :, None, :, :], -jnp.inf))
    rows = jnp.arange(C).reshape(n, c, 1)
    off_mask = jnp.arange(C)[None, None, :] < (rows // c) * c
    return _PairFactors(left, right, diag, off_mask)


def _pairs(x: jax.Array, y: jax.Array, P: _PairFactors) -> jax.Array:
    """M[i, j] = sum_d x_id y_jd 2^(G_id - G_jd) for j <= i, else 0. x, y: [..., C, K] -> [..., C, C]."""
    n, c, K = P.left.shape[-3:]
    C = n * c
    xb = x.reshape(x.shape[:-2] + (n, c, K))
    yb = y.reshape(y.shape[:-2] + (n, c, K))
    off = _mm("...Iik,...Ijk->...Iij", xb * P.left, y[..., None, :, :] * P.right)  # [..., n, c, C]
    off = jnp.where(P.off_mask, off, 0.0)
    diag = _mm("...Iik,...Ijk,...Iijk->...Iij", xb, yb, P.diag)  # [..., n, c, c]
    diag = diag[..., :, :, None, :] * jnp.eye(n, dtype=diag.dtype)[:, None, :, None]
    return (off + diag.reshape(off.shape)).reshape(x.shape[:-2] + (C, C))


def _pairs_vjp(dM: jax.Array, x: jax.Array, y: jax.Array, P: _PairFactors):
    """Cotangents (dx, dy) of :func:`_pairs` for a masked dM [..., C, C].

    The gate cotangent follows as x * dx - y * dy (natural-log units)."""
    n, c, K = P.left.shape[-3:]
    bshape = x.shape[:-2] + (n, c, K)
    xb, yb = x.reshape(bshape), y.reshape(bshape)
    dMo = jnp.where(P.off_mask, dM.reshape(dM.shape[:-2] + (n, c, n * c)), 0.0)  # [..., n, c, C]
    dx = _mm("...Iij,...Ijk->...Iik", dMo, y[..., None, :, :] * P.right) * P.left
    dy = jnp.sum(_mm("...Iij,...Iik->...Ijk", dMo, xb * P.left) * P.right, axis=-3)
    dMd = dM.reshape(dM.shape[:-2] + (n, c, n, c))
    dMd = jnp.moveaxis(jnp.diagonal(dMd, axis1=-4, axis2=-2), -1, -3)  # [..., n, c, c]
    dx = dx + _mm("...Iij,...Ijk,...Iijk->...Iik", dMd, yb, P.diag)
    dy = dy + _mm("...Iij,...Iik,...Iijk->...Ijk", dMd, xb, P.diag).reshape(y.shape)
    return dx.reshape(x.shape), dy


class _Intra(NamedTuple):
    """Per-chunk quantities that need no state: everything is [..., C, *]."""

    P: _PairFactors
    G: jax.Array  # [..., C, K] cumulative log2 gate
    Aqk: jax.Array  # [..., C, C] inclusive lower
    Kkk: jax.Array  # [..., C, C] strictly lower, before beta
    w: jax.Array  # [..., C, K]
    u: jax.Array  # [..., C, V]
    q_g: jax.Array  # [..., C, K] q 2^G
    k_g: jax.Array  # [..., C, K] k 2^G
    k_d: jax.Array  # [..., C, K] k 2^(G_C - G)
    decay: jax.Array  # [..., K] 2^G_C


def _intra(q, k, v, g, beta, sub_block) -> _Intra:
    """q, k, g: [..., C, K]; v: [..., C, V]; beta: [..., C]."""
    C, K = k.shape[-2:]
    G = jnp.cumsum(g * LOG2E, axis=-2)
    P = _pair_factors(G, min(sub_block, C))
    Aqk = _pairs(q, k, P)
    Kkk = jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), _pairs(k, k, P), 0.0)
    eG = jnp.exp2(G)
    k_g = k * eG
    rhs = jnp.concatenate([beta[..., None] * k_g, beta[..., None] * v], axis=-1)
    Akk = beta[..., :, None] * Kkk
    wu = lax.linalg.triangular_solve(Akk, rhs, left_side=True, lower=True, unit_diagonal=True)
    G_end = G[..., -1:, :]
    return _Intra(
        P, G, Aqk, Kkk, wu[..., :K], wu[..., K:], q * eG, k_g, k * jnp.exp2(G_end - G), jnp.exp2(G_end[..., 0, :])
    )


def _to_chunks(x: jax.Array, C: int) -> jax.Array:
    """[B, NC*C, HV, D] -> [NC, B, HV, C, D] (or [B, NC*C, HV] -> [NC, B, HV, C])."""
    B, L, HV = x.shape[:3]
    x = x.reshape((B, L // C, C, HV) + x.shape[3:])
    return jnp.moveaxis(x, (0, 1, 2, 3), (1, 0, 3, 2))


def _from_chunks(x: jax.Array) -> jax.Array:
    """[NC, B, HV, C, D] -> [B, NC*C, HV, D]."""
    NC, B, HV, C = x.shape[:4]
    return jnp.moveaxis(x, (0, 1, 2, 3), (1, 0, 3, 2)).reshape((B, NC * C, HV) + x.shape[4:])


def _final_states(S_in, I: _Intra, v_new, lay):
    """State after the last chunk of each sequence. S_in: [NC, B, HV, K, V] -> [B, N, HV, K, V]."""
    chunk_seq, chunk_first, chunk_last, seq_first, seq_last, seq_empty, h0 = lay
    idx = seq_last
    S = I.decay[idx][..., None] * S_in[idx] + _mm("nbhck,nbhcv->nbhkv", I.k_d[idx], v_new[idx])
    S = jnp.moveaxis(S, 0, 1)
    return jnp.where(seq_empty[None, :, None, None, None], h0, S)


def _forward(q, k, v, g, beta, lay, sub_block):
    """Chunked inputs [NC, B, HV, C, *]; h0 in lay: [B, N, HV, K, V]."""
    chunk_seq, chunk_first, _, _, _, _, h0 = lay
    I = _intra(q, k, v, g, beta, sub_block)

    def step(S, xs):
        w, u, k_d, decay, first, seq = xs  # [B, HV, C, K], ..., [B, HV, K], (), ()
        S = jnp.where(first, h0[:, seq], S)
        v_new = u - _mm("bhck,bhkv->bhcv", w, S)
        S_next = decay[..., None] * S + _mm("bhck,bhcv->bhkv", k_d, v_new)
        return S_next, (S, v_new)

    S0 = jnp.zeros_like(h0[:, 0])
    _, (S_in, v_new) = lax.scan(step, S0, (I.w, I.u, I.k_d, I.decay, chunk_first, chunk_seq))
    o = _mm("...ck,...kv->...cv", I.q_g, S_in) + _mm("...ij,...jv->...iv", I.Aqk, v_new)
    return o, _final_states(S_in, I, v_new, lay), S_in


def _backward(q, k, v, g, beta, lay, S_in, do, dfinal, sub_block):
    chunk_seq, _, chunk_last, seq_first, _, seq_empty, h0 = lay
    C = k.shape[-2]
    I = _intra(q, k, v, g, beta, sub_block)
    v_new = I.u - _mm("...ck,...kv->...cv", I.w, S_in)
    dv_new_o = _mm("...ij,...iv->...jv", I.Aqk, do)  # [NC, B, HV, C, V]
    dS_o = _mm("...ck,...cv->...kv", I.q_g, do)  # [NC, B, HV, K, V]

    def step(dS, xs):
        dvo, dSo, k_d, w, decay, last, seq = xs
        dS_next = jnp.where(last, dfinal[:, seq], dS)
        dv_new = dvo + _mm("bhck,bhkv->bhcv", k_d, dS_next)
        dS_in = dSo + decay[..., None] * dS_next - _mm("bhck,bhcv->bhkv", w, dv_new)
        return dS_in, (dS_next, dv_new)

    xs = (dv_new_o, dS_o, I.k_d, I.w, I.decay, chunk_last, chunk_seq)
    _, (dS_next, dv_new) = lax.scan(step, jnp.zeros_like(dfinal[:, 0]), xs, reverse=True)

    # Gradient of the initial states: dS_in of each sequence's first chunk.
    f = seq_first
    dS_first = (
        dS_o[f] + I.decay[f][..., None] * dS_next[f] - _mm("nbhck,nbhcv->nbhkv", I.w[f], dv_new[f])
    )
    dh0 = jnp.where(seq_empty[None, :, None, None, None], dfinal, jnp.moveaxis(dS_first, 0, 1))

    # o = q_g S + Aqk v_new;  v_new = u - w S;  S' = decay S + k_d^T v_new
    dq_g = _mm("...cv,...kv->...ck", do, S_in)
    dAqk = jnp.where(jnp.tril(jnp.ones((C, C), bool)), _mm("...iv,...jv->...ij", do, v_new), 0.0)
    dk_d = _mm("...cv,...kv->...ck", v_new, dS_next)
    dw = -_mm("...cv,...kv->...ck", dv_new, S_in)
    ddecay = I.decay * jnp.sum(S_in * dS_next, axis=-1)  # [..., K] natural-log units
    # (I + Akk) [w u] = [beta k_g, beta v]  =>  d[beta k_g, beta v] = (I + Akk)^-T [dw du]
    dwu = jnp.concatenate([dw, dv_new], axis=-1)
    drhs = lax.linalg.triangular_solve(
        beta[..., :, None] * I.Kkk, dwu, left_side=True, lower=True, transpose_a=True, unit_diagonal=True
    )
    K = k.shape[-1]
    dbk_g, dbv = drhs[..., :K], drhs[..., K:]
    wu = jnp.concatenate([I.w, I.u], axis=-1)
    dAkk = jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), -_mm("...ie,...je->...ij", drhs, wu), 0.0)
    dbeta = jnp.sum(v * dbv, -1) + jnp.sum(I.k_g * dbk_g, -1) + jnp.sum(dAkk * I.Kkk, -1)
    dv = beta[..., None] * dbv
    dk_g = beta[..., None] * dbk_g
    dKkk = beta[..., :, None] * dAkk

    dq_p, dk_p = _pairs_vjp(dAqk, q, k, I.P)
    dk_x, dk_y = _pairs_vjp(dKkk, k, k, I.P)
    eG = jnp.exp2(I.G)
    dq = eG * dq_g + dq_p
    dk = eG * dk_g + jnp.exp2(I.G[..., -1:, :] - I.G) * dk_d + dk_p + dk_x + dk_y
    # Cotangent of the cumulative gate G (natural-log units), then of g by a reverse cumsum.
    kd_dkd = I.k_d * dk_d
    dG = I.q_g * dq_g + I.k_g * dk_g - kd_dkd + q * dq_p - k * dk_p + k * dk_x - k * dk_y
    dG = dG.at[..., -1, :].add(jnp.sum(kd_dkd, axis=-2) + ddecay)
    dg = jnp.flip(jnp.cumsum(jnp.flip(dG, -2), axis=-2), -2)
    return dq, dk, dv, dg, dbeta, dh0


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _chunk_core(q, k, v, g, beta, lay, sub_block):
    o, final, _ = _forward(q, k, v, g, beta, lay, sub_block)
    return o, final


def _chunk_core_fwd(q, k, v, g, beta, lay, sub_block):
    o, final, S_in = _forward(q, k, v, g, beta, lay, sub_block)
    return (o, final), (q, k, v, g, beta, lay, S_in)


def _chunk_core_bwd(sub_block, res, cts):
    q, k, v, g, beta, lay, S_in = res
    do, dfinal = cts
    dq, dk, dv, dg, dbeta, dh0 = _backward(q, k, v, g, beta, lay, S_in, do, dfinal, sub_block)
    dlay = tuple(None for _ in lay[:-1]) + (dh0,)
    return dq, dk, dv, dg, dbeta, dlay


_chunk_core.defvjp(_chunk_core_fwd, _chunk_core_bwd)


def chunk_kda_xla(q, k, v, g, beta, h0, layout: ChunkLayout, sub_block: int = SUB_BLOCK):
    """Core chunked KDA on prepared inputs.

    q, k: [B, T, HV, K] (q already scaled, both repeated to HV heads); v: [B, T, HV, V];
    g: [B, T, HV, K] log-space decay; beta: [B, T, HV]; h0: [B, N, HV, K, V].
    All in one float dtype (float32 or float64). Returns (o [B, T, HV, V], final [B, N, HV, K, V]).
    """
    C = layout.chunk_size
    xs = tuple(_to_chunks(layout.pack(x), C) for x in (q, k, v, g, beta))
    lay = (*layout[3:9], h0)
    o, final = _chunk_core(*xs, lay, sub_block)
    return layout.unpack(_from_chunks(o)), final
