"""Public Kascade entry points: argument checks, backend dispatch, compiled calls."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kdax.ops.common.dispatch import BACKENDS, OpBackends, register
from kdax.ops.common.sharding import per_shard
from kdax.ops.common.validation import fail
from kdax.ops.kascade import pallas_gpu, pallas_tpu, reference, xla
from kdax.ops.kascade.capabilities import Capabilities
from kdax.ops.kascade.checks import (
    POOL_SIZE,
    TILE_SIZE,
    check_call,
    check_index_call,
    check_indexed_call,
    decode_k_max,
    prefill_k_max,
    row_lengths,
)

RECORDS: dict[str, Capabilities] = {
    c.name: c for c in (xla.CAPABILITIES, pallas_tpu.CAPABILITIES, pallas_gpu.CAPABILITIES, reference.CAPABILITIES)
}  # every backend's capabilities, by name
CONFIGS = {name: c.config for name, c in RECORDS.items() if c.config}  # per-call configs
Config = xla.Config | pallas_tpu.Config | pallas_gpu.Config


def _refuse(kernels, dtype, config, asked, **_) -> str | None:
    """Why these kernels do not take the inputs (None: they do); see OpBackends.refuse."""
    refuse = RECORDS[kernels].refuse
    return refuse(asked) if refuse else None


def _backends(op: str) -> OpBackends:
    """``op``'s backends: those whose record has its core."""
    cores = tuple(name for name, c in RECORDS.items() if op in c.cores)
    return register(
        OpBackends(f"kascade_{op}" if op in _KASCADE else op, cores, {n: CONFIGS[n] for n in cores}, _refuse)
    )


_KASCADE = ("anchor", "reuse", "anchor_decode", "reuse_decode")
_OPS = {f"kascade_{op}": _backends(op) for op in _KASCADE}


_BTHD, _BHD, _BG = ("batch", None, "heads", None), ("batch", "heads", None), ("batch", "heads", None, None)
# per op: the roles of (q, k, v, lengths[, indices]) and of the outputs (see kdax.ops.common.sharding)
_ROLES = {
    "anchor": ((_BTHD, _BTHD, _BTHD, ("batch",)), (_BG, _BTHD)),
    "reuse": ((_BTHD, _BTHD, _BTHD, ("batch",), _BG), _BTHD),
    "anchor_decode": ((_BHD, _BTHD, _BTHD, ("batch",)), (_BHD, _BHD)),
    "reuse_decode": ((_BHD, _BTHD, _BTHD, ("batch",), _BHD), _BHD),
}


def _core(op: str, backend: str, auto: bool = False, cache_layout: str = "BLGD"):
    """The backend's core of ``op``, run per shard of the batch and head axes (where the inputs' types
    shard them): ``core(q, k, v, lengths[, indices], **options)``. ``auto``: the backend is "auto"'s
    choice, so a derivative of forward-only kernels is taken through xla's core rather than refused.
    ``cache_layout``: the decode caches' ("BGLD": heads before keys)."""
    caps = RECORDS[backend]
    core = caps.cores[op]
    if caps.forward_only:
        fallback = xla.CAPABILITIES.cores[op] if auto else None
        core = functools.partial(_forward_only, core, f"kascade_{op} ({backend})", fallback)
    roles, outs = _ROLES[op]
    if cache_layout == "BGLD":
        roles = (roles[0], _BG, _BG, *roles[3:])
    return lambda *arrays, **options: per_shard(functools.partial(core, **options), arrays, roles, outs)


def _forward_only(core, name, xla_core, *args, **static):
    """``core(*args, **static)``; differentiated, ``xla_core``'s value and derivative (the same op,
    portable), or with ``xla_core`` None a clear error (the kernels have no backward)."""
    run = jax.custom_jvp(lambda *a: core(*a, **static))

    @run.defjvp
    def _(primals, tangents):
        if xla_core is not None:
            return jax.jvp(lambda *a: xla_core(*a, **(static | {"cfg": xla.Config()})), primals, tangents)
        raise NotImplementedError(f"{name}: the Pallas kernels are forward-only; differentiate with backend='xla'")

    return run(*args)


