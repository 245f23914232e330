"""What the Kascade Pallas kernels of both platforms share: the packed layout they read,
the block math inside them (exact scores, online softmax, pooled probabilities) and the XLA
steps around them (selection, split combine). Design: docs/kascade_tpu.md, docs/kascade_gpu.md.

Packed layout (:class:`Plan`): one KV head's queries ``[B, G, Tp * Rp, D]``, rows token-major then head
(row ``n`` is token ``n // Rp``, query head ``g * R + n % Rp``), so a query tile of ``tile``
tokens is the ``tile * Rp`` consecutive rows one program multiplies against each K/V block:
every K/V row it reads serves all R query heads of its group. Rp >= R pads the heads (with
zero queries that the masks drop) where a platform wants more rows. Scores are taken in log2
units (``s * scale * log2(e)``) so the softmax runs on ``exp2``; every statistic is float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kdax.ops.common.arrays import LOG2E, round_up
from kdax.ops.kascade.checks import prefill_k_max
from kdax.ops.kascade.xla import decode_select, select, with_tail

F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # a [m, d] x b [n, d] -> [m, n]
_NN = (((1,), (0,)), ((), ()))  # a [m, n] x b [n, d] -> [m, d]


def precision(dtype) -> lax.Precision:
    """Of the kernels' matmuls: exact float32 products for float32 inputs, the default else."""
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def pow2(n: int, least: int = 1) -> int:
    """The least power of two >= max(n, least)."""
    return max(least, 1 << max(0, n - 1).bit_length())


