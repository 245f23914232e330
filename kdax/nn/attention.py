"""Softmax attention for the hybrid's full-attention layers (FLA's ``Attention``): GQA, RoPE,
causal, optional sliding window, a preallocated KV cache for decoding (a ring buffer of
window_size slots for sliding-window layers)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from kdax.ops.common.sharding import Layout
from kdax.ops.kascade.api import kascade_anchor, kascade_anchor_decode, kascade_reuse, kascade_reuse_decode
from kdax.ops.kascade.schedule import KascadeSchedule


class KascadeStep(NamedTuple):
    """What a softmax layer runs under a Kascade schedule (see :func:`kdax.kascade_anchor`).

    Attributes:
        schedule: the schedule (its topk_percent, min_k, tile_size and pool_size).
        role: "anchor" or "reuse".
        dense_output: an anchor's output is dense attention (the schedule's first layer).
        indices: a reuse layer's anchor selection (prefill [B, G, NT, k], decode [B, G, k]).
        head_map: a reuse layer's head map.
    """

    schedule: KascadeSchedule
    role: str
    dense_output: bool = False
    indices: jax.Array | None = None
    head_map: tuple[int, ...] | None = None


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, halves layout (FLA's non-interleaved default), computed in float32.

    Args:
        x: [B, T, H, D], D even.
        positions: [B, T] ints, each token's position.
        theta: the base of the frequencies ``theta ** (-2i / D)``.

    Returns:
        [B, T, H, D] in x's dtype.
    """
    D = x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D)
    angle = positions.astype(jnp.float32)[..., None, None] * inv_freq  # [B, T, 1, D/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Causal softmax attention with ``num_kv_heads`` shared key/value heads (GQA),
    head_dim = hidden_size // num_heads, RoPE on q and k, keys within ``window_size``
    tokens (i - j < window_size) when set; scores and softmax in float32.

    Args:
        hidden_size: the input and output size.
        num_heads: the query heads.
        num_kv_heads: the key/value heads, a divisor of ``num_heads`` (default ``num_heads``).
        qkv_bias: whether the q, k and v projections have a bias.
        window_size: None (full causal attention) or the sliding window's size in tokens.
        rope_theta: RoPE's base.
        max_position_embeddings: stored (FLA's argument); no limit is applied.
        layer_idx: stored, the layer's index in a model.
        rngs: the parameters' random keys.

    Raises:
        ValueError: ``num_heads`` does not divide ``hidden_size`` into an even head dim;
            ``num_kv_heads`` does not divide ``num_heads``; ``window_size`` is not None or
            positive; ``rope_theta`` is not positive.
    """

    def __init__(
        self,
        hidden_size: int = 2048,
        num_heads: int = 32,
        num_kv_heads: int | None = None,
        qkv_bias: bool = False,
        window_size: int | None = None,
        rope_theta: float = 10000.0,
        max_position_embeddings: int | None = None,
        layer_idx: int | None = None,
        *,
        rngs: nnx.Rngs,
    ):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or hidden_size % num_heads or (hidden_size // num_heads) % 2:
            raise ValueError(
                f"num_heads: expected a divisor of hidden_size={hidden_size} giving an even head dim, got {num_heads}"
            )
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads: expected a divisor of num_heads={num_heads}, got {num_kv_heads}")
        if window_size is not None and window_size < 1:
            raise ValueError(f"window_size: expected None or a positive int, got {window_size}")
        if not rope_theta > 0:
            raise ValueError(f"rope_theta: expected a positive float, got {rope_theta}")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.window_size, self.rope_theta = window_size, rope_theta
        self.max_position_embeddings, self.layer_idx = max_position_embeddings, layer_idx
        kv_dim = num_kv_heads * self.head_dim
        self.q_proj = nnx.Linear(hidden_size, hidden_size, use_bias=qkv_bias, rngs=rngs)
        self.k_proj = nnx.Linear(hidden_size, kv_dim, use_bias=qkv_bias, rngs=rngs)
        self.v_proj = nnx.Linear(hidden_size, kv_dim, use_bias=qkv_bias, rngs=rngs)
        self.o_proj = nnx.Linear(hidden_size, hidden_size, use_bias=False, rngs=rngs)
        self.layout: Layout | None = None  # set by kdax.models.shard

    def init_cache(self, batch_size: int, max_length: int, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
        """Zeroed (k, v) cache for rows of up to ``max_length`` tokens.

        Args:
            batch_size: the rows B.
            max_length: the most tokens a row will hold.
            dtype: the cache's dtype.

        Returns:
            (k, v), each [batch_size, slots, num_kv_heads, head_dim] zeros in ``dtype``: slots =
            max_length, or min(window_size, max_length) with a window (a ring buffer: position
            p lives in slot p % slots).
        """
        slots = max_length if self.window_size is None else min(self.window_size, max_length)
        shape = (batch_size, slots, self.num_kv_heads, self.head_dim)
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

    def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The queries, keys and values of ``x`` ([B, T, hidden_size]) at ``positions`` ([B, T]).

        Returns:
            (q [B, T, num_heads, head_dim], k and v [B, T, num_kv_heads, head_dim]), RoPE on q and k.
        """
        B, T, _ = x.shape
        q = rope(self.q_proj(x).reshape(B, T, self.num_heads, self.head_dim), positions, self.rope_theta)
        k = rope(self.k_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim), positions, self.rope_theta)
        return q, k, self.v_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim)

    def __call__(self, x, *, positions=None, segment_ids=None, cache=None, kascade: KascadeStep | None = None):
        """Attend causally within each row (or segment), optionally continuing from a cache.

        With ``cache`` each row holds one sequence whose tokens before positions[b, 0] are
        cached: row b's tokens are at positions[b, 0] + t, attend to the cached ones and to
        each other, and are stored; tokens outside the row's first segment (padding after it,
        when segment_ids is given) are not stored.

        Args:
            x: [B, T, hidden_size].
            positions: [B, T] int RoPE positions (default 0..T-1).
            segment_ids: [B, T] ints, or None; tokens attend only within their segment
                (packed sequences, padding).
            cache: None, or the (k, v) of :meth:`init_cache` (or of an earlier call).
            kascade: None (dense attention), or the Kascade step this layer runs: over the
                tokens of ``x`` (prefill; an empty cache), or one token over the cache
                (decode, T = 1). ``segment_ids`` then mark each row's tokens (segment of the
                first token) and its padding after them; no sliding window.

        Returns:
            (y [B, T, hidden_size] in the dtype x and the weights promote to (x's dtype when
            they match), the updated (k, v) cache or None without ``cache``); with
            ``kascade``, a third item: an anchor's selection (None for a reuse layer).

        Raises:
            ValueError: ``kascade`` on a sliding-window layer.
        """
        B, T, _ = x.shape
        H, G, Dh = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        q, k, v = self.project(x, positions)
        if self.layout is not None and cache is None and kascade is None:  # every key to every device of a row
            L = self.layout
            q = L.constrain(q, L.data, L.context, L.heads(self.num_heads), None)
            k, v = (L.constrain(x, L.data, None, L.heads(self.num_kv_heads), None) for x in (k, v))
        if kascade is not None:
            return self._kascade(x.dtype, q, k, v, positions, segment_ids, cache, kascade)
        if cache is None:
            dist = jnp.broadcast_to(jnp.arange(T)[:, None] - jnp.arange(T)[None, :], (B, T, T))
            allowed = dist >= 0
            if segment_ids is not None:
                allowed &= segment_ids[:, :, None] == segment_ids[:, None, :]
        else:
            first = positions[:, :1]  # [B, 1]
            new_cache, n = store_tokens(positions, segment_ids, cache, (k, v))
            if self.window_size is not None and T > 1:  # the ring may drop keys that earlier new tokens need
                key_pos = jnp.concatenate([_slot_positions(first - 1, cache[0].shape[1]), positions], axis=1)
                k, v = (jnp.concatenate([c.astype(new.dtype), new], axis=1) for c, new in zip(cache, (k, v)))
            else:
                key_pos = _slot_positions(first + n - 1, cache[0].shape[1])
                k, v = new_cache
            dist = positions[:, :, None] - key_pos[:, None, :]
            allowed = (dist >= 0) & (key_pos >= 0)[:, None, :]
            cache = new_cache
        if self.window_size is not None:
            allowed &= dist < self.window_size
        qg = q.reshape(B, T, H, G, Dh).astype(jnp.float32)
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) * Dh**-0.5
        scores = jnp.where(allowed[:, None, None], scores, -jnp.inf)
        o = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(scores, axis=-1), v.astype(jnp.float32))
        return self.o_proj(o.reshape(B, T, H * G * Dh).astype(x.dtype)), cache

    def _kascade(self, dtype, q, k, v, positions, segment_ids, cache, step: KascadeStep):
        """The Kascade path of :meth:`__call__`."""
        if self.window_size is not None:
            raise ValueError(f"kascade: expected a full-attention layer, got window_size={self.window_size}")
        B, T = q.shape[:2]
        lengths, decode, cache = kascade_keys(positions, segment_ids, cache, (k, v))
        if decode:
            k, v = (c.astype(q.dtype) for c in cache)
        o, indices = kascade_attend(q, k, v, lengths, step, decode=decode)
        return self.o_proj(o.reshape(B, T, -1).astype(dtype)), cache, indices


