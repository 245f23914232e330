"""Hyper-connections (GLM-5's manifold-constrained form): N residual streams around each sublayer.

A layer reads its streams X [..., N, D] through one small projection of their RMS-normed
concatenation: ``pre`` weights that collapse the streams into the sublayer's input, ``post``
weights that spread its output back, and a mixing matrix ``comb`` of the streams, pushed towards
doubly stochastic by Sinkhorn iterations. The new streams are ``post[n] * y + sum_i comb[i, n] X[i]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class HyperConnection(nnx.Module):
    """One sublayer's hyper-connection over ``streams`` residual streams of ``hidden_size``.

    Args:
        hidden_size: D.
        streams: N (``hc_mult``), at least 1.
        sinkhorn_iters: the Sinkhorn iterations on ``comb`` (the first normalises its columns
            alone, each later one rows then columns), at least 1.
        eps: added to ``pre`` and ``comb`` and to each Sinkhorn sum (``hc_eps``).
        norm_eps: the unweighted RMSNorm's epsilon over the N x D concatenation.
        rngs: the parameters' random keys.

    Parameters: ``fn`` [(2 + N) N, N D] (normal, 0.02), ``base`` [(2 + N) N] (zeros) and
    ``scale`` [3] (ones), as the checkpoints store them. Computed in float32.

    Raises:
        ValueError: a size or count below 1, or an epsilon not positive.
    """

    def __init__(
        self,
        hidden_size: int,
        streams: int,
        *,
        sinkhorn_iters: int = 20,
        eps: float = 1e-6,
        norm_eps: float = 1e-5,
        rngs: nnx.Rngs,
    ):
        for name, value in (("hidden_size", hidden_size), ("streams", streams), ("sinkhorn_iters", sinkhorn_iters)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        for name, value in (("eps", eps), ("norm_eps", norm_eps)):
            if not value > 0:
                raise ValueError(f"{name}: expected a positive float, got {value!r}")
        N, D = streams, hidden_size
        self.streams, self.sinkhorn_iters, self.eps, self.norm_eps = N, sinkhorn_iters, eps, norm_eps
        self.fn = nnx.Param(jax.random.normal(rngs.params(), ((2 + N) * N, N * D)) * 0.02)
        self.base = nnx.Param(jnp.zeros(((2 + N) * N,)))
        self.scale = nnx.Param(jnp.ones((3,)))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [..., N, D] -> (the sublayer's input [..., D] in x's dtype, post [..., N] and
        comb [..., N, N] float32, for :meth:`combine`)."""
        N, D = self.streams, x.shape[-1]
        if x.shape[-2:] != (N, D) or x.shape[-1] * N != self.fn.shape[1]:
            raise ValueError(f"x: expected [..., {N}, {self.fn.shape[1] // N}], got {x.shape}")
        f32 = jnp.float32
        flat = x.reshape(*x.shape[:-2], N * D).astype(f32)
        flat = flat * jax.lax.rsqrt(jnp.mean(flat * flat, -1, keepdims=True) + self.norm_eps)
        z = flat @ self.fn[...].astype(f32).T
        base, scale = self.base[...].astype(f32), self.scale[...].astype(f32)
        pre = jax.nn.sigmoid(z[..., :N] * scale[0] + base[:N]) + self.eps
        post = 2 * jax.nn.sigmoid(z[..., N : 2 * N] * scale[1] + base[N : 2 * N])
        logits = (z[..., 2 * N :] * scale[2] + base[2 * N :]).reshape(*z.shape[:-1], N, N)
        comb = jax.nn.softmax(logits, -1) + self.eps
        columns = lambda c: c / (c.sum(-2, keepdims=True) + self.eps)
        comb = columns(comb)
        for _ in range(self.sinkhorn_iters - 1):
            comb = columns(comb / (comb.sum(-1, keepdims=True) + self.eps))
        collapsed = (pre[..., None] * x.astype(f32)).sum(-2).astype(x.dtype)
        return collapsed, post, comb

    @staticmethod
    def combine(x: jax.Array, y: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
        """The new streams [..., N, D] in x's dtype: ``post[n] * y + sum_i comb[i, n] x[i]`` (x
        [..., N, D], the sublayer's output y [..., D]; post and comb cast to x's dtype first)."""
        dt = x.dtype
        spread = post.astype(dt)[..., None] * y.astype(dt)[..., None, :]
        return spread + jnp.einsum("...in,...id->...nd", comb.astype(dt), x)
