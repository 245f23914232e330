"""FLA's ``ShortConvolution``: a depthwise causal convolution over time, optional SiLU, and a
cache of each sequence's last ``kernel_size`` inputs for decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class ShortConvolution(nnx.Module):
    """Depthwise causal convolution over time:
    ``y_t = act(sum_j weight[:, 0, W - 1 - j] x_{t - j} + bias)``, the inputs before a
    sequence's start taken from ``cache`` (or zero), computed in float32.

    Args:
        hidden_size: D, the channels.
        kernel_size: W, the taps.
        bias: whether to add a bias.
        activation: act: None, or "silu" / "swish" (the same function).
        rngs: the parameters' random keys (torch ``Conv1d``'s uniform initialisation).

    Attributes:
        weight: [D, 1, W] float32 (torch ``Conv1d`` depthwise layout, as in FLA checkpoints).
        bias: [D] float32, or None.

    Raises:
        ValueError: ``activation`` is not one of the above, or ``kernel_size`` or
            ``hidden_size`` is not positive.
    """

    def __init__(
        self, hidden_size: int, kernel_size: int, bias: bool = False, activation: str | None = "silu", *, rngs: nnx.Rngs
    ):
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"activation: expected None, 'silu' or 'swish', got {activation!r}")
        if kernel_size < 1 or hidden_size < 1:
            raise ValueError(f"kernel_size, hidden_size: expected positive ints, got {kernel_size}, {hidden_size}")
        bound = kernel_size**-0.5  # torch Conv1d's default init: fan_in = kernel_size for a depthwise conv
        uniform = lambda shape: jax.random.uniform(rngs.params(), shape, jnp.float32, -bound, bound)
        self.hidden_size, self.kernel_size, self.activation = hidden_size, kernel_size, activation
        self.weight = nnx.Param(uniform((hidden_size, 1, kernel_size)))
        self.bias = nnx.Param(uniform((hidden_size,))) if bias else None

    def __call__(self, x, cache=None, output_final_state=False, cu_seqlens=None, token_states=False):
        """Convolve each sequence, continuing from ``cache``.

        Args:
            x: [B, T, D].
            cache: [N, D, W], each sequence's last W inputs before x (newest last), or None
                (zeros).
            output_final_state: whether to return the updated cache.
            cu_seqlens: [N + 1] int offsets of sequences packed in one row (B = 1), or None
                (N = B, one sequence per row).
            token_states: return the cache after each token [B, T, D, W] instead.

        Returns:
            (y [B, T, D] in x's dtype, the updated cache [N, D, W] in the dtype of ``cache``
            (of x without one), or None unless ``output_final_state`` or ``token_states``).

        Raises:
            ValueError: ``x``'s last dim is not D, or its batch size is not 1 with
                ``cu_seqlens``; ``cache`` is not [N, D, W].
        """
        B, _, D = x.shape
        W = self.kernel_size
        if D != self.hidden_size:
            raise ValueError(f"x: expected last dim {self.hidden_size}, got shape {tuple(x.shape)}")
        if cu_seqlens is not None and B != 1:
            raise ValueError(f"x: expected batch size 1 with cu_seqlens, got shape {tuple(x.shape)}")
        N = B if cu_seqlens is None else jnp.shape(cu_seqlens)[0] - 1
        if cache is not None and tuple(cache.shape) != (N, D, W):
            raise ValueError(f"cache: expected shape {(N, D, W)}, got {tuple(cache.shape)}")
        bias = None if self.bias is None else self.bias[...]
        return short_conv(
            x, self.weight[...], bias, self.activation, cache, output_final_state, cu_seqlens, token_states
        )


def short_conv(
    x, weight, bias=None, activation=None, cache=None, output_final_state=False, cu_seqlens=None, token_states=False
):
    """:class:`ShortConvolution`'s computation on checked arguments, with its weights given (so it
    also runs on a device's slice of the channels inside ``shard_map``).

    Args:
        x: [B, T, D].
        weight: [D, 1, W]; bias: [D] or None; activation: None, "silu" or "swish".
        cache, output_final_state, cu_seqlens: as :meth:`ShortConvolution.__call__`.
        token_states: return instead of the final cache the cache after each token, [B, T, D, W]
            (speculative decoding keeps one per draft token).

    Returns:
        (y [B, T, D] in x's dtype, the cache [N, D, W] (or per token [B, T, D, W]) or None).
    """
    B, T, D = x.shape
    W = weight.shape[-1]
    cu = jnp.arange(B + 1, dtype=jnp.int32) * T if cu_seqlens is None else jnp.asarray(cu_seqlens, jnp.int32)
    N = cu.shape[0] - 1
    flat = x.reshape(B * T, D).astype(jnp.float32)
    past = jnp.zeros((N, W, D), jnp.float32) if cache is None else jnp.swapaxes(cache, 1, 2).astype(jnp.float32)

    def at(n, p):  # input at position p of sequence n (p < 0: from the cache)
        return jnp.where(
            (p >= 0)[..., None], flat[jnp.clip(cu[n] + p, 0, B * T - 1)], past[n, jnp.clip(W + p, 0, W - 1)]
        )

    t = jnp.arange(B * T, dtype=jnp.int32)
    seq = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
    pos = t - cu[seq]
    w = weight[:, 0, :].astype(jnp.float32)  # [D, W]
    y = sum(w[:, W - 1 - j] * at(seq, pos - j) for j in range(W))
    if bias is not None:
        y = y + bias
    if activation is not None:
        y = jax.nn.silu(y)
    final, window = None, jnp.arange(W, dtype=jnp.int32) - W
    if token_states:  # the last W inputs up to and including each token
        final = jnp.swapaxes(at(seq[:, None], pos[:, None] + 1 + window), 1, 2).reshape(B, T, D, W)
    elif output_final_state:
        n = jnp.arange(N, dtype=jnp.int32)[:, None]
        final = jnp.swapaxes(at(n, (cu[1:] - cu[:-1])[:, None] + window), 1, 2)  # [N, D, W]
    if final is not None:
        final = final.astype(x.dtype if cache is None else cache.dtype)
    return y.reshape(B, T, D).astype(x.dtype), final


def from_previous_device(x, axis: str, W: int):
    """Inside ``shard_map`` over ``axis`` (time split into contiguous slices): the last W inputs of
    the device before, as the cache a row's convolution continues from (zeros on the first device).

    Args:
        x: [B, Tl, D], this device's slice (Tl >= W).
        axis: the mesh axis the time axis is split over.
        W: the kernel size.

    Returns:
        [B, D, W] in x's dtype.
    """
    n = jax.lax.axis_size(axis)
    tail = jnp.swapaxes(x[:, -W:], 1, 2)
    return jax.lax.ppermute(tail, axis, [(i, i + 1) for i in range(n - 1)])