def _check_common(backend, dense_output=False, dtype=None):
    if backend not in BACKENDS:
        fail("backend", f"one of {BACKENDS}", repr(backend))
    if (caps := RECORDS.get(backend)) and not caps.portable and dtype == jnp.float64:
        fail("q", f"float32 or bfloat16 inputs with backend={backend!r} (the kernels have no float64)", "float64")
    if not isinstance(dense_output, (bool, np.bool_)):
        fail("dense_output", "a bool", f"{type(dense_output).__name__} {dense_output!r}")


def _scale(q, scale) -> float:
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


@dataclasses.dataclass(frozen=True)
class Options:
    """A call's static options, checked (the compiled call's static argument): the resolved backend
    and its config, the scale, and as the op uses them the tile size, the pool size, the budget
    (top-k in tenths of a percent, the least keys) and dense_output."""

    backend: str
    config: Config | None
    scale: float
    auto: bool = False  # backend is "auto"'s choice (:func:`_core`)
    tile_size: int = 32
    pool_size: int = 1
    tenths: int = 100
    min_k: int = 0
    dense_output: bool = False
    cache_layout: str = "BLGD"


@functools.partial(jax.jit, static_argnums=(0, 1))
def _compiled(op: str, o: Options, q, k, v, lengths, indices=None, head_map=None):
    """Kascade ``op`` ("anchor", "reuse", "anchor_decode", "reuse_decode") on ``o.backend``."""
    decode, anchor = op.endswith("decode"), op.startswith("anchor")
    pools = {"pool_size": o.pool_size}
    if RECORDS[o.backend].reference:
        if o.cache_layout == "BGLD":  # the references read the default layout
            k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)
        budget = {"topk_percent": o.tenths / 10, "min_k": o.min_k, "dense_output": o.dense_output} | pools
        tiles = {"tile_size": o.tile_size, "scale": o.scale, "lengths": lengths}
        if op == "anchor":
            return reference.naive_kascade_anchor(q, k, v, **budget, **tiles)
        if op == "reuse":
            return reference.naive_kascade_reuse(q, k, v, indices, head_map=head_map, **pools, **tiles)
        if op == "anchor_decode":
            return reference.naive_kascade_anchor_decode(q, k, v, lengths, **budget, scale=o.scale)
        return reference.naive_kascade_reuse_decode(
            q, k, v, lengths, indices, head_map=head_map, **pools, scale=o.scale
        )
    layout = {"cache_layout": o.cache_layout} if decode else {"tile_size": o.tile_size}
    options = {"scale": o.scale, "cfg": o.config} | pools | layout
    core = _core(op, o.backend, o.auto, o.cache_layout)
    if not anchor:
        return core(q, k, v, lengths, _remapped(indices, head_map), **options)
    if decode:
        k_max = decode_k_max(k.shape[2 if o.cache_layout == "BGLD" else 1], o.tenths, o.min_k, o.pool_size)
    else:
        k_max = prefill_k_max(q.shape[1], o.tile_size, o.tenths, o.min_k, o.pool_size)
    options |= {"tenths": o.tenths, "min_k": o.min_k, "k_max": k_max, "dense_output": o.dense_output}
    return core(q, k, v, lengths, **options)


