"""Exact inverse of a unit lower-triangular matrix by block forward substitution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def dyadic_levels(C: int) -> list[int]:
    """Block sizes of the dyadic levels of a [C, C] triangle.

    Args:
        C: a power of two.

    Returns:
        [C, C/2, ..., 2] (empty for C = 1).
    """
    return [C >> i for i in range(C.bit_length() - 1)]


def unit_lower_inverse(A: jax.Array) -> jax.Array:
    """``(I + A)^-1`` for strictly lower-triangular A: [..., C, C], C a power of two.

    Doubling block size h = 1, 2, 4, ...: for each diagonal block [[T11, 0], [A21, T22]]
    of size 2h the inverse is [[T11, 0], [-T22 A21 T11, T22]]. Exact (the arithmetic
    of blocked forward substitution), only matmuls, log2(C) steps; the entries of A on
    and above the diagonal are ignored.

    Args:
        A: [..., C, C] float, C a power of two.

    Returns:
        [..., C, C] in A's dtype, unit lower triangular.

    Raises:
        ValueError: C is not a power of two.
    """
    C = A.shape[-1]
    if C & (C - 1):
        raise ValueError(f"unit_lower_inverse: expected a power-of-two size, got C={C}")
    batch = A.shape[:-2]
    T = jnp.ones(batch + (C, 1, 1), A.dtype)  # inverses of the 1 x 1 diagonal blocks
    h = 1
    while h < C:
        s = 2 * h
        blocks = A.reshape(batch + (C // s, s, C // s, s))
        blocks = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)  # [..., C/s, s, s]
        A21 = blocks[..., h:, :h]
        T11, T22 = T[..., 0::2, :, :], T[..., 1::2, :, :]
        T21 = -jnp.matmul(T22, jnp.matmul(A21, T11, precision=lax.Precision.HIGHEST), precision=lax.Precision.HIGHEST)
        top = jnp.concatenate([T11, jnp.zeros_like(T11)], axis=-1)
        bottom = jnp.concatenate([T21, T22], axis=-1)
        T = jnp.concatenate([top, bottom], axis=-2)
        h = s
    return T.reshape(batch + (C, C))
