"""FLA's ``GatedMLP`` (SwiGLU): down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class GatedMLP(nnx.Module):
    """SwiGLU MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))``, linears without bias.

    Args:
        hidden_size: the input and output size.
        hidden_ratio: used when ``intermediate_size`` is None (default 4).
        intermediate_size: the hidden size; defaults as in FLA to
            ``2/3 * hidden_size * hidden_ratio`` rounded up to a multiple of 256.
        hidden_act: "swish", the only activation.
        swiglu_limit: None, or a clamp before the activation (:func:`swiglu`).
        rngs: the parameters' random keys.

    Raises:
        ValueError: ``hidden_act`` is not "swish".
    """

    def __init__(
        self,
        hidden_size: int,
        hidden_ratio: int | None = None,
        intermediate_size: int | None = None,
        hidden_act: str = "swish",
        *,
        swiglu_limit: float | None = None,
        rngs: nnx.Rngs,
    ):
        if hidden_act != "swish":
            raise ValueError(f"hidden_act: expected 'swish', got {hidden_act!r}")
        hidden_ratio = 4 if hidden_ratio is None else hidden_ratio
        if intermediate_size is None:
            intermediate_size = 256 * -(-int(hidden_size * hidden_ratio * 2 / 3) // 256)
        self.intermediate_size, self.swiglu_limit = intermediate_size, swiglu_limit
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)
        self.gate_proj = linear(hidden_size, intermediate_size)
        self.up_proj = linear(hidden_size, intermediate_size)
        self.down_proj = linear(intermediate_size, hidden_size)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply the MLP.

        Args:
            x: [..., hidden_size].

        Returns:
            [..., hidden_size], in the dtype x and the weights promote to.
        """
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))


def swiglu(gate: jax.Array, up: jax.Array, limit: float | None = None) -> jax.Array:
    """``silu(gate) * up``; with ``limit``, gate clamped to at most ``limit`` and up to
    [-limit, limit] first (GLM-5's ``swiglu_limit``)."""
    if limit is not None:
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up
