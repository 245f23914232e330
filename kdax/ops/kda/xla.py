"""Chunked KDA in plain XLA: WY forward, ``lax.scan`` over chunks, chunkwise custom VJP.

Per chunk of C tokens (G = in-chunk cumulative log2 gate, r = reference rows):
  Aqk[i, j] = sum_d q_id k_jd 2^(G_id - G_jd)       (j <= i)
  Akk[i, j] = beta_i sum_d k_id k_jd 2^(G_id - G_jd)  (j < i)
  [w u] = (I + Akk)^-1 [beta k 2^G, beta v]           (exact block inverse)
  v_new = u - w S;  o = (q 2^G) S + Aqk v_new;  S' = 2^G_C S + (k 2^(G_C - G))^T v_new
The pairwise matrices come from small matmuls over dyadic blocks: each pair (i, j)
factors its decay as 2^(G_i - G_r) 2^(G_r - G_j) around the middle row r of the
smallest dyadic block holding both, so every factor is <= 1. No 2^(-G) is ever formed
and cumulative gates far below -88 (natural log) are safe. See docs/kda_xla.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kdax.ops.common import dispatch
from kdax.ops.common.arrays import LOG2E
from kdax.ops.common.triangular import dyadic_levels, unit_lower_inverse
from kdax.ops.common.varlen import ChunkLayout
from kdax.ops.kda.capabilities import Capabilities
from kdax.ops.kda.recurrent import fused_recurrent_kda_xla


def _mm(eq: str, *xs: jax.Array) -> jax.Array:
    return jnp.einsum(eq, *xs, precision=lax.Precision.HIGHEST)


def _cumsum(x: jax.Array, reverse: bool = False, exclusive: bool = False) -> jax.Array:
    """Cumulative sum over axis -2 as a matmul with a triangular ones matrix: row i holds the
    sum of rows 0..i (``reverse``: i..end), without row i itself if ``exclusive``."""
    C = x.shape[-2]
    ones = jnp.tril(jnp.ones((C, C), x.dtype), -1 if exclusive else 0)
    # batched over x's leading axes, so the matmul reads x in place (no transposed copy)
    ones = jnp.broadcast_to(ones.T if reverse else ones, x.shape[:-2] + (C, C))
    return _mm("...ij,...jk->...ik", ones, x)


class _PairFactors(NamedTuple):
    """Decay factors of one chunk's pairwise matrices, one entry per dyadic level.

    At level s (s = C, C/2, ..., 2) the chunk splits into C/s blocks of s rows; every
    pair (i in the lower half, j in the upper half of a block) factors its decay around
    the upper half's last row r as 2^(G_i - G_r) 2^(G_r - G_j), both factors <= 1. Each
    strictly-lower pair belongs to exactly one level, so the levels tile the triangle.
    """

    lower: tuple[jax.Array, ...]  # per level: [..., C/s, s/2, K] 2^(G_i - G_r), lower-half rows
    upper: tuple[jax.Array, ...]  # per level: [..., C/s, s/2, K] 2^(G_r - G_j), upper-half rows


def _halves(x: jax.Array, s: int) -> tuple[jax.Array, jax.Array]:
    """[..., C, K] -> lower and upper halves of each s-block, both [..., C/s, s/2, K]."""
    C, K = x.shape[-2:]
    xb = x.reshape(x.shape[:-2] + (C // s, 2, s // 2, K))
    return xb[..., 1, :, :], xb[..., 0, :, :]


def _join(lo: jax.Array | None, up: jax.Array | None, like: jax.Array) -> jax.Array:
    """Inverse of :func:`_halves` with a missing half filled by zeros -> [..., C, K]."""
    z = jnp.zeros_like(lo if up is None else up)
    return jnp.stack([z if up is None else up, z if lo is None else lo], axis=-3).reshape(like.shape)


def _decay_exponents(g: jax.Array) -> tuple[jax.Array, jax.Array, _PairFactors]:
    """Every decay exponent of a chunk from its per-step log2 gates g [..., C, K] (<= 0).

    Returns (G, R, P): G [..., C, K] the inclusive prefix sums (G_i), R [..., C, K] the
    exclusive suffix sums (G_C - G_i), and the dyadic pair factors. Each exponent is a sum
    of steps, never a difference of two sums: a difference of cumulative gates is off by
    eps |G| (2e-4 at G = -3000, so 1e-4 in a decay factor near 1), a sum of same-sign steps
    only by eps of its own value. Built bottom-up over blocks of h = 1, 2, 4, ... rows with
    O(C K log C) additions, keeping per h-block the inclusive prefix sums (a lower half's
    exponents G_i - G_r) and exclusive suffix sums (an upper half's G_r - G_j).
    """
    pre, suf = g, jnp.zeros_like(g)  # within each h-block: sums over rows [first, i] and (i, last]
    lower, upper = [], []
    for s in reversed(dyadic_levels(g.shape[-2])):  # s = 2h = 2, 4, ..., C
        (pre_lo, pre_up), (suf_lo, suf_up) = _halves(pre, s), _halves(suf, s)
        lower.append(jnp.exp2(pre_lo))
        upper.append(jnp.exp2(suf_up))
        pre = _join(pre_lo + pre_up[..., -1:, :], pre_up, g)
        suf = _join(suf_lo, suf_up + pre_lo[..., -1:, :], g)
    return pre, suf, _PairFactors(tuple(lower[::-1]), tuple(upper[::-1]))


def _pairs(x: jax.Array, y: jax.Array, P: _PairFactors, inclusive: bool) -> jax.Array:
    """M[i, j] = sum_d x_id y_jd 2^(G_id - G_jd) for j < i (j <= i if inclusive), else 0.

    x: [..., C, K] (may carry extra leading axes, e.g. q and k stacked); y: [..., C, K].
    Returns [..., C, C]. Built bottom-up: the diagonal blocks of size s are
    [[M_s/2, 0], [Q_s, M_s/2]] with Q_s the level-s matmul."""
    C = x.shape[-2]
    M = None
    for s, el, eu in reversed(list(zip(dyadic_levels(C), P.lower, P.upper))):
        x_lo, _ = _halves(x, s)
        _, y_up = _halves(y, s)
        # the right operand is built K-major ([..., K, s/2]) so the matmul needs no transpose
        y_r = jnp.swapaxes(y_up, -1, -2) * jnp.swapaxes(eu, -1, -2)
        Q = _mm("...bik,...bkj->...bij", x_lo * el, y_r)  # [..., C/s, s/2, s/2]
        if M is None:  # the 1 x 1 diagonal blocks; the diagonal itself is added below when inclusive
            M = jnp.zeros(Q.shape[:-3] + (C, 1, 1), Q.dtype)
        M_up, M_lo = M[..., 0::2, :, :], M[..., 1::2, :, :]
        M = jnp.concatenate([jnp.concatenate([M_up, jnp.zeros_like(Q)], -1), jnp.concatenate([Q, M_lo], -1)], -2)
    M = M.reshape(Q.shape[:-3] + (C, C))
    if inclusive:
        M = M + _mm("...ck,...ck->...c", x, y)[..., None] * jnp.eye(C, dtype=x.dtype)
    return M


def _pairs_vjp(terms, y: jax.Array, P: _PairFactors):
    """Cotangents of pairwise matrices that share y (see :func:`_pairs`).

    terms: a sequence of (dM [..., C, C] masked like M, x [..., C, K], inclusive).
    Returns ([dx of each term], dy summed over the terms, dg), dg [..., C, K] the
    cotangent of the per-step gate g (natural-log units). Pair (i, j) decays by the steps
    j < t <= i, so its term p_ij = dM_ij x_i y_j 2^(G_i - G_j) enters dg_t exactly for those
    t. At level s that is, for t in a block's lower half, the sum of the row terms x dx
    over its rows i >= t, and for t in the upper half, the sum of the column terms y dy
    over its rows j < t: only pairs straddling t are ever added, so no two terms of a pair
    cancel (as they would in a cumsum of x dx - y dy), and the diagonal, which spans no
    step, is left out."""
    C = y.shape[-2]
    dxs, dy, dg = [0.0] * len(terms), 0.0, 0.0
    Ds = [dM[..., None, :, :] for dM, _, _ in terms]  # [..., 1, C, C] diagonal blocks of the current level
    for s, el, eu in zip(dyadic_levels(C), P.lower, P.upper):
        h = s // 2
        _, y_up = _halves(y, s)
        y_e = y_up * eu
        z = dy_up = 0.0  # z: the level's row terms x dx (lower halves) and column terms y dy (upper)
        for n, (D, (_, x, _)) in enumerate(zip(Ds, terms)):
            dQ = D[..., h:, :h]  # [..., C/s, s/2, s/2]
            Ds[n] = jnp.stack([D[..., :h, :h], D[..., h:, h:]], axis=-3).reshape(D.shape[:-3] + (C // h, h, h))
            x_lo, _ = _halves(x, s)
            dx_s = _join(_mm("...bij,...bjk->...bik", dQ, y_e) * el, None, x)
            dy_up = dy_up + _mm("...bij,...bik->...bjk", dQ, x_lo * el)
            dxs[n] = dxs[n] + dx_s
            z = z + x * dx_s
        dy_s = _join(None, dy_up * eu, y)
        dy = dy + dy_s
        dg = dg + _straddle(z + y * dy_s, s)
    for n, (dM, x, inclusive) in enumerate(terms):
        if inclusive:
            d = jnp.diagonal(dM, axis1=-2, axis2=-1)[..., None]
            dxs[n], dy = dxs[n] + d * y, dy + d * x
    return dxs, dy, dg


def _straddle(z: jax.Array, s: int) -> jax.Array:
    """z [..., C, K] -> in each block of s rows, the reverse cumsum of its lower half's rows and
    the exclusive cumsum of its upper half's: one batched matmul with a [s, s] 0/1 matrix."""
    C, K = z.shape[-2:]
    h = s // 2
    i = jnp.arange(s)
    lower = (i[:, None] >= h) & (i[None, :] >= i[:, None])
    upper = (i[:, None] < h) & (i[None, :] < i[:, None])
    m = jnp.asarray(lower | upper, z.dtype)
    zb = z.reshape(z.shape[:-2] + (C // s, s, K))
    m = jnp.broadcast_to(m, zb.shape[:-2] + (s, s))
    return _mm("...ij,...jk->...ik", m, zb).reshape(z.shape)


class _Intra(NamedTuple):
    """Per-chunk quantities that need no state: everything is [..., C, *]."""

    P: _PairFactors
    eG: jax.Array  # [..., C, K] 2^G, G the cumulative log2 gate
    e_rest: jax.Array  # [..., C, K] 2^(G_C - G)
    Aqk: jax.Array  # [..., C, C] inclusive lower
    Kkk: jax.Array  # [..., C, C] strictly lower, before beta
    T: jax.Array  # [..., C, C] (I + beta Kkk)^-1
    w: jax.Array  # [..., C, K]
    u: jax.Array  # [..., C, V]
    q_g: jax.Array  # [..., C, K] q 2^G
    k_g: jax.Array  # [..., C, K] k 2^G
    k_d: jax.Array  # [..., C, K] k 2^(G_C - G)
    decay: jax.Array  # [..., K] 2^G_C


def _intra(q, k, v, g, beta, products=None) -> _Intra:
    """q, k, g: [..., C, K]; v: [..., C, V]; beta: [..., C]. products: the stage's matmul
    products (Aqk, Kkk, T, w, u) as a forward computed them (``disable_recompute``), or None to
    compute them; the decay factors, element-wise in g, are computed either way."""
    K = k.shape[-1]
    G, R, P = _decay_exponents(g * LOG2E)
    eG = jnp.exp2(G)
    k_g = k * eG
    if products is None:
        Aqk = _pairs(q, k, P, inclusive=True)
        Kkk = _pairs(k, k, P, inclusive=False)
        rhs = jnp.concatenate([beta[..., None] * k_g, beta[..., None] * v], axis=-1)
        T = unit_lower_inverse(beta[..., :, None] * Kkk)
        wu = _mm("...ij,...je->...ie", T, rhs)
        products = (Aqk, Kkk, T, wu[..., :K], wu[..., K:])
    e_rest = jnp.exp2(R)
    return _Intra(P, eG, e_rest, *products, q * eG, k_g, k * e_rest, eG[..., -1, :])


def _to_chunks(x: jax.Array, C: int) -> jax.Array:
    """[B, NC*C, HV, D] -> [NC, B, HV, C, D] (or [B, NC*C, HV] -> [NC, B, HV, C])."""
    B, L, HV = x.shape[:3]
    x = x.reshape((B, L // C, C, HV) + x.shape[3:])
    return jnp.moveaxis(x, (0, 1, 2, 3), (1, 0, 3, 2))


def _from_chunks(x: jax.Array) -> jax.Array:
    """[NC, B, HV, C, D] -> [B, NC*C, HV, D]."""
    NC, B, HV, C = x.shape[:4]
    return jnp.moveaxis(x, (0, 1, 2, 3), (1, 0, 3, 2)).reshape((B, NC * C, HV) + x.shape[4:])


@dataclasses.dataclass(frozen=True)
class Config:
    """The xla backend's per-call config (``chunk_kda(..., config=xla.Config(...))``).

    Attributes:
        schedule: how many chunks one step of the outer scan handles: "per_chunk" keeps every
            intermediate of a chunk in cache (on CPU about 1.7x faster than whole-sequence
            stages at T=4096, docs/kda_xla.md); "all_chunks" runs the state-free stages as a
            few large parallel kernels (accelerators); "auto" picks by the device.

    Raises:
        ValueError: from :meth:`resolved`, naming ``config.schedule`` for another value.
    """

    schedule: str = "auto"

    def resolved(self) -> Config:
        """This config with "auto" replaced by what it means on the default device."""
        if self.schedule not in ("auto", "per_chunk", "all_chunks"):
            raise ValueError(f"config.schedule: expected 'auto', 'per_chunk' or 'all_chunks', got {self.schedule!r}")
        if self.schedule != "auto":
            return self
        return Config("per_chunk" if dispatch.platform() == "cpu" else "all_chunks")


def _grouped(xs, gs: int):
    """[NC, ...] -> [NC / gs, gs, ...] for every array of a tuple (None stays None)."""
    return tuple(None if x is None else x.reshape((x.shape[0] // gs, gs) + x.shape[1:]) for x in xs)


def _ungrouped(xs):
    return tuple(None if x is None else x.reshape((-1,) + x.shape[2:]) for x in xs)


def _seq_get(buf: jax.Array, seq: jax.Array) -> jax.Array:
    return lax.dynamic_index_in_dim(buf, seq, axis=1, keepdims=False)


def _seq_set_if(buf: jax.Array, seq: jax.Array, cond: jax.Array, x: jax.Array) -> jax.Array:
    """buf[:, seq] = x where cond, for a per-sequence buffer [B, N, HV, K, V]."""
    return lax.dynamic_update_index_in_dim(buf, jnp.where(cond, x, _seq_get(buf, seq)), seq, axis=1)


def _forward(q, k, v, g, beta, lay, gs: int, save_states: bool, keep_intra: bool):
    """Chunked inputs [NC, B, HV, C, *]; lay = (chunk_seq, chunk_first, chunk_last, h0 [B, N, HV, K, V]).

    Returns o [NC, B, HV, C, V], the final states [B, N, HV, K, V], if save_states the state
    entering every chunk [NC, B, HV, K, V] (else None), and if keep_intra every chunk's matmul
    products ((Aqk, Kkk, T, w, u), v_new), grouped [NC / gs, gs, B, HV, ...] (else None)."""
    chunk_seq, chunk_first, chunk_last, h0 = lay

    def chunk_step(carry, xs):
        S, final = carry
        w, u, k_d, decay, first, last, seq = xs  # [B, HV, C, K], ..., [B, HV, K], (), (), ()
        S = jnp.where(first, _seq_get(h0, seq), S)
        v_new = u - _mm("bhck,bhkv->bhcv", w, S)
        S_next = decay[..., None] * S + _mm("bhck,bhcv->bhkv", k_d, v_new)
        return (S_next, _seq_set_if(final, seq, last, S_next)), (S, v_new)

    def group_step(carry, xs):
        q, k, v, g, beta, first, last, seq = xs  # [gs, B, HV, C, *], [gs]
        I = _intra(q, k, v, g, beta)
        carry, (S_in, v_new) = lax.scan(chunk_step, carry, (I.w, I.u, I.k_d, I.decay, first, last, seq), unroll=gs == 1)
        o = _mm("...ck,...kv->...cv", I.q_g, S_in) + _mm("...ij,...jv->...iv", I.Aqk, v_new)
        kept = ((I.Aqk, I.Kkk, I.T, I.w, I.u), v_new) if keep_intra else None
        return carry, (o, S_in if save_states else None, kept)

    xs = _grouped((q, k, v, g, beta, chunk_first, chunk_last, chunk_seq), gs)
    (_, final), (o, S_in, kept) = lax.scan(group_step, (jnp.zeros_like(h0[:, 0]), h0), xs)
    o, S_in = _ungrouped((o, S_in))
    return o, final, S_in, kept


def _backward(q, k, v, g, beta, lay, S_in, kept, do, dfinal, dS_in, gs: int):
    """Reverse scan over chunk groups: each group's intra stage and v_new (recomputed, or with the
    forward's ``kept`` matmul products), then the state cotangent pass over its chunks, carrying
    dS back. dS_in: cotangent of the states entering the chunks [NC, B, HV, K, V], or None."""
    chunk_seq, chunk_first, chunk_last, _ = lay

    def chunk_step(carry, xs):
        dS, dh0 = carry
        dvo, dSo, k_d, w, decay, first, last, seq = xs
        dS_next = jnp.where(last, _seq_get(dfinal, seq), dS)
        dv_new = dvo + _mm("bhck,bhkv->bhcv", k_d, dS_next)
        dS_in = dSo + decay[..., None] * dS_next - _mm("bhck,bhcv->bhkv", w, dv_new)
        return (dS_in, _seq_set_if(dh0, seq, first, dS_in)), (dS_next, dv_new)

    def group_step(carry, xs):
        q, k, v, g, beta, S_in, do, dS_h, kept, first, last, seq = xs
        I = _intra(q, k, v, g, beta, None if kept is None else kept[0])
        v_new = I.u - _mm("...ck,...kv->...cv", I.w, S_in) if kept is None else kept[1]
        dv_new_o = _mm("...ij,...iv->...jv", I.Aqk, do)
        dS_o = _mm("...ck,...cv->...kv", I.q_g, do)
        if dS_h is not None:
            dS_o = dS_o + dS_h
        xs = (dv_new_o, dS_o, I.k_d, I.w, I.decay, first, last, seq)
        carry, (dS_next, dv_new) = lax.scan(chunk_step, carry, xs, reverse=True, unroll=gs == 1)
        return carry, _intra_grads(q, k, v, beta, I, S_in, v_new, do, dS_next, dv_new)

    flags = _grouped((chunk_first, chunk_last, chunk_seq), gs)
    xs = (*_grouped((q, k, v, g, beta, S_in, do, dS_in), gs), kept, *flags)
    (_, dh0), grads = lax.scan(group_step, (jnp.zeros_like(dfinal[:, 0]), dfinal), xs, reverse=True)
    return (*_ungrouped(grads), dh0)


def _intra_grads(q, k, v, beta, I: _Intra, S_in, v_new, do, dS_next, dv_new):
    """Gradients of q, k, v, g, beta of chunks given the cotangents dS_next and dv_new."""
    C, K = k.shape[-2:]
    # o = q_g S + Aqk v_new;  v_new = u - w S;  S' = decay S + k_d^T v_new
    dq_g = _mm("...cv,...kv->...ck", do, S_in)
    dAqk = jnp.where(jnp.tril(jnp.ones((C, C), bool)), _mm("...iv,...jv->...ij", do, v_new), 0.0)
    dk_d = _mm("...cv,...kv->...ck", v_new, dS_next)
    dw = -_mm("...cv,...kv->...ck", dv_new, S_in)
    ddecay = I.decay * _mm("...kv,...kv->...k", S_in, dS_next)  # [..., K] natural-log units
    # (I + Akk) [w u] = [beta k_g, beta v]  =>  d[beta k_g, beta v] = (I + Akk)^-T [dw du]
    drhs = _mm("...ji,...je->...ie", I.T, jnp.concatenate([dw, dv_new], axis=-1))
    dbk_g, dbv = drhs[..., :K], drhs[..., K:]
    wu = jnp.concatenate([I.w, I.u], axis=-1)
    dAkk = jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), -_mm("...ie,...je->...ij", drhs, wu), 0.0)
    dbeta = _mm("...cv,...cv->...c", v, dbv) + _mm("...ck,...ck->...c", I.k_g, dbk_g)
    dbeta = dbeta + _mm("...ij,...ij->...i", dAkk, I.Kkk)
    dv = beta[..., None] * dbv
    dk_g = beta[..., None] * dbk_g
    dKkk = beta[..., :, None] * dAkk

    (dq_p, dk_x), dk_y, dg_p = _pairs_vjp([(dAqk, q, True), (dKkk, k, False)], k, I.P)
    dq = I.eG * dq_g + dq_p
    dk = I.eG * dk_g + I.e_rest * dk_d + dk_x + dk_y
    # Cotangent of g (natural-log units), each term summed over the steps its decay spans:
    # q 2^G and k 2^G decay by steps 0..i (a reverse cumsum), k 2^(G_C - G) by steps i+1..C-1
    # (an exclusive cumsum), 2^G_C by every step; the pairs by the steps between them.
    dg_start = _cumsum(I.q_g * dq_g + I.k_g * dk_g, reverse=True)
    dg_end = ddecay[..., None, :] + _cumsum(I.k_d * dk_d, exclusive=True)
    dg = dg_start + dg_end + dg_p
    return dq, dk, dv, dg, dbeta


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _chunk_core(q, k, v, g, beta, lay, gs, keep_intra, states):
    o, final, S_in, _ = _forward(q, k, v, g, beta, lay, gs, save_states=states, keep_intra=False)
    return o, final, S_in


def _chunk_core_fwd(q, k, v, g, beta, lay, gs, keep_intra, states):
    o, final, S_in, kept = _forward(q, k, v, g, beta, lay, gs, save_states=True, keep_intra=keep_intra)
    return (o, final, S_in if states else None), (q, k, v, g, beta, lay, S_in, kept)


def _chunk_core_bwd(gs, keep_intra, states, res, cts):
    q, k, v, g, beta, lay, S_in, kept = res
    do, dfinal, dS_in = cts
    dq, dk, dv, dg, dbeta, dh0 = _backward(q, k, v, g, beta, lay, S_in, kept, do, dfinal, dS_in, gs)
    return dq, dk, dv, dg, dbeta, (None, None, None, dh0)


_chunk_core.defvjp(_chunk_core_fwd, _chunk_core_bwd)


def chunk_kda_xla(
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
):
    """Core chunked KDA on prepared inputs.

    q, k: [B, T, HV, K] (q already scaled, both repeated to HV heads); v: [B, T, HV, V];
    g: [B, T, HV, K] log-space decay; beta: [B, T, HV]; h0: [B, N, HV, K, V].
    All in one float dtype (float32 or float64). disable_recompute: the backward reads the
    forward's matmul products of the intra-chunk stage (Aqk, Kkk, the inverse, w, u) and v_new
    instead of recomputing them (more residual memory; docs/kda_xla.md).
    Returns (o [B, T, HV, V], final [B, N, HV, K, V]) and with ``intermediate_states`` the
    state entering each chunk [B, NC, HV, K, V] (differentiable; chunks no sequence uses are 0).
    """
    C = layout.chunk_size
    xs = tuple(_to_chunks(layout.pack(x), C) for x in (q, k, v, g, beta))
    lay = (layout.chunk_seq, layout.chunk_first, layout.chunk_last, h0)
    gs = 1 if cfg.resolved().schedule == "per_chunk" else layout.n_chunks
    o, final, S_in = _chunk_core(*xs, lay, gs, disable_recompute, intermediate_states)
    o = layout.unpack(_from_chunks(o))
    if not intermediate_states:
        return o, final
    return o, final, layout.zero_unused(jnp.moveaxis(S_in, 0, 1))


CAPABILITIES = Capabilities(
    "xla",
    config=Config,
    cores={"chunk": chunk_kda_xla, "recurrent": fused_recurrent_kda_xla},
    repeats_qk=True,
    portable=True,
)