def kascade_anchor(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    topk_percent: float = 10,
    min_k: int = 128,
    tile_size: int = TILE_SIZE,
    pool_size: int = POOL_SIZE,
    scale: float | None = None,
    dense_output: bool = False,
    lengths: jax.Array | None = None,
    backend: str = "auto",
    config: Config | None = None,
) -> tuple[jax.Array, jax.Array]:
    """A Kascade anchor layer (prefill): exact attention picks each query tile's top-k keys.

    Query tile t (queries s_t = t * tile_size onward) pools the exact causal softmax
    probabilities of its queries and of the H/G query heads of each KV head over the keys
    j < s_t, and keeps the k_t = min(s_t, max(min_k, floor(topk_percent * s_t / 100))) largest
    (ties toward the smaller index). With ``pool_size`` P > 1 it keeps whole pools of P keys
    (pP .. pP + P - 1) instead: those of largest summed score among the whole pools before the
    tile's pool boundary b_t = floor(s_t / P) P, k_t rounded down to whole pools; the keys from b_t
    on are the tile's own block. Compiled once per shape and static option.

    Args:
        q: [B, T, H, D]; k, v: [B, T, G, D], G dividing H (query head h reads KV head h // (H / G)).
        topk_percent: the share of the keys before a tile that it keeps, in (0, 100], one decimal at most.
        min_k: the least budget of a tile (capped at s_t).
        tile_size: queries per tile: 16, 32, 64 or 128.
        pool_size: keys per selected unit: 1 (tokens), 16, 32, 64, 128 or 256 (key blocks).
        scale: the scores' scale, D ** -0.5 when None.
        dense_output: return dense causal attention (a schedule's layer 0) instead of the sparse output.
        lengths: [B] ints (an array or a list), valid tokens of right-padded rows (None: all T;
            traced ones, unchecked, are clipped to [0, T]); outputs past them are 0
            and tiles starting at or past them select nothing.
        backend: "auto", "xla", "pallas_tpu", "pallas_gpu" (forward-only kernels: asked for by name
            they refuse a derivative; picked by "auto", xla's is taken) or "naive" (the dense
            reference); :func:`kdax.explain_backend` says what "auto" picks.
        config: the backend's config (:class:`kdax.ops.kascade.xla.Config`,
            :class:`kdax.ops.kascade.pallas_tpu.Config`, :class:`kdax.ops.kascade.pallas_gpu.Config`),
            None for its default.

    Returns:
        (indices, o): indices [B, G, ceil(T / tile_size), k_max] int32, each row its selected keys
        ascending then -1, k_max the last tile's; o [B, T, H, D] in q's dtype: attention of each
        query over its tile's selection and its tile's own causal block (or dense).

    Raises:
        ValueError: a bad argument, named, with what was expected and what came.
        NotImplementedError: a backend this op lacks.
    """
    _check_common(backend, dense_output, q.dtype)
    tenths, _ = check_call(
        q, k, v, lengths, topk_percent=topk_percent, min_k=min_k, tile_size=tile_size, scale=scale, pool_size=pool_size
    )
    B, T = q.shape[:2]
    auto = backend == "auto"
    backend, config = _OPS["kascade_anchor"].resolve(backend, q.dtype, config)
    budget = {"tenths": tenths, "min_k": int(min_k), "dense_output": bool(dense_output)}
    o = Options(backend, config, _scale(q, scale), auto, tile_size=tile_size, pool_size=pool_size, **budget)
    return _compiled("anchor", o, q, k, v, row_lengths(lengths, B, T))


def kascade_reuse(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    indices: jax.Array,
    *,
    head_map: jax.Array | None = None,
    tile_size: int = TILE_SIZE,
    pool_size: int = POOL_SIZE,
    scale: float | None = None,
    lengths: jax.Array | None = None,
    backend: str = "auto",
    config: Config | None = None,
) -> jax.Array:
    """A Kascade reuse layer (prefill): attend an anchor's selection, remapped per KV head.

    Query i of tile t, head h of KV head g, attends the keys indices[b, head_map[g], t] (those
    before s_t) and its tile's own causal block b_t <= j <= i (b_t = floor(s_t / P) P, s_t with
    pool_size 1). Compiled once per shape and static option.

    Args:
        q: [B, T, H, D]; k, v: [B, T, G, D].
        indices: [B, G, ceil(T / tile_size), k] int, an anchor's selection of the same tiles
            (distinct keys per row, -1 for none; whole pools of ``pool_size`` keys).
        head_map: [G] ints (an array or a list), KV head g reads the anchor's KV head head_map[g];
            None: the identity.
        tile_size, pool_size, scale, lengths, backend, config: as :func:`kascade_anchor` (the
            anchor's tile_size and pool_size).

    Returns:
        o [B, T, H, D] in q's dtype, 0 past a row's length.

    Raises:
        ValueError: a bad argument, named, with what was expected and what came.
        NotImplementedError: a backend this op lacks.
    """
    _check_common(backend, dtype=q.dtype)
    _, head_map = check_call(
        q, k, v, lengths, indices=indices, head_map=head_map, tile_size=tile_size, scale=scale, pool_size=pool_size
    )
    B, T, _, _ = q.shape
    auto = backend == "auto"
    backend, config = _OPS["kascade_reuse"].resolve(backend, q.dtype, config)
    o = Options(backend, config, _scale(q, scale), auto, tile_size=tile_size, pool_size=pool_size)
    return _compiled("reuse", o, q, k, v, row_lengths(lengths, B, T), jnp.asarray(indices, jnp.int32), head_map)


