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
