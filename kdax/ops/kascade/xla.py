"""Kascade in plain XLA ops (backend "xla", the portable default), in memory O(B T (H D + G k_max)).

Prefill runs over blocks of query tiles (``lax.map``): an anchor block forms its queries'
scores against all keys (one block of the [T, T] matrix at a time), takes exact softmax
probabilities (max and sum first, then probabilities), pools them per tile and KV head,
selects with ``lax.top_k``; the sparse output of a block gathers each tile's selected K/V
rows and attends them together with the tile's own causal block. Decode forms the one
query's scores over the cache (anchor) or gathers the selected rows only (reuse). Scores,
softmax and accumulation in float32 whatever the inputs' dtype. Design: docs/kascade.md.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from kdax.ops.common.arrays import masked_softmax
from kdax.ops.kascade.capabilities import Capabilities
from kdax.ops.kascade.checks import index_tail, pool_count, pool_keys, pool_scores, pooled_index_keys


@dataclasses.dataclass(frozen=True)
class Config:
    """Per-call settings of the xla backend.

    Attributes:
        block_bytes: the most bytes of float32 scores one block of query tiles forms (anchor:
            queries x all keys x heads; it sets how many tiles a block takes; at least one).
    """

    block_bytes: int = 16 << 20

    def resolved(self) -> Config:
        """This config (nothing depends on the device)."""
        return self


def _precision(dtype):
    return lax.Precision.HIGHEST if dtype == jnp.float32 or dtype == jnp.float64 else lax.Precision.DEFAULT


def _acc(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def top(P, k_max, keep):
    """The ``keep`` [...] largest of P [..., S] (ties toward the smaller index), ascending, -1-padded to k_max."""
    if k_max == 0:
        return jnp.zeros((*P.shape[:-1], 0), jnp.int32)
    S = P.shape[-1]
    _, order = lax.top_k(P, k_max)
    order = jnp.sort(jnp.where(jnp.arange(k_max) < keep[..., None], order, S), axis=-1)
    return jnp.where(order < S, order, -1).astype(jnp.int32)


def threshold_top(scores, k_max, keep):
    """:func:`top` without a sort, for the pools' few hundred scores a row: each row's ``keep``-th
    largest value found by bisection on its float32 bits (32 passes of a compare and a count),
    the values above it taken and the ties at it toward the smaller index (a running count), then
    the taken positions listed in order (a compare of every slot with every position). Every step
    is a fixed-size array op, so a compiled program's cost is static (XLA's sort loops are not)."""
    if k_max == 0:
        return jnp.zeros((*scores.shape[:-1], 0), jnp.int32)
    bits = lax.bitcast_convert_type(scores.astype(jnp.float32), jnp.int32)
    key = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)  # ordered as the floats are
    keep = jnp.broadcast_to(keep, scores.shape[:-1]).astype(jnp.int32)
    lo = jnp.full(scores.shape[:-1], jnp.iinfo(jnp.int32).min, jnp.int32)  # count(key >= lo) >= keep
    hi = jnp.full(scores.shape[:-1], jnp.iinfo(jnp.int32).max, jnp.int32)
    for _ in range(32):  # the largest lo with count(key >= lo) >= keep
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)
        enough = jnp.sum(key >= mid[..., None], axis=-1, dtype=jnp.int32) >= keep
        lo, hi = jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)
    above, tied = key > lo[..., None], key == lo[..., None]
    need = keep - jnp.sum(above, axis=-1, dtype=jnp.int32)
    taken = (above | (tied & (jnp.cumsum(tied, axis=-1, dtype=jnp.int32) <= need[..., None]))) & (keep > 0)[..., None]
    return compact(jnp.arange(scores.shape[-1], dtype=jnp.int32), taken, k_max, -1)


def compact(x, valid, width: int, fill: int):
    """x [..., n] (non-negative ints) where ``valid``, in order, in ``width`` slots [..., width]
    int32, the rest ``fill``; with no sort: each valid entry's slot is the count of valid entries
    before it (a compare of every slot with every entry)."""
    if valid.shape[-1] == 0:  # nothing to place (an empty selection)
        return jnp.full((*valid.shape[:-1], width), fill, jnp.int32)
    slot = jnp.where(valid, jnp.cumsum(valid, axis=-1, dtype=jnp.int32) - 1, -1)  # [..., n]
    hit = slot[..., None, :] == jnp.arange(width, dtype=jnp.int32)[:, None]  # [..., width, n]
    x = jnp.broadcast_to(x, valid.shape)[..., None, :]
    return jnp.where(hit.any(-1), jnp.max(jnp.where(hit, x, -1), axis=-1), fill).astype(jnp.int32)


def select(pooled, starts, lengths, *, pool_size=1, **budget):
    """The selection of query tiles from their pooled probabilities.

    pooled [B, G, n, S] per key (entries at keys from the tile's pool boundary on are ignored);
    starts [n] the tiles' first positions; lengths [B]; ``budget``: tenths, min_k, k_max. Returns
    indices [B, G, n, k_max] int32:
    the keys of each tile's budget of pools of largest summed score among the whole pools before
    its pool boundary floor(s_t / P) P, ascending, then -1 (none for tiles at or past a row's length).
    """
    pools = select_pools(pool_scores(pooled, pool_size), starts, lengths, pool_size=pool_size, **budget)
    return pool_keys(pools, pool_size)


def select_pools(scores, starts, lengths, *, tenths, min_k, k_max, pool_size):
    """:func:`select` from the scores of whole pools [B, G, n, >= S / P]: the selected pools
    [B, G, n, k_max / P] int32 (their ids, ascending, then -1)."""
    candidate = jnp.arange(scores.shape[-1])[None, :] < (starts // pool_size)[:, None]
    scores = jnp.where(candidate, scores, -jnp.inf)
    keep = pool_count(starts, tenths, min_k, pool_size)[None] * (starts[None] < lengths[:, None])  # [B, n]
    return (threshold_top if pool_size > 1 else top)(scores, k_max // pool_size, keep[:, None])


def with_tail(indices, starts, *, tile_size: int, pool_size: int):
    """A prefill selection [B, G, n, k] of tiles starting at ``starts`` [n], with each tile's keys from
    its pool boundary up to its start appended, [B, G, n, k + max(0, P - tile_size)] (-1 where none):
    what a sparse pass that attends a tile's own block from its start attends with pools of P keys."""
    extra = max(0, pool_size - tile_size)
    if not extra:
        return indices
    tail = (starts // pool_size * pool_size)[:, None] + jnp.arange(extra, dtype=jnp.int32)
    tail = jnp.where(tail < starts[:, None], tail, -1).astype(indices.dtype)
    return jnp.concatenate([indices, jnp.broadcast_to(tail, (*indices.shape[:2], *tail.shape))], axis=-1)


def with_decode_tail(indices, lengths, pool_size: int):
    """A decode selection [B, G, k] with each row's last, partial pool appended, [B, G, k + P - 1]."""
    if pool_size == 1:
        return indices
    tail = (lengths // pool_size * pool_size)[:, None] + jnp.arange(pool_size - 1, dtype=jnp.int32)
    tail = jnp.where(tail < lengths[:, None], tail, -1)
    return jnp.concatenate([indices, jnp.broadcast_to(tail[:, None], (*indices.shape[:2], pool_size - 1))], axis=-1)


def _gather(x, indices):
    """x [B, G, S, D] at indices [B, G, n, k] (-1 read as 0) -> [B, G, n, k, D]."""
    B, G, n, k = indices.shape
    flat = jnp.maximum(indices, 0).reshape(B, G, n * k, 1)
    return jnp.take_along_axis(x, flat, axis=2).reshape(B, G, n, k, x.shape[-1])


def _sparse_block(qb, kt, vt, kd, vd, indices, rows, lengths, scale):
    """Sparse attention of one block of query tiles.

    qb [B, nb, tile, G, R, D]; kt, vt [B, G, S, D] (all keys); kd, vd [B, nb, tile, G, D]
    (the tiles' own keys); indices [B, G, nb, k]; rows [nb, tile] the queries' positions;
    lengths [B]. Returns [B, nb, tile, G, R, D] in float32.
    """
    acc, prec = _acc(qb.dtype), _precision(qb.dtype)
    starts = rows[:, 0]
    valid_q = rows[None] < lengths[:, None, None]  # [B, nb, tile]
    ks, vs = _gather(kt, indices), _gather(vt, indices)
    s_sel = jnp.einsum("bntgrd,bgnkd->bgrntk", qb, ks, preferred_element_type=acc, precision=prec) * scale
    s_diag = jnp.einsum("bntgrd,bnsgd->bgrnts", qb, kd, preferred_element_type=acc, precision=prec) * scale
    a_sel = (indices >= 0) & (indices < starts[None, None, :, None])  # [B, G, nb, k]
    a_sel = a_sel[:, :, None, :, None, :] & valid_q[:, None, None, :, :, None]
    a_diag = (rows[:, None, :] <= rows[:, :, None])[None] & valid_q[..., None]  # [B, nb, tile, tile]
    s = jnp.concatenate([jnp.where(a_sel, s_sel, -jnp.inf), jnp.where(a_diag[:, None, None], s_diag, -jnp.inf)], -1)
    p = masked_softmax(s, s > -jnp.inf)
    k = indices.shape[-1]
    o = jnp.einsum("bgrntk,bgnkd->bntgrd", p[..., :k], vs.astype(acc), precision=prec)
    return o + jnp.einsum("bgrnts,bnsgd->bntgrd", p[..., k:], vd.astype(acc), precision=prec)


def _blocks(q, k, v, tile_size, cfg):
    """Padded, grouped inputs and the block plan shared by anchor and reuse prefill."""
    B, T, H, D = q.shape
    G = k.shape[2]
    NT = -(-T // tile_size)
    S = NT * tile_size
    nb = max(1, min(NT, cfg.block_bytes // (4 * B * H * tile_size * S)))
    NB = -(-NT // nb)
    Tp = NB * nb * tile_size
    pad = ((0, 0), (0, Tp - T), (0, 0), (0, 0))
    qp, kp, vp = (jnp.pad(x, pad) for x in (q, k, v))
    return qp.reshape(B, Tp, G, H // G, D), kp, vp, nb, NB, NT, S


def _block_inputs(qp, kp, vp, blk, nb, tile_size):
    """The block's queries [B, nb, tile, G, R, D], own keys and values [B, nb, tile, G, D], positions [nb, tile]."""
    B, _, G, R, D = qp.shape
    q0 = blk * nb * tile_size
    take = lambda x: lax.dynamic_slice_in_dim(x, q0, nb * tile_size, axis=1)
    qb = take(qp).reshape(B, nb, tile_size, G, R, D)
    kd, vd = (take(x).reshape(B, nb, tile_size, G, D) for x in (kp, vp))
    return qb, kd, vd, q0 + jnp.arange(nb * tile_size).reshape(nb, tile_size)


def kascade_anchor_xla(q, k, v, lengths, *, tenths, min_k, k_max, tile_size, pool_size, scale, dense_output, cfg):
    """See :func:`kdax.kascade_anchor`. q [B, T, H, D]; k, v [B, T, G, D]; lengths [B] int32.

    Returns (indices [B, G, NT, k_max] int32, o [B, T, H, D] in q's dtype)."""
    B, T = q.shape[:2]
    qp, kp, vp, nb, NB, NT, S = _blocks(q, k, v, tile_size, cfg)
    acc, prec = _acc(q.dtype), _precision(q.dtype)
    kt, vt = (x[:, :S].transpose(0, 2, 1, 3) for x in (kp, vp))  # [B, G, S, D]
    keys = jnp.arange(S)

    def block(blk):
        qb, kd, vd, rows = _block_inputs(qp, kp, vp, blk, nb, tile_size)
        s = jnp.einsum("bntgrd,bgsd->bgrnts", qb, kt, preferred_element_type=acc, precision=prec) * scale
        valid_q = rows[None] < lengths[:, None, None]  # [B, nb, tile]
        allowed = (keys <= rows[..., None])[None] & valid_q[..., None]  # [B, nb, tile, S]
        p = masked_softmax(s, allowed[:, None, None])  # [B, G, R, nb, tile, S]
        budget = {"tenths": tenths, "min_k": min_k, "k_max": k_max, "pool_size": pool_size}
        idx = select(p.sum(axis=(2, 4)), rows[:, 0], lengths, **budget)
        if dense_output:
            o = jnp.einsum("bgrnts,bgsd->bntgrd", p, vt.astype(acc), precision=prec)
        else:
            sel = with_tail(idx, rows[:, 0], tile_size=tile_size, pool_size=pool_size)
            o = _sparse_block(qb, kt, vt, kd, vd, sel, rows, lengths, scale)
        return idx, o.astype(q.dtype)

    idx, o = lax.map(block, jnp.arange(NB))  # [NB, B, G, nb, k], [NB, B, nb, tile, G, R, D]
    idx = jnp.moveaxis(idx, 0, 2).reshape(B, k.shape[2], NB * nb, k_max)[:, :, :NT]
    return idx, _unblock(o, T)


def kascade_reuse_xla(q, k, v, lengths, indices, *, tile_size, pool_size, scale, cfg):
    """See :func:`kdax.kascade_reuse`. indices [B, G, NT, k] already remapped per KV head.

    Returns o [B, T, H, D] in q's dtype."""
    B, T = q.shape[:2]
    starts = jnp.arange(indices.shape[2], dtype=jnp.int32) * tile_size
    indices = with_tail(indices, starts, tile_size=tile_size, pool_size=pool_size)
    kk = indices.shape[-1]
    qp, kp, vp, nb, NB, NT, S = _blocks(q, k, v, tile_size, cfg)
    kt, vt = (x[:, :S].transpose(0, 2, 1, 3) for x in (kp, vp))
    idx = jnp.pad(indices, ((0, 0), (0, 0), (0, NB * nb - NT), (0, 0)), constant_values=-1)
    idx = jnp.moveaxis(idx.reshape(B, idx.shape[1], NB, nb, kk), 2, 0)  # [NB, B, G, nb, k]

    def block(args):
        blk, ib = args
        qb, kd, vd, rows = _block_inputs(qp, kp, vp, blk, nb, tile_size)
        return _sparse_block(qb, kt, vt, kd, vd, ib, rows, lengths, scale).astype(q.dtype)

    return _unblock(lax.map(block, (jnp.arange(NB), idx)), T)


def _unblock(o, T):
    """[NB, B, nb, tile, G, R, D] -> [B, T, H, D]."""
    NB, B, nb, tile, G, R, D = o.shape
    return jnp.moveaxis(o, 0, 1).reshape(B, NB * nb * tile, G * R, D)[:, :T]


def _heads_first(x, cache_layout: str):
    """A decode cache as [B, G, L, D] (a "BLGD" one transposed)."""
    return x if cache_layout == "BGLD" else x.transpose(0, 2, 1, 3)


def _decode_scores(q, k_cache, lengths, scale, cache_layout):
    """Scores [B, G, R, L] (float32) of one token per row and the valid keys [B, L]."""
    B, H, D = q.shape
    layout = "bgsd" if cache_layout == "BGLD" else "bsgd"
    G = k_cache.shape[1 if cache_layout == "BGLD" else 2]
    s = jnp.einsum(
        f"bgrd,{layout}->bgrs",
        q.reshape(B, G, H // G, D),
        k_cache,
        preferred_element_type=_acc(q.dtype),
        precision=_precision(q.dtype),
    )
    return s * scale, jnp.arange(s.shape[-1])[None, :] < lengths[:, None]


def decode_select(P, lengths, *, tenths, min_k, k_max, pool_size=1):
    """A decode selection from the pooled probabilities P [B, G, >= L] of rows of ``lengths`` [B]
    valid keys: the keys of each row's budget of pools of largest summed P among its whole pools,
    ascending, then -1: indices [B, G, k_max] int32."""
    pools = decode_select_pools(
        pool_scores(P, pool_size), lengths, tenths=tenths, min_k=min_k, k_max=k_max, pool_size=pool_size
    )
    return pool_keys(pools, pool_size)


def decode_select_pools(scores, lengths, *, tenths, min_k, k_max, pool_size):
    """:func:`decode_select` from the scores of whole pools [B, G, >= L // P]: the selected pools
    [B, G, k_max / P] int32 (ids ascending, then -1)."""
    candidate = jnp.arange(scores.shape[-1])[None, :] < (lengths // pool_size)[:, None]  # [B, pools]
    scores = jnp.where(candidate[:, None], scores, -jnp.inf)
    keep = pool_count(lengths, tenths, min_k, pool_size)[:, None]
    return (threshold_top if pool_size > 1 else top)(scores, k_max // pool_size, keep)


def kascade_anchor_decode_xla(
    q, k_cache, v_cache, lengths, *, tenths, min_k, k_max, pool_size, scale, dense_output, cache_layout, cfg
):
    """See :func:`kdax.kascade_anchor_decode`. Returns (indices [B, G, k_max] int32, o [B, H, D])."""
    acc, prec = _acc(q.dtype), _precision(q.dtype)
    s, valid = _decode_scores(q, k_cache, lengths, scale, cache_layout)
    p = masked_softmax(s, valid[:, None, None])
    idx = decode_select(p.sum(axis=2), lengths, tenths=tenths, min_k=min_k, k_max=k_max, pool_size=pool_size)
    if dense_output:
        layout = "bgsd" if cache_layout == "BGLD" else "bsgd"
        o = jnp.einsum(f"bgrs,{layout}->bgrd", p, v_cache.astype(acc), precision=prec)
        return idx, o.reshape(q.shape).astype(q.dtype)
    options = {"pool_size": pool_size, "scale": scale, "cache_layout": cache_layout, "cfg": cfg}
    return idx, kascade_reuse_decode_xla(q, k_cache, v_cache, lengths, idx, **options)


def kascade_reuse_decode_xla(q, k_cache, v_cache, lengths, indices, *, pool_size, scale, cache_layout, cfg):
    """See :func:`kdax.kascade_reuse_decode`. indices [B, G, k] already remapped. Returns o [B, H, D]."""
    B, H, D = q.shape
    kt, vt = (_heads_first(x, cache_layout) for x in (k_cache, v_cache))  # [B, G, L, D]
    G = kt.shape[1]
    indices = with_decode_tail(indices, lengths, pool_size)
    acc, prec = _acc(q.dtype), _precision(q.dtype)
    ks, vs = (_gather(x, indices[:, :, None])[:, :, 0] for x in (kt, vt))  # [B, G, k, D]
    s = jnp.einsum("bgrd,bgkd->bgrk", q.reshape(B, G, H // G, D), ks, preferred_element_type=acc, precision=prec)
    s = s * scale
    allowed = (indices >= 0) & (indices < lengths[:, None, None])
    o = jnp.einsum("bgrk,bgkd->bgrd", masked_softmax(s, allowed[:, :, None]), vs.astype(acc), precision=prec)
    return o.reshape(B, H, D).astype(q.dtype)


def _query_blocks(T: int, per_query: int, cfg: Config) -> tuple[int, int]:
    """(queries a block, blocks) so one block's intermediates take at most ``cfg.block_bytes``."""
    nb = max(1, min(T, cfg.block_bytes // max(1, per_query)))
    return nb, -(-T // nb)


def _by_query_blocks(fn, T: int, nb: int, NB: int, *arrays):
    """fn over blocks of ``nb`` queries of each [B, T, ...] array (padded to NB * nb; lax.map),
    its [B, nb, ...] results put back together as [B, T, ...]."""
    pad = lambda x: jnp.pad(x, [(0, 0), (0, NB * nb - T)] + [(0, 0)] * (x.ndim - 2))
    blocks = [jnp.moveaxis(pad(x).reshape(x.shape[0], NB, nb, *x.shape[2:]), 1, 0) for x in arrays]
    out = lax.map(lambda b: fn(*b), tuple(blocks))
    return jnp.moveaxis(out, 0, 1).reshape(out.shape[1], NB * nb, *out.shape[3:])[:, :T]


def select_index_pools(scores, q_positions, lengths, *, topk: int, kpool: int):
    """DSA's pools from the index scores [B, T, NP] float32 of queries at ``q_positions`` [B, T] in
    rows of ``lengths`` [B, T] valid keys: each query's ``topk / kpool`` best whole pools whose last
    key it sees (ties toward the smaller pool), as their keys [B, T, topk] ascending, then -1."""
    k_max, NP = topk // kpool, scores.shape[-1]
    width = max(NP, k_max)
    scores = jnp.pad(scores, ((0, 0), (0, 0), (0, width - NP)))
    ends = (jnp.arange(width) + 1) * kpool - 1
    ok = (q_positions >= 0) & (q_positions < lengths)
    candidate = (ends <= q_positions[..., None]) & (ends < lengths[..., None]) & ok[..., None]
    keep = jnp.minimum(candidate.sum(-1), k_max)
    return pool_keys(top(jnp.where(candidate, scores, -jnp.inf), k_max, keep), kpool)


def index_select_xla(q, weights, keys, gates, ape, q_positions, lengths, key_rows, *, topk, kpool, tail, scale, cfg):
    """See :func:`kdax.index_select`: the pools' keys once, then blocks of queries' float32 scores
    (each query against its row's pools) and ``lax.top_k`` (ties toward the smaller pool). Returns
    indices [B, T, W] int32."""
    B, T, Hi, _ = q.shape
    acc, prec = _acc(q.dtype), _precision(q.dtype)
    pooled = pooled_index_keys(keys, gates, ape, kpool).astype(acc)  # [B, NP, d]
    NP = pooled.shape[1]
    own = keys.shape[0] == B and key_rows is None  # each query its own row: no gather of the pools

    def block(qb, wb, pb, rb):
        if own:
            s = jnp.einsum("bthd,bpd->bthp", qb.astype(acc), pooled, precision=prec)
        else:
            s = jnp.einsum("bthd,btpd->bthp", qb.astype(acc), pooled[rb], precision=prec)
        scores = jnp.einsum("bth,bthp->btp", wb.astype(acc), jnp.maximum(s * scale, 0), precision=prec)
        return select_index_pools(scores, pb, lengths[rb], topk=topk, kpool=kpool)

    rows = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, T)) if key_rows is None else key_rows
    width = max(NP, topk // kpool)
    per_query = 4 * B * ((Hi + 1) * width + (0 if own else NP * q.shape[-1]))
    nb, NB = _query_blocks(T, per_query, cfg)
    indices = _by_query_blocks(block, T, nb, NB, q, weights, q_positions, rows)
    if tail and kpool > 1:
        indices = jnp.concatenate([indices, index_tail(q_positions, lengths[rows], kpool)], -1)
    return indices


def indexed_attention_xla(q, k, v, indices, lengths, *, scale, cfg):
    """See :func:`kdax.indexed_attention`: blocks of queries gather their listed keys and values
    (shared by the heads) and attend them, in float32. Returns o [B, T, H, Dv] in q's dtype."""
    B, T, H, D = q.shape
    G, Dv, W = k.shape[2], v.shape[3], indices.shape[2]
    acc, prec = _acc(q.dtype), _precision(q.dtype)

    def block(qb, ib):
        n = qb.shape[1]
        take = lambda x: jnp.take_along_axis(x, jnp.maximum(ib, 0).reshape(B, n * W, 1, 1), axis=1)
        ks, vs = (take(x).reshape(B, n, W, G, x.shape[-1]) for x in (k, v))
        qg = qb.reshape(B, n, G, H // G, D)
        s = jnp.einsum("btgrd,btwgd->btgrw", qg, ks, preferred_element_type=acc, precision=prec) * scale
        allowed = ((ib >= 0) & (ib < lengths[:, None, None]))[:, :, None, None]
        o = jnp.einsum("btgrw,btwgd->btgrd", masked_softmax(s, allowed), vs.astype(acc), precision=prec)
        return o.reshape(B, n, H, Dv).astype(q.dtype)

    nb, NB = _query_blocks(T, 4 * B * W * (G * (D + Dv) + H), cfg)
    return _by_query_blocks(block, T, nb, NB, q, indices)


CAPABILITIES = Capabilities(
    "xla",
    config=Config,
    cores={
        "anchor": kascade_anchor_xla,
        "reuse": kascade_reuse_xla,
        "anchor_decode": kascade_anchor_decode_xla,
        "reuse_decode": kascade_reuse_decode_xla,
        "index_select": index_select_xla,
        "indexed_attention": indexed_attention_xla,
    },
    portable=True,
)
