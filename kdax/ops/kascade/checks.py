"""What every Kascade entry point checks, the references' included, and the key budgets and pools they share."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from kdax.ops.common.validation import check_array, check_traced, fail

TILE_SIZES = (16, 32, 64, 128)
POOL_SIZES = (1, 16, 32, 64, 128, 256)  # keys per selected unit: 1 selects tokens, more select key blocks
# The ops' defaults, by measurement (docs/kascade.md, "Block selection"): query tiles of 128 choosing
# pools of 128 keys kept the quality study's perplexity of tiles of 32 choosing tokens, and they are
# what the TPU kernels run fastest (a tile's rows fill the MXU, a pool is one copy).
TILE_SIZE, POOL_SIZE = 128, 128


def percent_tenths(topk_percent) -> int:
    """``topk_percent`` in tenths of a percent, so budgets are computed exactly in integers.

    Raises:
        ValueError: ``topk_percent`` is not a number in (0, 100] with at most one decimal.
    """
    if isinstance(topk_percent, bool) or not isinstance(topk_percent, (int, float, np.integer, np.floating)):
        fail("topk_percent", "a number in (0, 100]", type(topk_percent).__name__)
    tenths = round(float(topk_percent) * 10)
    if not 0 < topk_percent <= 100 or abs(float(topk_percent) * 10 - tenths) > 1e-6:
        fail("topk_percent", "a number in (0, 100] with at most one decimal (e.g. 10 or 12.5)", repr(topk_percent))
    return tenths


def budget(n, tenths: int, min_k: int):
    """The top-k budget over ``n`` candidate keys: ``min(n, max(min_k, floor(topk_percent * n / 100)))``.

    Exact in integer arithmetic for NumPy and jax ints alike (no overflow below 2**31 keys).

    Args:
        n: int or int array, the candidate keys (a tile's start s_t, or a row's length).
        tenths: :func:`percent_tenths` of topk_percent.
        min_k: the least budget.

    Returns:
        The budget, of n's type.
    """
    share = (n // 1000) * tenths + (n % 1000) * tenths // 1000
    xp = jnp if isinstance(n, jax.Array) else np
    return xp.minimum(n, xp.maximum(min_k, share))


def pool_count(n, tenths: int, min_k: int, pool_size: int = 1):
    """The pools of ``pool_size`` keys selected over ``n`` candidate keys: the whole pools among
    them, at most the budget rounded down to whole pools, ``min(n // P, budget(n) // P)``. With
    pool_size 1 this is :func:`budget` (keys).

    Args:
        n: int or int array: a tile's start s_t, or a decode row's length (the keys before the
            tile, or the valid keys).
        tenths, min_k: as :func:`budget`.
        pool_size: keys per pool P.

    Returns:
        The count, of n's type.
    """
    xp = jnp if isinstance(n, jax.Array) else np
    return xp.minimum(n // pool_size, budget(n, tenths, min_k) // pool_size)


def pool_scores(P, pool_size: int):
    """Per-key scores P [..., S] summed over each whole pool of ``pool_size`` keys: [..., S // pool_size]."""
    n = P.shape[-1] // pool_size
    return P[..., : n * pool_size].reshape(*P.shape[:-1], n, pool_size).sum(-1)


def pool_keys(pools, pool_size: int):
    """Selected pools [..., n] (ascending, -1 for none) as their keys [..., n * pool_size]."""
    keys = pools[..., None] * pool_size + jnp.arange(pool_size, dtype=pools.dtype)
    return jnp.where(pools[..., None] < 0, -1, keys).reshape(*pools.shape[:-1], -1)


def prefill_k_max(T: int, tile_size: int, tenths: int, min_k: int, pool_size: int = 1) -> int:
    """The static width of prefill indices: the keys the last query tile selects (the most)."""
    return pool_size * int(pool_count(((T - 1) // tile_size) * tile_size, tenths, min_k, pool_size))


def decode_k_max(L: int, tenths: int, min_k: int, pool_size: int = 1) -> int:
    """The static width of decode indices: the keys a full cache of ``L`` keys selects."""
    return pool_size * int(pool_count(L, tenths, min_k, pool_size))


def row_lengths(lengths, B: int, T: int) -> jax.Array:
    """``lengths`` as int32 [B] clipped to [0, T] (traced ones are checked only under
    :func:`kdax.debug_checks`), or all T when None (rows without padding)."""
    if lengths is None:
        return jnp.full((B,), T, jnp.int32)
    if check_traced(lengths):
        ok = jnp.all((lengths >= 0) & (lengths <= T))
        checkify.check(ok, f"lengths: expected ints in [0, {T}], got {{lengths}}", lengths=lengths)
    return jnp.clip(jnp.asarray(lengths, jnp.int32), 0, T)


def check_options(topk_percent=10, min_k=128, tile_size=32, scale=None, pool_size=1) -> int:
    """Check the static options; return :func:`percent_tenths` of ``topk_percent``.

    Raises:
        ValueError: naming the first bad option.
    """
    tenths = percent_tenths(topk_percent)
    if isinstance(min_k, bool) or not isinstance(min_k, (int, np.integer)) or min_k < 0:
        fail("min_k", "a non-negative int", repr(min_k))
    if tile_size not in TILE_SIZES:
        fail("tile_size", f"one of {TILE_SIZES}", repr(tile_size))
    if isinstance(pool_size, bool) or pool_size not in POOL_SIZES:
        fail("pool_size", f"one of {POOL_SIZES}", repr(pool_size))
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating))):
        fail("scale", "a Python float or None", type(scale).__name__)
    return tenths


def check_qkv(q, k, v, decode: bool = False) -> None:
    """Check q [B, T, H, D], k, v [B, T, G, D] (decode: q [B, H, D], caches [B, L, G, D]).

    Raises:
        ValueError: naming the first array that is not as above.
    """
    check_array("q", q, 3 if decode else 4)
    names = ("k_cache", "v_cache") if decode else ("k", "v")
    check_array(names[0], k, 4)
    B, D = q.shape[0], q.shape[-1]
    H = q.shape[-2]
    if B < 1:
        fail("q", "at least one row (B >= 1)", f"shape {tuple(q.shape)}")
    if H < 1:
        fail("q", "at least one head (H >= 1)", f"shape {tuple(q.shape)}")
    if k.shape[0] != B or k.shape[-1] != D or (not decode and k.shape[1] != q.shape[1]):
        want = f"(B={B}, L, G, D={D})" if decode else f"(B={B}, T={q.shape[1]}, G, D={D})"
        fail(names[0], f"shape {want} matching q", f"shape {tuple(k.shape)}")
    check_array(names[1], v, 4, k.shape)
    G = k.shape[2]
    if G < 1 or H % G:
        fail(names[0], f"a number of KV heads G dividing q's heads H={H}", f"G={G}")
    if k.shape[1] < 1:
        fail(names[0] if decode else "q", "at least one token", f"shape {tuple(k.shape)}")
    if D < 1:
        fail("q", "head dim D >= 1", f"D={D}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        fail(f"{names[0]}, {names[1]}", f"the dtype of q ({q.dtype})", f"{k.dtype}, {v.dtype}")


def check_lengths(lengths, B: int, T: int, name: str = "lengths") -> None:
    """Check ``lengths`` [B] ints, an array or a list (values in [0, T] when concrete).

    Raises:
        ValueError: naming ``name``.
    """
    if isinstance(lengths, (list, tuple)):  # accepted as head_map and cu_seqlens are
        lengths = np.asarray(lengths)
    check_array(name, lengths, 1, (B,), integer=True)
    if not _traced(lengths):
        arr = np.asarray(lengths)
        if arr.size and (arr.min() < 0 or arr.max() > T):
            fail(name, f"values in [0, {T}]", f"{arr.tolist()}")


def check_indices(indices, lead: tuple[int, ...], T: int, pool_size: int = 1) -> None:
    """Check a selection: ints of shape ``(*lead, k)``, values in [-1, T) when concrete; with
    ``pool_size`` P > 1, k a multiple of P and (when concrete) every P entries one whole pool
    (P consecutive keys from a multiple of P) or P times -1.

    Raises:
        ValueError: naming ``indices``.
    """
    check_array("indices", indices, len(lead) + 1, integer=True)
    if tuple(indices.shape[:-1]) != tuple(lead) or indices.shape[-1] % pool_size:
        want = (*lead, "k" if pool_size == 1 else f"k, a multiple of pool_size={pool_size}")
        fail("indices", f"shape {want}", f"shape {tuple(indices.shape)}")
    if not _traced(indices):
        arr = np.asarray(indices)
        if arr.size and (arr.min() < -1 or arr.max() >= T):
            got = f"values in [{arr.min()}, {arr.max()}]"
            fail("indices", f"values in [-1, {T}) (key positions, -1 for none)", got)
        pools = arr.reshape(*arr.shape[:-1], -1, pool_size)
        first = pools[..., :1]
        whole = np.where(first < 0, pools == -1, (first % pool_size == 0) & (pools == first + np.arange(pool_size)))
        if pool_size > 1 and arr.size and not whole.all():
            bad = pools[np.nonzero(~whole.all(-1))][0].tolist()
            fail("indices", f"whole pools of {pool_size} keys (an anchor's selection with pool_size={pool_size})", bad)


def check_head_map(head_map, G: int):
    """``head_map`` [G] ints in [0, G) (a list or an array), or None for the identity.

    Returns:
        The head map as an int32 array, or None.

    Raises:
        ValueError: naming ``head_map``.
    """
    if head_map is None:
        return None
    if isinstance(head_map, (list, tuple)):
        head_map = np.asarray(head_map, np.int32)
    check_array("head_map", head_map, 1, (G,), integer=True)
    if not _traced(head_map):
        arr = np.asarray(head_map)
        if arr.size and (arr.min() < 0 or arr.max() >= G):
            fail("head_map", f"values in [0, {G}) (KV heads of the anchor)", f"{arr.tolist()}")
    return jnp.asarray(head_map, jnp.int32)


def _traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def check_call(
    q,
    k,
    v,
    lengths=None,
    *,
    decode=False,
    indices=None,
    head_map=None,
    topk_percent=10,
    min_k=0,
    tile_size=32,
    scale=None,
    pool_size=1,
):
    """Every check of one Kascade call (prefill, or ``decode`` with k, v the caches).

    Args:
        q, k, v, lengths: the arrays (prefill ``lengths`` may be None).
        decode: whether this is a decode step.
        indices, head_map: a reuse call's selection and head map (None for an anchor).
        topk_percent, min_k, tile_size, scale, pool_size: the options.

    Returns:
        (:func:`percent_tenths` of topk_percent, the head map as an array or None).

    Raises:
        ValueError: naming the first bad argument.
    """
    check_qkv(q, k, v, decode)
    tenths = check_options(topk_percent, min_k, tile_size, scale, pool_size)
    B, T = k.shape[:2]
    G = k.shape[2]
    if lengths is not None or decode:
        check_lengths(lengths, B, T)
    if indices is not None:
        check_indices(indices, (B, G) if decode else (B, G, -(-T // tile_size)), T, pool_size)
    return tenths, check_head_map(head_map, G)


def pooled_index_keys(keys, gates, ape, kpool: int):
    """DSA's pooled index keys: each whole pool of ``kpool`` keys from key 0 summarised per channel
    by a softmax over its keys of ``gates + ape`` (in float32, cast to the keys' dtype), weighting
    the keys (summed in their dtype).

    Args:
        keys, gates: [B, S, d] per-token index keys and pooling logits.
        ape: [kpool, d] the pooling logits' bias per position in a pool.
        kpool: keys per pool.

    Returns:
        [B, S // kpool, d] in the keys' dtype.
    """
    B, S, d = keys.shape
    n = S // kpool
    k = keys[:, : n * kpool].reshape(B, n, kpool, d)
    logits = gates[:, : n * kpool].reshape(B, n, kpool, d).astype(jnp.float32) + ape.astype(jnp.float32)
    p = jax.nn.softmax(logits, axis=2).astype(keys.dtype)
    return (p * k).sum(axis=2)


def index_tail(q_positions, lengths, kpool: int):
    """Each query's own incomplete pool: keys (q + 1) - (q + 1) % kpool .. q of the query at
    position q ([B, T] ints, valid below its row's length, ``lengths`` [B, T]), [B, T, kpool - 1]
    int32, -1 for none."""
    q = q_positions[..., None]
    count = (q + 1) % kpool
    tail = q + 1 - count + jnp.arange(kpool - 1, dtype=jnp.int32)
    ok = (jnp.arange(kpool - 1) < count) & (q >= 0) & (q < lengths[..., None])
    return jnp.where(ok, tail, -1).astype(jnp.int32)


def check_index_call(q, weights, keys, gates, ape, q_positions, lengths, *, topk, kpool, scale=None, key_rows=None):
    """Every check of a DSA index selection (:func:`kdax.index_select`).

    Returns:
        (q_positions [B, T] int32, lengths [Bk] int32, key_rows [B, T] int32), defaults filled in
        (0..T-1, all S keys, each query its own row).

    Raises:
        ValueError: naming the first bad argument.
    """
    check_array("q", q, 4)
    B, T, Hi, d = q.shape
    if min(B, T, Hi, d) < 1:
        fail("q", "a [B, T, Hi, d] array with every size >= 1", f"shape {tuple(q.shape)}")
    check_array("weights", weights, 3, (B, T, Hi))
    check_array("keys", keys, 3)
    Bk, S = keys.shape[:2]
    if (key_rows is None and Bk != B) or keys.shape[2] != d or S < 1 or Bk < 1:
        rows = f"B={B}" if key_rows is None else "Bk >= 1"
        fail("keys", f"shape ({rows}, S >= 1, d={d}) matching q", f"shape {tuple(keys.shape)}")
    check_array("gates", gates, 3, keys.shape)
    if isinstance(kpool, bool) or not isinstance(kpool, (int, np.integer)) or kpool < 1:
        fail("kpool", "a positive int", repr(kpool))
    if isinstance(topk, bool) or not isinstance(topk, (int, np.integer)) or topk < kpool or topk % kpool:
        fail("topk", f"a positive multiple of kpool={kpool}", repr(topk))
    check_array("ape", ape, 2, (kpool, d))
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating))):
        fail("scale", "a Python float or None", type(scale).__name__)
    if q_positions is None:
        q_positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    else:
        check_array("q_positions", q_positions, 2, (B, T), integer=True)
    if lengths is not None:
        check_lengths(lengths, Bk, S)
    if key_rows is None:
        key_rows = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, T))
    else:
        check_array("key_rows", key_rows, 2, (B, T), integer=True)
        if not _traced(key_rows):
            arr = np.asarray(key_rows)
            if arr.min() < 0 or arr.max() >= Bk:
                fail("key_rows", f"values in [0, {Bk}) (rows of keys)", f"[{arr.min()}, {arr.max()}]")
    return jnp.asarray(q_positions, jnp.int32), row_lengths(lengths, Bk, S), jnp.asarray(key_rows, jnp.int32)


def check_indexed_call(q, k, v, indices, lengths):
    """Every check of an indexed attention call (:func:`kdax.indexed_attention`).

    Returns:
        lengths [B] int32 (all S keys when None).

    Raises:
        ValueError: naming the first bad argument.
    """
    check_array("q", q, 4)
    B, T, H, D = q.shape
    if min(B, T, H, D) < 1:
        fail("q", "a [B, T, H, D] array with every size >= 1", f"shape {tuple(q.shape)}")
    check_array("k", k, 4)
    S, G = k.shape[1], k.shape[2]
    if k.shape[0] != B or S < 1 or G < 1 or H % G or k.shape[3] != D:
        fail("k", f"shape (B={B}, S >= 1, G dividing H={H}, D={D})", f"shape {tuple(k.shape)}")
    check_array("v", v, 4)
    if v.shape[:3] != k.shape[:3]:
        fail("v", f"shape ({B}, {S}, {G}, Dv) matching k", f"shape {tuple(v.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        fail("k, v", f"the dtype of q ({q.dtype})", f"{k.dtype}, {v.dtype}")
    check_array("indices", indices, 3, integer=True)
    if indices.shape[:2] != (B, T) or indices.shape[2] < 1:
        fail("indices", f"shape ({B}, {T}, W >= 1)", f"shape {tuple(indices.shape)}")
    if not _traced(indices):
        arr = np.asarray(indices)
        if arr.min() < -1 or arr.max() >= S:
            fail("indices", f"values in [-1, {S}) (key positions, -1 for none)", f"[{arr.min()}, {arr.max()}]")
    if lengths is not None:
        check_lengths(lengths, B, S)
    return row_lengths(lengths, B, S)