def kascade_anchor_decode(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    topk_percent: float = 10,
    min_k: int = 128,
    pool_size: int = POOL_SIZE,
    scale: float | None = None,
    dense_output: bool = False,
    cache_layout: str = "BLGD",
    backend: str = "auto",
    config: Config | None = None,
) -> tuple[jax.Array, jax.Array]:
    """A Kascade anchor layer, one decode step: exact attention of the new token picks the top-k keys.

    The score of key j < lengths[b] pools the softmax probabilities of the KV head's H/G query
    heads; the budget is k_b = min(len_b, max(min_k, floor(topk_percent * len_b / 100))). With
    ``pool_size`` P > 1 it picks whole pools among the len_b // P whole pools of the row (k_b
    rounded down to whole pools), and the row's last, partial pool is always attended.

    Args:
        q: [B, H, D], the new token's queries.
        k_cache, v_cache: [B, L, G, D], the new token's keys and values already stored; [B, G, L, D]
            with ``cache_layout="BGLD"``.
        lengths: [B] ints, valid keys per row (the new token's included).
        topk_percent, min_k, pool_size, scale, backend, config: as :func:`kascade_anchor`.
        dense_output: return dense attention over the valid keys instead of the sparse output.
        cache_layout: "BLGD" (flash attention's) or "BGLD" (heads before keys, as TPU paged
            attention keeps its pages: a head's keys contiguous, so the TPU kernels read a selected
            pool of one head with one copy).

    Returns:
        (indices [B, G, k_max] int32, ascending then -1, k_max the budget of L keys;
        o [B, H, D] in q's dtype, attention over the selection only (or dense); 0 in an empty row).

    Raises:
        ValueError: a bad argument, named, with what was expected and what came.
        NotImplementedError: a backend this op lacks.
    """
    _check_common(backend, dense_output, q.dtype)
    options = {"topk_percent": topk_percent, "min_k": min_k, "scale": scale, "pool_size": pool_size}
    tenths, _ = check_call(q, *_logical(k_cache, v_cache, cache_layout), lengths, decode=True, **options)
    auto = backend == "auto"
    backend, config = _OPS["kascade_anchor_decode"].resolve(backend, q.dtype, config, cache_layout=cache_layout)
    budget = {"tenths": tenths, "min_k": int(min_k), "dense_output": bool(dense_output), "pool_size": pool_size}
    o = Options(backend, config, _scale(q, scale), auto, cache_layout=cache_layout, **budget)
    lengths = row_lengths(lengths, q.shape[0], _logical(k_cache, v_cache, cache_layout)[0].shape[1])
    return _compiled("anchor_decode", o, q, k_cache, v_cache, lengths)


def kascade_reuse_decode(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    indices: jax.Array,
    *,
    head_map: jax.Array | None = None,
    pool_size: int = POOL_SIZE,
    scale: float | None = None,
    cache_layout: str = "BLGD",
    backend: str = "auto",
    config: Config | None = None,
) -> jax.Array:
    """A Kascade reuse layer, one decode step: attend an anchor's selection only (and with pools the
    row's last, partial pool), remapped per KV head.

    Args:
        q: [B, H, D]; k_cache, v_cache: [B, L, G, D] ([B, G, L, D] with ``cache_layout="BGLD"``);
            lengths: [B] ints.
        indices: [B, G, k] int, an anchor's decode selection (distinct keys, -1 for none).
        head_map, pool_size, scale, backend, config: as :func:`kascade_reuse`.
        cache_layout: as :func:`kascade_anchor_decode`.

    Returns:
        o [B, H, D] in q's dtype (0 in a row with nothing selected).

    Raises:
        ValueError: a bad argument, named, with what was expected and what came.
        NotImplementedError: a backend this op lacks.
    """
    _check_common(backend, dtype=q.dtype)
    caches = _logical(k_cache, v_cache, cache_layout)
    _, head_map = check_call(
        q, *caches, lengths, decode=True, indices=indices, head_map=head_map, scale=scale, pool_size=pool_size
    )
    auto = backend == "auto"
    backend, config = _OPS["kascade_reuse_decode"].resolve(backend, q.dtype, config, cache_layout=cache_layout)
    lengths = row_lengths(lengths, q.shape[0], caches[0].shape[1])
    o = Options(backend, config, _scale(q, scale), auto, pool_size=pool_size, cache_layout=cache_layout)
    return _compiled("reuse_decode", o, q, k_cache, v_cache, lengths, jnp.asarray(indices, jnp.int32), head_map)


