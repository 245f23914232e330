"""Argument checks shared by the op families: bad input raises ValueError naming the argument,
what was expected and what came; traced offsets and lengths, which cannot be checked so, are
made valid, and checked with ``checkify`` under :func:`debug_checks`."""

from __future__ import annotations

import contextlib
import contextvars
from typing import NoReturn

import jax
import jax.numpy as jnp

_TRACED_CHECKS = contextvars.ContextVar("kdax_traced_checks", default=False)


@contextlib.contextmanager
def debug_checks(enabled: bool = True):
    """Within it, the ops check traced ``cu_seqlens`` (KDA) and ``lengths`` (Kascade) with
    ``jax.experimental.checkify.check`` instead of only making them valid, so that a function
    traced here must run under ``checkify.checkify``, which returns the error to ``.throw()``::

        with kdax.debug_checks():
            err, o = checkify.checkify(jax.jit(f))(q, k, v, g, beta, cu_seqlens)
        err.throw()  # "cu_seqlens: expected offsets from 0 to T = ..., got [...]"

    Concrete values are checked (ValueError) either way. The flag is read when an op is traced:
    a function jitted outside the context keeps its unchecked trace.
    """
    token = _TRACED_CHECKS.set(enabled)
    try:
        yield
    finally:
        _TRACED_CHECKS.reset(token)


class LayoutWarning(UserWarning):
    """Inputs whose shapes suggest a layout mistake (FLA's warning: fewer tokens than heads, as
    head-first [B, H, T, K] inputs have). Silence it with ``warnings.filterwarnings("ignore",
    category=kdax.LayoutWarning)`` where short inputs are meant (kdax's layers do)."""


def check_traced(x) -> bool:
    """Whether an op checks the traced array ``x`` with checkify (a tracer, under :func:`debug_checks`)."""
    return _TRACED_CHECKS.get() and isinstance(x, jax.core.Tracer)


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
