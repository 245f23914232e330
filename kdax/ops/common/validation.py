"""Argument checks shared by the op families: bad input raises ValueError naming the argument,
what was expected and what came."""

from __future__ import annotations

from typing import NoReturn

import jax.numpy as jnp


def fail(name: str, expected: str, got) -> NoReturn:
    """Raise the library's argument error.

    Args:
        name: the argument.
        expected: what it should be.
        got: what it is.

    Raises:
        ValueError: always, ``"{name}: expected {expected}, got {got}"``.
    """
    raise ValueError(f"{name}: expected {expected}, got {got}")


def check_array(name: str, x, ndim: int, shape=None, integer: bool = False) -> None:
    """Check that ``x`` is an array of ``ndim`` dimensions (of ``shape`` if given) with a floating
    (or, with ``integer``, an integer) dtype.

    Args:
        name: the argument's name, for the message.
        x: the value.
        ndim: the dimensions it must have.
        shape: the shape it must have, or None.
        integer: whether its dtype must be an integer (else floating) dtype.

    Raises:
        ValueError: naming ``name``, for anything else.
    """
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        fail(name, "an array", type(x).__name__)
    if x.ndim != ndim:
        fail(name, f"a {ndim}-d array", f"shape {tuple(x.shape)}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        fail(name, f"shape {tuple(shape)}", f"shape {tuple(x.shape)}")
    kind = jnp.integer if integer else jnp.floating
    if not jnp.issubdtype(x.dtype, kind):
        fail(name, "an integer dtype" if integer else "a floating dtype", f"dtype {x.dtype}")
