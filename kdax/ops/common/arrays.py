"""Small helpers the backends of every op family share."""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E); the kernels work in log2 space


def pad_last(x: jax.Array, n: int, fill: float = 0.0) -> jax.Array:
    """Pad the last axis at its end.

    Args:
        x: [..., d].
        n: the new size, >= d.
        fill: the padding value.

    Returns:
        [..., n] in x's dtype.
    """
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n - x.shape[-1])], constant_values=fill)


def round_up(n: int, m: int) -> int:
    """The least multiple of ``m`` that is >= ``n``.

    Args:
        n: an int.
        m: a positive int.

    Returns:
        ``ceil(n / m) * m``.
    """
    return -(-n // m) * m


def round_tf32(x: jax.Array) -> jax.Array:
    """Round float32 to TF32 (10 explicit mantissa bits), to nearest even, by bit operations
    (they lower in Pallas kernels too). Finite values within 2^-12 of float32's largest round
    to inf.

    Args:
        x: floats, taken as float32.

    Returns:
        float32, x's TF32 value: ``x - round_tf32(x)`` is exact and TF32 keeps its leading 11 bits.
    """
    bits = jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)
    bits = (bits + jnp.uint32(0xFFF) + ((bits >> 13) & 1)) & jnp.uint32(0xFFFFE000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def masked_softmax(scores: jax.Array, allowed: jax.Array) -> jax.Array:
    """Softmax over the last axis among the ``allowed`` entries.

    Args:
        scores: [..., S] floats.
        allowed: bool, broadcastable to scores.

    Returns:
        [..., S] in scores' dtype: 0 where not allowed, and in rows with nothing allowed.
    """
    s = jnp.where(allowed, scores, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(allowed, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0)), 0)
    return p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), jnp.finfo(p.dtype).tiny)
