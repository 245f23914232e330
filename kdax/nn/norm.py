"""RMS normalisation layers (FLA's ``RMSNorm`` and ``FusedRMSNormGated``), computed in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

_GATES = {"sigmoid": jax.nn.sigmoid, "swish": jax.nn.silu, "silu": jax.nn.silu}


def _rms(x: jax.Array, eps: float) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """``y = x / rms(x) * weight`` over the last axis, computed in float32.

    Args:
        hidden_size: D, the size of the normalised axis.
        eps: added to the mean square before the square root.

    Attributes:
        weight: [D] float32 scale, initialised to ones.

    Raises:
        ValueError: ``hidden_size`` is not a positive int.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        if hidden_size < 1:
            raise ValueError(f"hidden_size: expected a positive int, got {hidden_size}")
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((hidden_size,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalise ``x``.

        Args:
            x: [..., D].

        Returns:
            [..., D] in x's dtype.
        """
        return (_rms(x, self.eps) * self.weight[...]).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """``y = x / rms(x) * weight * act(gate)`` over the last axis, computed in float32 (FLA's
    ``FusedRMSNormGated``).

    Args:
        hidden_size: D, the size of the normalised axis.
        activation: act: "sigmoid" (KDA's output norm), "swish" or "silu" (the same function).
        eps: added to the mean square before the square root.

    Attributes:
        weight: [D] float32 scale, initialised to ones.

    Raises:
        ValueError: ``activation`` is not one of the above, or ``hidden_size`` is not a
            positive int.
    """

    def __init__(self, hidden_size: int, activation: str = "sigmoid", eps: float = 1e-5):
        if activation not in _GATES:
            raise ValueError(f"activation: expected one of {tuple(_GATES)}, got {activation!r}")
        if hidden_size < 1:
            raise ValueError(f"hidden_size: expected a positive int, got {hidden_size}")
        self.eps, self.activation = eps, activation
        self.weight = nnx.Param(jnp.ones((hidden_size,), jnp.float32))

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        """Normalise ``x`` and gate it.

        Args:
            x: [..., D].
            gate: [..., D] (any float dtype).

        Returns:
            [..., D] in x's dtype.
        """
        act = _GATES[self.activation](gate.astype(jnp.float32))
        return (_rms(x, self.eps) * self.weight[...] * act).astype(x.dtype)