def store_tokens(positions, segment_ids, cache, new):
    """A cache with each row's new tokens stored: row b's first segment (all T tokens without
    segment_ids), at positions[b, 0] + t.

    Args:
        positions: [B, T] the tokens' positions; segment_ids: [B, T] or None.
        cache: a layer's cache (arrays [B, slots, ...]).
        new: the new tokens' entries of each cache array ([B, T, ...] each).

    Returns:
        (the cache, n [B, 1] int32: the tokens stored in each row).
    """
    first, n = positions[:, :1], _row_tokens(positions, segment_ids)
    return tuple(_store(c, x, first, first + n - 1) for c, x in zip(cache, new)), n


def _row_tokens(positions, segment_ids) -> jax.Array:
    """[B, 1] int32: each row's tokens, those of its first segment (all T without segment_ids)."""
    B, T = positions.shape
    n = T if segment_ids is None else jnp.sum(segment_ids == segment_ids[:, :1], axis=1, keepdims=True)
    return jnp.broadcast_to(jnp.asarray(n, jnp.int32), (B, 1))


def kascade_keys(positions, segment_ids, cache, new):
    """Where a Kascade step's keys come from, and the cache with the new tokens stored
    (:func:`store_tokens`).

    Args:
        positions: [B, T] the tokens' positions; segment_ids: [B, T] or None (row b's tokens
            are the segment of its first token).
        cache: None, or a layer's cache (arrays [B, slots, ...]).
        new: the new tokens' entries of each cache array ([B, T, ...] each).

    Returns:
        (lengths [B] int32: the keys of each row, decode: whether one token attends over the
        cache (T = 1 with a cache; else the keys are the new tokens, a prefill into an empty
        cache), the cache with the new tokens stored, or None).
    """
    decode = cache is not None and positions.shape[1] == 1
    n = _row_tokens(positions, segment_ids)
    if cache is not None:
        cache, n = store_tokens(positions, segment_ids, cache, new)
    return (positions[:, 0] + 1 if decode else n[:, 0]), decode, cache