# DSA (GLM-5.3's indexed attention): the indexer's selection and the attention over it
_DSA = {op: _backends(op) for op in ("index_select", "indexed_attention")}


def index_select(
    q: jax.Array,
    weights: jax.Array,
    keys: jax.Array,
    gates: jax.Array,
    ape: jax.Array,
    *,
    topk: int,
    kpool: int,
    tail: bool = True,
    scale: float | None = None,
    q_positions: jax.Array | None = None,
    lengths: jax.Array | None = None,
    key_rows: jax.Array | None = None,
    backend: str = "auto",
    config: xla.Config | None = None,
) -> jax.Array:
    """DSA's lightning-indexer selection (GLM-5.3's indexed attention), Kascade's selection by a
    learned scorer: each query's ``topk / kpool`` pools of largest index score among the whole
    pools whose last key it sees, then its own incomplete pool.

    Pool p holds keys p kpool .. (p + 1) kpool - 1; its key is a per-channel softmax over the
    pool's keys of ``gates + ape`` weighting ``keys``. Query t at position q_t scores it
    ``sum_h weights[t, h] relu(scale q[t, h] . pool_p)`` (float32), among the pools with
    (p + 1) kpool - 1 <= q_t and (p + 1) kpool <= the row's length. ReLU makes exact ties
    common; they go to the smaller pool (transformers' ``torch.topk`` leaves their order open).
    Not differentiable (the indices are integers). Compiled once per shape and static option.

    Args:
        q: [B, T, Hi, d] the index queries.
        weights: [B, T, Hi] the heads' weights.
        keys, gates: [B, S, d] each key's index key and pooling logits (S >= T: a cache); with
            ``key_rows``, [Bk, S, d] of any Bk.
        ape: [kpool, d] the pooling logits' bias per position in a pool.
        topk: the keys selected in whole pools, a positive multiple of ``kpool``.
        kpool: keys per pool.
        tail: append each query's incomplete pool, keys q_t + 1 - (q_t + 1) % kpool .. q_t.
        scale: d ** -0.5 when None.
        q_positions: [B, T] int, the queries' positions among the keys (default 0..T-1); a
            query at or past its row's length, or negative, selects nothing.
        lengths: [Bk] int, the valid keys of each row of keys (default S).
        key_rows: [B, T] int, the row of keys each query reads (default its own row): the
            requests of a serving step's flat batch over their rows of keys (not with pallas_tpu).
        backend: "auto", "xla", "naive" (the float64-capable reference) or "pallas_tpu" (the
            scores on the MXU, the selection in XLA).
        config: the backend's config (:class:`kdax.ops.kascade.xla.Config`,
            :class:`kdax.ops.kascade.pallas_tpu.Config`), or None.

    Returns:
        indices [B, T, topk + (kpool - 1 if tail else 0)] int32: the selected pools' keys
        ascending (-1 in unfilled slots), then the tail's (-1 for none).

    Raises:
        ValueError: a bad argument, named, with what was expected and what came.
        NotImplementedError: a backend this op lacks.
    """
    _check_common(backend, dtype=q.dtype)
    options = {"topk": topk, "kpool": kpool, "scale": scale}
    rows = key_rows
    q_positions, lengths, key_rows = check_index_call(
        q, weights, keys, gates, ape, q_positions, lengths, **options, key_rows=key_rows
    )
    backend, config = _DSA["index_select"].resolve(backend, q.dtype, config)
    o = (backend, config, int(topk), int(kpool), bool(tail), q.shape[-1] ** -0.5 if scale is None else float(scale))
    return _index_select(o, q, weights, keys, gates, ape, q_positions, lengths, None if rows is None else key_rows)


@functools.partial(jax.jit, static_argnums=0)
def _index_select(o, q, weights, keys, gates, ape, q_positions, lengths, key_rows):
    backend, config, topk, kpool, tail, scale = o
    args = (q, weights, keys, gates, ape)
    options = {"topk": topk, "kpool": kpool, "tail": tail, "scale": scale}
    caps = RECORDS[backend]
    if caps.reference:
        return reference.naive_index_select(
            *args, **options, q_positions=q_positions, lengths=lengths, key_rows=key_rows
        )
    return caps.cores["index_select"](*args, q_positions, lengths, key_rows, **options, cfg=config)


