"""Kascade by its definitions, written for clarity: the gold standard the backends are tested
against. Dense: each forms the [T, T] (decode: [L]) attention of every head.

They compute in float32, or in float64 given float64 inputs (enable ``jax_enable_x64``).
Shapes: q [B, T, H, D]; k, v [B, T, G, D], H % G == 0, query head h reads KV head
h // (H // G); decode q [B, H, D], caches [B, L, G, D], lengths [B]. Query tile t holds the
queries s_t = t * tile_size .. s_t + tile_size - 1. With ``pool_size`` P the selection is of pools
of P keys (keys pP .. pP + P - 1): tile t chooses among the whole pools before b_t = floor(s_t / P) P
and attends the keys from b_t to each query as its own block; a decode row chooses among the whole
pools of its valid keys and attends the rest (its last, partial pool). Definitions:
../../../docs/kascade.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kdax.ops.common.arrays import masked_softmax
from kdax.ops.kascade.capabilities import Capabilities
from kdax.ops.kascade.checks import (
    POOL_SIZE,
    TILE_SIZE,
    check_call,
    check_index_call,
    check_indexed_call,
    check_options,
    decode_k_max,
    index_tail,
    pool_count,
    pool_keys,
    pool_scores,
    pooled_index_keys,
    prefill_k_max,
    row_lengths,
)

_HI = lax.Precision.HIGHEST


def _cast(q, k, v, scale):
    """q (scaled), k, v in the compute dtype, and q's heads grouped: q [B, T, G, R, D]."""
    dt = jnp.promote_types(q.dtype, jnp.float32)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    G = k.shape[-2]
    q = q.astype(dt) * scale
    return q.reshape(*q.shape[:-2], G, q.shape[-2] // G, q.shape[-1]), k.astype(dt), v.astype(dt)


def _attend(q, k, v, allowed):
    """q [B, T, G, R, D] over k, v [B, S, G, D] where allowed [B, G, R | 1, T, S] -> [B, T, H, D]."""
    scores = jnp.einsum("btgrd,bsgd->bgrts", q, k, precision=_HI)
    o = jnp.einsum("bgrts,bsgd->btgrd", masked_softmax(scores, allowed), v, precision=_HI)
    return o.reshape(*o.shape[:2], -1, o.shape[-1])


def _causal(B, T, lengths):
    """[B, 1, 1, T, T]: key j <= query i < the row's length."""
    i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    return ((j <= i) & (i < lengths[:, None, None]))[:, None, None]


def naive_attention(q, k, v, *, scale=None, lengths=None) -> jax.Array:
    """Dense causal GQA attention.

    Args:
        q: [B, T, H, D]; k, v: [B, T, G, D].
        scale: the scores' scale, D ** -0.5 when None.
        lengths: [B] valid tokens per right-padded row, or None (all T).

    Returns:
        o [B, T, H, D] in q's dtype; 0 past a row's length.
    """
    check_call(q, k, v, lengths, scale=scale)
    B, T = q.shape[:2]
    qg, kc, vc = _cast(q, k, v, scale)
    return _attend(qg, kc, vc, _causal(B, T, row_lengths(lengths, B, T))).astype(q.dtype)


def pooled_probabilities(q, k, *, tile_size=TILE_SIZE, scale=None, lengths=None) -> jax.Array:
    """The anchor's scores: dense causal attention probabilities, summed over each KV head's
    query heads and over each query tile's valid queries.

    Args:
        q: [B, T, H, D]; k: [B, T, G, D].
        tile_size: queries per tile.
        scale, lengths: as :func:`naive_attention`.

    Returns:
        P [B, G, NT, T] in the compute dtype, NT = ceil(T / tile_size): P[b, g, t, j] is the
        attention mass the queries of tile t put on key j (over all keys, the tile's own included).
    """
    B, T = q.shape[:2]
    qg, kc, _ = _cast(q, k, k, scale)
    scores = jnp.einsum("btgrd,bsgd->bgrts", qg, kc, precision=_HI)
    p = masked_softmax(scores, _causal(B, T, row_lengths(lengths, B, T))).sum(axis=2)  # [B, G, T, T]
    NT = -(-T // tile_size)
    p = jnp.pad(p, ((0, 0), (0, 0), (0, NT * tile_size - T), (0, 0)))
    return p.reshape(B, p.shape[1], NT, tile_size, T).sum(axis=3)


def _top(P, k_max, keep):
    """The ``keep`` largest entries per row of P [..., S] (ties toward the smaller index; keep [...]
    per row, <= k_max), sorted ascending, padded with -1 to k_max."""
    S = P.shape[-1]
    order = jnp.argsort(-P, axis=-1, stable=True)[..., :k_max]
    order = jnp.where(jnp.arange(k_max) < keep[..., None], order, S)
    order = jnp.sort(order, axis=-1)
    return jnp.where(order < S, order, -1).astype(jnp.int32)


def _select(P, first, k_max, keep, pool_size):
    """The ``keep`` [...] pools of largest score among the first ``first`` [...] pools of the per-key
    scores P [..., S], as keys [..., k_max] ascending then -1 (:func:`_top`)."""
    scores = pool_scores(P, pool_size)
    scores = jnp.where(jnp.arange(scores.shape[-1]) < first[..., None], scores, -jnp.inf)
    return pool_keys(_top(scores, k_max // pool_size, keep), pool_size)


def select_tiles(P, lengths, *, tile_size, topk_percent, min_k, pool_size=1) -> jax.Array:
    """The selection of every query tile from its pooled probabilities.

    Args:
        P: [B, G, NT, T], as :func:`pooled_probabilities`.
        lengths: [B] valid tokens per row (tiles at or past it select nothing).
        tile_size, topk_percent, min_k, pool_size: as :func:`naive_kascade_anchor`.

    Returns:
        indices [B, G, NT, k_max] int32: the keys of tile t's pool_count(s_t) pools of largest
        summed P among the whole pools before floor(s_t / P) P, ascending, then -1.
    """
    NT, T = P.shape[2:]
    tenths = check_options(topk_percent, min_k, tile_size, pool_size=pool_size)
    starts = np.arange(NT) * tile_size
    keep = jnp.asarray(pool_count(starts, tenths, min_k, pool_size))[None, :] * (starts[None, :] < lengths[:, None])
    k_max = prefill_k_max(T, tile_size, tenths, min_k, pool_size)
    return _select(P, jnp.asarray(starts // pool_size), k_max, keep[:, None], pool_size)


def _members(indices, S):
    """[..., k] indices (-1: none) -> [..., S] bool: which keys are selected."""
    hit = jnp.zeros((*indices.shape[:-1], S + 1), bool)
    idx = jnp.where(indices < 0, S, indices)
    return jnp.put_along_axis(hit, idx, True, axis=-1, inplace=False)[..., :S]


def sparse_mask(indices, *, T, tile_size, head_map=None, lengths=None, pool_size=1) -> jax.Array:
    """What each query attends under a prefill selection: the selection of its tile (of KV head
    head_map[g]) and its tile's own causal block, from the pool boundary b_t = floor(s_t / P) P.

    Args:
        indices: [B, G, NT, k] int, -1 for none.
        T: the tokens.
        tile_size: queries per tile.
        head_map: [G] ints or None (identity).
        lengths: [B] valid tokens per row, or None.
        pool_size: keys per selected pool P.

    Returns:
        allowed [B, G, 1, T, T] bool (query i, key j).
    """
    B = indices.shape[0]
    if head_map is not None:
        indices = jnp.asarray(indices)[:, jnp.asarray(head_map)]
    tile = jnp.arange(T) // tile_size
    chosen = _members(indices, T)[:, :, tile]  # [B, G, T, T]
    i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    diagonal = (j >= tile[:, None] * tile_size // pool_size * pool_size) & (j <= i)
    return ((chosen | diagonal) & _causal(B, T, row_lengths(lengths, B, T))[:, 0])[:, :, None]


def naive_kascade_anchor(
    q,
    k,
    v,
    *,
    topk_percent=10,
    min_k=128,
    tile_size=TILE_SIZE,
    pool_size=POOL_SIZE,
    scale=None,
    dense_output=False,
    lengths=None,
) -> tuple[jax.Array, jax.Array]:
    """A Kascade anchor layer (prefill): select each query tile's keys from exact attention.

    Args:
        q: [B, T, H, D]; k, v: [B, T, G, D].
        topk_percent: the budget k_t = min(s_t, max(min_k, floor(topk_percent * s_t / 100))) keys.
        min_k: the least budget.
        tile_size: queries per tile (16, 32, 64 or 128).
        pool_size: keys per selected pool (1: tokens); the budget rounded down to whole pools.
        scale: D ** -0.5 when None.
        dense_output: return dense causal attention instead of the sparse output.
        lengths: [B] valid tokens per right-padded row, or None.

    Returns:
        (indices [B, G, NT, k_max] int32, o [B, T, H, D] in q's dtype, 0 past a row's length).
    """
    check_call(
        q, k, v, lengths, topk_percent=topk_percent, min_k=min_k, tile_size=tile_size, scale=scale, pool_size=pool_size
    )
    B, T = q.shape[:2]
    rows = row_lengths(lengths, B, T)
    P = pooled_probabilities(q, k, tile_size=tile_size, scale=scale, lengths=rows)
    pools = {"tile_size": tile_size, "pool_size": pool_size}
    indices = select_tiles(P, rows, topk_percent=topk_percent, min_k=min_k, **pools)
    if dense_output:
        return indices, naive_attention(q, k, v, scale=scale, lengths=rows)
    return indices, naive_kascade_reuse(q, k, v, indices, scale=scale, lengths=rows, **pools)


def naive_kascade_reuse(
    q, k, v, indices, *, head_map=None, tile_size=TILE_SIZE, pool_size=POOL_SIZE, scale=None, lengths=None
) -> jax.Array:
    """A Kascade reuse layer (prefill): attend an anchor's selection, remapped per KV head.

    Args:
        q: [B, T, H, D]; k, v: [B, T, G, D].
        indices: [B, G, NT, k] int32 of an anchor (-1 for none).
        head_map: [G] ints: KV head g uses the anchor's selection of KV head head_map[g]; None: identity.
        tile_size, pool_size, scale, lengths: as :func:`naive_kascade_anchor` (pool_size the anchor's).

    Returns:
        o [B, T, H, D] in q's dtype, 0 past a row's length.
    """
    _, head_map = check_call(
        q, k, v, lengths, indices=indices, head_map=head_map, tile_size=tile_size, scale=scale, pool_size=pool_size
    )
    T = q.shape[1]
    qg, kc, vc = _cast(q, k, v, scale)
    allowed = sparse_mask(indices, T=T, tile_size=tile_size, head_map=head_map, lengths=lengths, pool_size=pool_size)
    return _attend(qg, kc, vc, allowed).astype(q.dtype)


def _decode_scores(q, k_cache, lengths, scale):
    """([B, G, R, L] scores, [B, 1, 1, L] valid keys) of one query token per row."""
    qg, kc, _ = _cast(q[:, None], k_cache, k_cache, scale)
    scores = jnp.einsum("bgrd,bsgd->bgrs", qg[:, 0], kc, precision=_HI)
    valid = jnp.arange(k_cache.shape[1])[None, :] < jnp.asarray(lengths)[:, None]
    return scores, valid[:, None, None]


def naive_kascade_anchor_decode(
    q, k_cache, v_cache, lengths, *, topk_percent=10, min_k=128, pool_size=POOL_SIZE, scale=None, dense_output=False
) -> tuple[jax.Array, jax.Array]:
    """A Kascade anchor layer (one decode step): select keys from the exact attention of the token.

    Args:
        q: [B, H, D]; k_cache, v_cache: [B, L, G, D].
        lengths: [B] valid keys per row, the current token's included.
        topk_percent, min_k: the budget k_b = min(len_b, max(min_k, floor(topk_percent * len_b / 100))).
        pool_size: keys per selected pool P (1: tokens): the budget in whole pools among the
            len_b // P whole pools of the row; its last, partial pool is always attended.
        scale: D ** -0.5 when None.
        dense_output: return dense attention over the valid keys instead of the sparse output.

    Returns:
        (indices [B, G, k_max] int32, ascending then -1; o [B, H, D] in q's dtype).
    """
    options = {"topk_percent": topk_percent, "min_k": min_k, "scale": scale, "pool_size": pool_size}
    tenths, _ = check_call(q, k_cache, v_cache, lengths, decode=True, **options)
    scores, valid = _decode_scores(q, k_cache, lengths, scale)
    P = masked_softmax(scores, valid).sum(axis=2)  # [B, G, L]
    lengths = jnp.asarray(lengths, jnp.int32)
    keep = pool_count(lengths, tenths, min_k, pool_size)[:, None]
    k_max = decode_k_max(k_cache.shape[1], tenths, min_k, pool_size)
    indices = _select(P, (lengths // pool_size)[:, None], k_max, keep, pool_size)
    if dense_output:
        return indices, _decode_attend(scores, valid, v_cache, q.dtype)
    return indices, naive_kascade_reuse_decode(q, k_cache, v_cache, lengths, indices, pool_size=pool_size, scale=scale)


def _decode_attend(scores, allowed, v_cache, dtype):
    vc = v_cache.astype(scores.dtype)
    o = jnp.einsum("bgrs,bsgd->bgrd", masked_softmax(scores, allowed), vc, precision=_HI)
    return o.reshape(o.shape[0], -1, o.shape[-1]).astype(dtype)


def naive_kascade_reuse_decode(
    q, k_cache, v_cache, lengths, indices, *, head_map=None, pool_size=POOL_SIZE, scale=None
) -> jax.Array:
    """A Kascade reuse layer (one decode step): attend an anchor's selection (and, with pools, the
    row's last partial pool) only.

    Args:
        q: [B, H, D]; k_cache, v_cache: [B, L, G, D]; lengths: [B].
        indices: [B, G, k] int32 of an anchor's decode step (-1 for none).
        head_map: as :func:`naive_kascade_reuse`.
        pool_size: the anchor's (:func:`naive_kascade_anchor_decode`).
        scale: D ** -0.5 when None.

    Returns:
        o [B, H, D] in q's dtype (0 in a row with nothing selected).
    """
    _, head_map = check_call(
        q, k_cache, v_cache, lengths, decode=True, indices=indices, head_map=head_map, scale=scale, pool_size=pool_size
    )
    L = k_cache.shape[1]
    if head_map is not None:
        indices = jnp.asarray(indices)[:, head_map]
    scores, valid = _decode_scores(q, k_cache, lengths, scale)
    tail = jnp.arange(L)[None, :] >= (jnp.asarray(lengths)[:, None] // pool_size * pool_size)  # [B, L]
    allowed = (_members(jnp.asarray(indices), L) | tail[:, None])[:, :, None] & valid
    return _decode_attend(scores, allowed, v_cache, q.dtype)


def naive_index_select(
    q, weights, keys, gates, ape, *, topk, kpool, tail=True, scale=None, q_positions=None, lengths=None, key_rows=None
) -> jax.Array:
    """DSA's lightning-indexer selection (GLM-5.3's): each query's ``topk / kpool`` pools of
    largest index score among the whole pools whose last key it sees, then its own incomplete pool.

    Pool p holds keys p kpool .. (p + 1) kpool - 1; its key is :func:`pooled_index_keys`. Query t
    (at position q_t) scores pool p as ``sum_h weights[t, h] relu(scale q[t, h] . pool_p)`` in
    float32, among the pools with (p + 1) kpool - 1 <= q_t and (p + 1) kpool <= the row's length;
    ties go to the smaller pool.

    Args:
        q: [B, T, Hi, d] the index queries.
        weights: [B, T, Hi] the heads' weights.
        keys, gates: [B, S, d] the keys' index keys and pooling logits.
        ape: [kpool, d] the pooling logits' bias per position in a pool.
        topk: the keys selected in whole pools, a multiple of ``kpool``.
        kpool: keys per pool.
        tail: append each query's incomplete pool, keys q_t + 1 - (q_t + 1) % kpool .. q_t.
        scale: d ** -0.5 when None.
        q_positions: [B, T] the queries' positions (default 0..T-1); a query at or past its
            row's length, or negative, selects nothing.
        lengths: [Bk] the valid keys of each row of keys (default S).
        key_rows: [B, T] int, the row of keys and gates each query reads (default its own row b;
            keys may then have Bk rows of any number: a serving step's requests).

    Returns:
        indices [B, T, topk + (kpool - 1 if tail else 0)] int32: the selected pools' keys
        ascending (-1 in unfilled slots), then the tail's (-1 for none).
    """
    q_positions, lengths, key_rows = check_index_call(
        q, weights, keys, gates, ape, q_positions, lengths, topk=topk, kpool=kpool, scale=scale, key_rows=key_rows
    )
    dt = jnp.promote_types(q.dtype, jnp.float32)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    pooled = pooled_index_keys(keys, gates, ape, kpool)[key_rows]  # [B, T, NP, d]
    lengths = lengths[key_rows]  # [B, T]
    s = jnp.maximum(jnp.einsum("bthd,btpd->bthp", q.astype(dt), pooled.astype(dt), precision=_HI) * scale, 0)
    scores = jnp.einsum("bth,bthp->btp", weights.astype(dt), s, precision=_HI)
    k_max = topk // kpool
    scores = jnp.pad(scores, ((0, 0), (0, 0), (0, max(0, k_max - scores.shape[-1]))))
    ends = (jnp.arange(scores.shape[-1]) + 1) * kpool - 1
    q_ok = (q_positions >= 0) & (q_positions < lengths)
    candidate = (ends <= q_positions[..., None]) & (ends < lengths[..., None]) & q_ok[..., None]
    keep = jnp.minimum(candidate.sum(-1), k_max)
    indices = pool_keys(_top(jnp.where(candidate, scores, -jnp.inf), k_max, keep), kpool)
    if tail and kpool > 1:
        indices = jnp.concatenate([indices, index_tail(q_positions, lengths, kpool)], -1)
    return indices


def naive_indexed_attention(q, k, v, indices, *, scale=None, lengths=None) -> jax.Array:
    """Attention of each query over the keys its row of ``indices`` lists (DSA's sparse attention).

    Args:
        q: [B, T, H, D]; k: [B, S, G, D]; v: [B, S, G, Dv], H % G == 0.
        indices: [B, T, W] int, the keys each query attends, shared by its heads (-1: none).
        scale: D ** -0.5 when None.
        lengths: [B] the valid keys of each row (default S); listed keys at or past it are skipped.

    Returns:
        o [B, T, H, Dv] in q's dtype, 0 for a query with no key.
    """
    lengths = check_indexed_call(q, k, v, indices, lengths)
    S = k.shape[1]
    qg, kc, vc = _cast(q, k, v, scale)
    allowed = _members(jnp.asarray(indices), S) & (jnp.arange(S) < lengths[:, None, None])
    return _attend(qg, kc, vc, allowed[:, None, None]).astype(q.dtype)


CAPABILITIES = Capabilities("naive", portable=True, reference=True)