def kascade_attend(q, k, v, lengths, step: KascadeStep, *, decode: bool, scale: float | None = None):
    """The Kascade op of a layer's step.

    Args:
        q: [B, T, H, D] (decode: T = 1).
        k, v: [B, S, G, D], the keys the rows attend to (the first lengths[b] of row b).
        lengths: [B] int32.
        step: the layer's :class:`KascadeStep`.
        decode: one query token per row over the keys (the decode ops), else a prefill.
        scale: the scores' scale (None: D ** -0.5).

    Returns:
        (o [B, T, H, D], an anchor's selection or None).
    """
    sched = step.schedule
    pools = {"pool_size": sched.pool_size}
    anchor = {"topk_percent": sched.topk_percent, "min_k": sched.min_k, "dense_output": step.dense_output} | pools
    if decode:
        if step.role == "anchor":
            indices, o = kascade_anchor_decode(q[:, 0], k, v, lengths, scale=scale, **anchor)
        else:
            indices = None
            reuse = {"head_map": step.head_map, "scale": scale} | pools
            o = kascade_reuse_decode(q[:, 0], k, v, lengths, step.indices, **reuse)
        return o[:, None], indices
    opts = {"tile_size": sched.tile_size, "lengths": lengths, "scale": scale}
    if step.role == "anchor":
        indices, o = kascade_anchor(q, k, v, **anchor, **opts)
    else:
        indices = None
        o = kascade_reuse(q, k, v, step.indices, head_map=step.head_map, **opts, **pools)
    return o, indices


def _slot_positions(last: jax.Array, slots: int) -> jax.Array:
    """Positions [B, slots] held by a cache whose rows store positions 0..last[b] ([B, 1]),
    position p in slot p % slots: the newest p <= last in each slot, negative where none."""
    s = jnp.arange(slots, dtype=last.dtype)
    return last - (last - s) % slots


def _store(cache: jax.Array, new: jax.Array, first: jax.Array, last: jax.Array) -> jax.Array:
    """cache [B, slots, ...] with new [B, T, ...] (positions first[b] + t) stored up to
    position last[b] ([B, 1] each); each slot takes the newest position that maps to it."""
    t = _slot_positions(last, cache.shape[1]) - first  # [B, slots]: index into new, < 0 to keep
    picked = jnp.take_along_axis(new, jnp.clip(t, 0, new.shape[1] - 1)[:, :, None, None], axis=1)
    return jnp.where((t >= 0)[:, :, None, None], picked.astype(cache.dtype), cache)