# ----------------------------------------------------------------------------- prefill (XLA around the kernels)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A prefill call's packed geometry: T tokens, H query heads, G KV heads of dim D, padded to
    Rp heads per group, Dp and Tp; ``scale2`` the scores' scale in log2 units."""

    T: int
    H: int
    G: int
    D: int
    Rp: int
    Dp: int
    Tp: int
    tile_size: int
    scale2: float

    @classmethod
    def make(cls, q, k, tile_size: int, scale: float, *, Rp: int, Dp: int, block: int) -> Plan:
        """For q [B, T, H, D], k [B, T, G, D]; T padded to a multiple of tile_size and ``block``."""
        _, T, H, D = q.shape
        return cls(T, H, k.shape[2], D, Rp, Dp, round_up(T, max(tile_size, block)), tile_size, scale * LOG2E)

    @property
    def R(self) -> int:
        return self.H // self.G

    @property
    def NT(self) -> int:
        return -(-self.T // self.tile_size)

    @property
    def rows(self) -> int:
        return self.tile_size * self.Rp

    def pack(self, q, k, v):
        """q [B, T, H, D] -> [B, G, Tp * Rp, Dp] (token-major, then head); k, v -> [B, G, Tp, Dp]."""
        B = q.shape[0]
        x = q.reshape(B, self.T, self.G, self.R, self.D)
        x = jnp.pad(x, ((0, 0), (0, self.Tp - self.T), (0, 0), (0, self.Rp - self.R), (0, self.Dp - self.D)))
        qp = x.transpose(0, 2, 1, 3, 4).reshape(B, self.G, self.Tp * self.Rp, self.Dp)
        pad = ((0, 0), (0, self.Tp - self.T), (0, 0), (0, self.Dp - self.D))
        return (qp, *(jnp.pad(y, pad).transpose(0, 2, 1, 3) for y in (k, v)))

    def unpack(self, o):
        """[B, G, Tp * Rp, Dp] -> [B, T, H, D], the padding dropped."""
        B = o.shape[0]
        x = o.reshape(B, self.G, self.Tp, self.Rp, self.Dp)[:, :, : self.T, : self.R, : self.D]
        return x.transpose(0, 2, 1, 3, 4).reshape(B, self.T, self.H, self.D)


def anchor(attend, scores, q, k, v, lengths, plan: Plan, *, tenths, min_k, k_max, pool_size, dense_output):
    """An anchor layer from a platform's kernels: ``attend(qp, kp, vp, lengths, indices or None,
    plan)`` -> (o, lse2) and ``scores(qp, kp, lse2, lengths, plan)`` -> pooled P [B, G, NT, Tp].
    Returns (indices [B, G, NT, k_max] int32, o [B, T, H, D])."""
    qp, kp, vp = plan.pack(q, k, v)
    o, lse2 = attend(qp, kp, vp, lengths, None, plan)
    budget = {"tenths": tenths, "min_k": min_k, "k_max": k_max, "pool_size": pool_size}
    idx = banded_select(scores(qp, kp, lse2, lengths, plan), lengths, plan, **budget)
    if not dense_output:
        o, _ = attend(qp, kp, vp, lengths, _with_tail(idx, plan, pool_size), plan)
    return idx, plan.unpack(o)


SELECT_BANDS = 8  # bands of query tiles the top-k takes apart (docs/kascade_gpu.md, "The anchor's selection")


def select_bands(NT: int) -> list[tuple[int, int]]:
    """The bands [t0, t1) of consecutive query tiles that :func:`banded_select` takes apart."""
    per_band = -(-NT // min(NT, SELECT_BANDS))
    return [(t0, min(NT, t0 + per_band)) for t0 in range(0, NT, per_band)]


def banded_select(P, lengths, plan: Plan, *, tenths, min_k, k_max, pool_size=1):
    """The anchor's selection from the float32 pooled scores P [B, G, NT, >= T] (only keys before
    each tile read). The tiles go to the top-k in :func:`select_bands` (up to
    :data:`SELECT_BANDS` bands of consecutive tiles), each over the keys before its last tile and
    with its last tile's budget, so the sort sees about (1 + 1/bands) / 2 of the [NT, T]
    rectangle; the result is the whole-rectangle selection's. Returns indices [B, G, NT, k_max] int32."""
    out = []
    for t0, t1 in select_bands(plan.NT):
        keys = (t1 - 1) * plan.tile_size
        starts = jnp.arange(t0, t1, dtype=jnp.int32) * plan.tile_size
        width = prefill_k_max(keys + 1, plan.tile_size, tenths, min_k, pool_size)  # the band's last tile's
        band = select(
            P[:, :, t0:t1, :keys], starts, lengths, tenths=tenths, min_k=min_k, k_max=width, pool_size=pool_size
        )
        out.append(pad_selection(band, k_max))
    return jnp.concatenate(out, axis=2)


def _with_tail(indices, plan: Plan, pool_size: int):
    """A selection with each tile's keys from its pool boundary to its start (:func:`with_tail`): the
    token kernels attend the tile's own block from its start, so the rest of it rides as selected keys."""
    starts = jnp.arange(plan.NT, dtype=jnp.int32) * plan.tile_size
    return with_tail(indices, starts, tile_size=plan.tile_size, pool_size=pool_size)


def reuse(attend, q, k, v, lengths, indices, plan: Plan, pool_size: int = 1):
    """A reuse layer from a platform's ``attend`` (as :func:`anchor`). Returns o [B, T, H, D]."""
    qp, kp, vp = plan.pack(q, k, v)
    return plan.unpack(attend(qp, kp, vp, lengths, _with_tail(indices, plan, pool_size), plan)[0])


def selection_blocks(indices: jax.Array, block: int) -> jax.Array:
    """How many blocks of ``block`` positions of each selection row hold a key: [..., k] -> [...] int32
    (up to the last non-negative entry, so rows need not be compacted)."""
    pos = jnp.where(indices >= 0, jnp.arange(1, indices.shape[-1] + 1, dtype=jnp.int32), 0)
    return (-(-jnp.max(pos, axis=-1, initial=0) // block)).astype(jnp.int32)


def pad_selection(indices: jax.Array, width: int) -> jax.Array:
    """indices [..., k] int32 padded with -1 to [..., width]."""
    return jnp.pad(indices, [(0, 0)] * (indices.ndim - 1) + [(0, width - indices.shape[-1])], constant_values=-1)


def decode_selection(
    s2: jax.Array, lengths: jax.Array, *, R: int, L: int, tenths: int, min_k: int, k_max: int, pool_size: int = 1
):
    """A decode selection from the log2 scores the decode anchor kernels wrote (:func:`decode_select`).

    s2 [B, G, >= R, >= L] float32 (rows >= R and keys >= a row's length are never read).
    Returns (indices [B, G, k_max] int32, lse2 [B, G, R] of the valid keys).
    """
    s2 = s2[:, :, :R, :L]
    valid = (jnp.arange(L)[None, :] < lengths[:, None])[:, None, None]  # [B, 1, 1, L]
    s2 = jnp.where(valid, s2, -jnp.inf)
    m = jnp.max(s2, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0)
    lse2 = m + jnp.log2(jnp.sum(jnp.exp2(s2 - m), axis=-1, keepdims=True))
    P = jnp.sum(jnp.where(valid, jnp.exp2(s2 - lse2), 0), axis=2)  # [B, G, L]
    budget = {"tenths": tenths, "min_k": min_k, "k_max": k_max, "pool_size": pool_size}
    return decode_select(P, lengths, **budget), lse2[..., 0]


def decode_output(acc: jax.Array, m: jax.Array, l: jax.Array, q: jax.Array) -> jax.Array:
    """The decode output from the softmax partials of S splits, combined by their log-sum-exp.

    acc [B, G, S, rows, Dp] (unnormalised), m, l [B, G, S, rows, 1] (log2 max, sum) float32;
    q [B, H, D] the step's queries. Returns o [B, H, D] in q's dtype, 0 in rows with no key.
    """
    B, H, D = q.shape
    M = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp2(m - jnp.where(jnp.isfinite(M), M, 0))  # 0 for empty splits
    total = jnp.sum(w * l, axis=2)
    o = jnp.sum(w * acc, axis=2) / jnp.where(total > 0, total, 1)  # [B, G, rows, Dp]
    return o[:, :, : H // o.shape[1], :D].reshape(B, H, D).astype(q.dtype)


def decode_partials(B: int, G: int, S: int, rows: int, D: int, index_map):
    """The decode kernels' softmax partials per split, acc [B, G, S, rows, D], m, l [.., 1] float32:
    (their block specs, one split's of one KV head at ``index_map``; their shapes)."""
    dims = (D, 1, 1)
    specs = [pl.BlockSpec((None, None, None, rows, d), index_map) for d in dims]
    return specs, [jax.ShapeDtypeStruct((B, G, S, rows, d), F32) for d in dims]


def pack_decode_queries(q: jax.Array, G: int, Rq: int, Dp: int) -> jax.Array:
    """q [B, H, D] -> [B, G, Rq, Dp], heads and head dim zero-padded."""
    B, H, D = q.shape
    return jnp.pad(q.reshape(B, G, H // G, D), ((0, 0), (0, 0), (0, Rq - H // G), (0, Dp - D)))


# ----------------------------------------------------------------------------- inside the kernels


def dot_nt(a, b, prec):
    """a [m, d] x b [n, d] -> [m, n] float32."""
    return lax.dot_general(a, b, _NT, precision=prec, preferred_element_type=F32)


def dot_nn(a, b, prec):
    """a [m, n] x b [n, d] -> [m, d] float32."""
    return lax.dot_general(a, b, _NN, precision=prec, preferred_element_type=F32)


def start_softmax(rows: int, D: int):
    """The online softmax's state (m, l, acc): log2 max [rows, 1], sum [rows, 1], acc [rows, D]."""
    return jnp.full((rows, 1), -jnp.inf, F32), jnp.zeros((rows, 1), F32), jnp.zeros((rows, D), F32)


def softmax_step(state, s2, v, prec, s_max=None):
    """Fold one block of masked log2 scores s2 [rows, n] (-inf: not attended) and its values
    v [n, D] into the online softmax's state; ``s_max`` [rows, 1] the block's row max if taken
    already (a pipelined loop takes it a step early: the cross-lane max is a long latency)."""
    m, l, acc = state
    m_new = jnp.maximum(m, jnp.max(s2, axis=1, keepdims=True) if s_max is None else s_max)
    ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - ref)
    p = jnp.exp2(s2 - ref)
    l = l * alpha + jnp.sum(p, axis=1, keepdims=True)
    return m_new, l, acc * alpha + dot_nn(p.astype(v.dtype), v, prec)


def finish_softmax(state):
    """(o [rows, D] float32, 0 in rows that attended nothing; lse2 [rows, 1], -inf there)."""
    m, l, acc = state
    some = l > 0
    return acc / jnp.where(some, l, 1.0), jnp.where(some, m + jnp.log2(jnp.where(some, l, 1.0)), -jnp.inf)


def div(n, d):
    """n // d of non-negative ints inside a kernel (truncating: no floor rounding to lower)."""
    n = jnp.asarray(n, jnp.int32)
    return lax.div(n, jnp.asarray(d, n.dtype))


def rem(n, d):
    """n % d of non-negative ints inside a kernel."""
    n = jnp.asarray(n, jnp.int32)
    return lax.rem(n, jnp.asarray(d, n.dtype))


def cdiv(n, d):
    """ceil(n / d) of non-negative ints inside a kernel."""
    return div(n + d - 1, d)


def row_mask(rows: int, Rp: int, R: int, start, length):
    """(positions [rows, 1] of a query tile's packed rows from token ``start``, which rows are
    real queries [rows, 1]: a head < R and a token < length)."""
    n = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    pos = start + div(n, Rp)
    return pos, (rem(n, Rp) < R) & (pos < length)


def pooled(s2, lse2, ok):
    """The attention mass [1, n] the rows put on n keys: sum over rows of exp2(s2 - lse2) where ok."""
    return jnp.sum(jnp.where(ok, jnp.exp2(s2 - lse2), 0.0), axis=0, keepdims=True)