def indexed_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    indices: jax.Array,
    *,
    scale: float | None = None,
    lengths: jax.Array | None = None,
    backend: str = "auto",
    config: xla.Config | None = None,
) -> jax.Array:
    """Attention of each query over the keys its row of ``indices`` lists, as :func:`index_select`
    gives them (DSA's sparse attention; prefill and decode alike: decode is T = 1 over a cache).
    Scores, softmax and accumulation in float32. Differentiable in q, k and v.

    Args:
        q: [B, T, H, D]; k: [B, S, G, D]; v: [B, S, G, Dv], H % G == 0 (MLA's absorbed form: G = 1,
            k = v = the latents).
        indices: [B, T, W] int, distinct keys per query shared by its heads, -1 for none.
        scale: D ** -0.5 when None.
        lengths: [B] int, the valid keys of each row (default S); listed keys past it are skipped.
        backend: "auto", "xla", "naive" (the float64-capable reference) or "pallas_tpu" (v of k's
            shape; forward-only: derivatives through xla's core).
        config: the backend's config (:class:`kdax.ops.kascade.xla.Config`,
            :class:`kdax.ops.kascade.pallas_tpu.Config`), or None.

    Returns:
        o [B, T, H, Dv] in q's dtype, 0 for a query with no key.

    Raises:
        ValueError: a bad argument, named, with what was expected and what came.
        NotImplementedError: a backend this op lacks.
    """
    _check_common(backend, dtype=q.dtype)
    lengths = check_indexed_call(q, k, v, indices, lengths)
    backend, config = _DSA["indexed_attention"].resolve(backend, q.dtype, config)
    if RECORDS[backend].kv_as_one and v.shape != k.shape:
        fail("v", f"k's shape {tuple(k.shape)} with backend={backend!r} (the decode kernel's caches)", v.shape)
    o = (backend, config, q.shape[-1] ** -0.5 if scale is None else float(scale), v is k)
    return _indexed_attention(o, q, k, v, jnp.asarray(indices, jnp.int32), lengths)


@functools.partial(jax.jit, static_argnums=0)
def _indexed_attention(o, q, k, v, indices, lengths):
    backend, config, scale, shared = o
    caps = RECORDS[backend]
    if caps.reference:
        return reference.naive_indexed_attention(q, k, v, indices, scale=scale, lengths=lengths)
    args, static = (q, k, v, indices, lengths), {"scale": scale, "cfg": config}
    core = caps.cores["indexed_attention"]
    if caps.kv_as_one:
        core = functools.partial(core, shared=shared)
    if caps.forward_only:  # derivatives through xla's core (the same op)
        name, xla_core = f"indexed_attention ({backend})", xla.CAPABILITIES.cores["indexed_attention"]
        return _forward_only(core, name, xla_core, *args, **static)
    return core(*args, **static)


CACHE_LAYOUTS = ("BLGD", "BGLD")


def _logical(k_cache, v_cache, cache_layout):
    """The caches as the checks read them, [B, L, G, D] (shapes and dtypes only).

    Raises:
        ValueError: ``cache_layout`` is not one of :data:`CACHE_LAYOUTS`.
    """
    if cache_layout not in CACHE_LAYOUTS:
        fail("cache_layout", f"one of {CACHE_LAYOUTS}", repr(cache_layout))
    if cache_layout == "BLGD" or getattr(k_cache, "ndim", 0) != 4:
        return k_cache, v_cache
    swap = lambda x: (
        jax.ShapeDtypeStruct((x.shape[0], x.shape[2], x.shape[1], *x.shape[3:]), x.dtype)
        if getattr(x, "ndim", 0) == 4
        else x
    )
    return swap(k_cache), swap(v_cache)


def _remapped(indices, head_map):
    """indices [B, G, ...] with KV head g taking the anchor's head_map[g] (None: as they are; a
    selection sharded over heads is gathered over them first: the map may take another device's)."""
    if head_map is None:
        return indices
    sharding = jax.typeof(indices).sharding
    if len(sharding.spec) > 1 and sharding.spec[1] is not None:
        spec = (*sharding.spec[:1], None, *sharding.spec[2:])
        indices = jax.reshard(indices, NamedSharding(sharding.mesh, P(*spec)))
    return jnp.take(indices, head_map, axis=1)
