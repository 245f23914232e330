"""The element-wise parts of KDA that run before the recurrence: gate, L2 norm, beta.

All three are plain differentiable jnp, applied by XLA before the core, so gradients with
respect to ``A_log`` and ``dt_bias`` come from ordinary autodiff; the one exception is the
gate on ``backend="pallas_gpu"``, whose kernels apply :func:`log_decay` to the raw logits
as they load them (docs/kda_gpu.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kdax.ops.common.arrays import LOG2E

L2NORM_EPS = 1e-6

# log1p(t) / t on [0, 1], lowest degree first: a degree-8 Chebyshev least-squares fit at 4001 Chebyshev
# points (numpy.polynomial.Chebyshev.fit), rounded to float32; 2e-7 relative error in float32 Horner.
_LOG1P_OVER_T = (
    1.0,
    -0.49999502301216125,
    0.33319273591041565,
    -0.24844388663768768,
    0.1911148577928543,
    -0.13674858212471008,
    0.07836245745420456,
    -0.02958887256681919,
    0.005253523122519255,
)


def _f32(x: jax.Array) -> jax.Array:
    """Promote to at least float32 (float64 stays float64)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def kda_gate(
    g: jax.Array,
    A_log: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    lower_bound: float | None = None,
) -> jax.Array:
    """Log-space KDA decay from raw gate logits.

    Without ``lower_bound``: ``-exp(A_log)[h] * softplus(g + dt_bias)`` (needs A_log).
    With ``lower_bound`` (< 0): ``lower_bound * sigmoid(exp(A_log)[h] * (g + dt_bias))``,
    or ``lower_bound * sigmoid(g + dt_bias)`` when ``A_log`` is None.

    Args:
        g: [..., HV, K] raw logits.
        A_log: [HV], or None (then ``lower_bound`` is required).
        dt_bias: [HV * K], or None (no bias).
        lower_bound: None, or a negative float.

    Returns:
        [..., HV, K] log decay (<= 0) in float32, or float64 if an input is float64.

    Raises:
        ValueError: ``A_log`` and ``lower_bound`` are both None.
    """
    if lower_bound is None and A_log is None:
        raise ValueError("kda_gate: A_log is required unless lower_bound is given")
    HV, K = g.shape[-2:]
    x = _f32(g)
    a = None if A_log is None else jnp.exp(_f32(A_log)).reshape(HV, 1)
    b = None if dt_bias is None else _f32(dt_bias).reshape(HV, K)
    return log_decay(x, a, b, lower_bound)


def softplus_exp2(x: jax.Array) -> jax.Array:
    """``softplus(x) = max(x, 0) + log1p(t)``, ``t = exp(-|x|)`` in [0, 1], by one ``exp2`` and a
    polynomial for ``log1p(t) / t``: within 3e-7 relative of the exact value for x >= -20 (a
    float32 ``jax.nn.softplus`` is within 2.3e-7), and in a Pallas-Triton kernel about 14
    instructions an element, where ``jax.nn.softplus`` lowers to libdevice's ``expf`` and
    ``log1pf``, about 44 (docs/kda_gpu.md, "Gate, L2 norm and layout in the kernels").

    Args:
        x: a float array (float32 for the accuracy above).

    Returns:
        softplus(x), x's shape and dtype.
    """
    t = jnp.exp2(jnp.abs(x) * -LOG2E)
    p = _LOG1P_OVER_T[-1]
    for c in _LOG1P_OVER_T[-2::-1]:
        p = p * t + c
    return jnp.maximum(x, 0.0) + t * p


def log_decay(
    x: jax.Array, a: jax.Array | None, b: jax.Array | None, lower_bound: float | None, softplus=jax.nn.softplus
) -> jax.Array:
    """:func:`kda_gate` on logits x with ``a = exp(A_log)`` and ``b = dt_bias`` broadcast to x
    (None: 1 and 0). Plain jnp, so the GPU kernels apply it to their tiles as XLA does (they pass
    ``softplus=softplus_exp2``).

    Args:
        x: raw logits, any shape.
        a: ``exp(A_log)`` broadcastable to x, or None (required without ``lower_bound``).
        b: ``dt_bias`` broadcastable to x, or None.
        lower_bound: None, or a negative float.
        softplus: the softplus to use.

    Returns:
        The log decay, x's shape, in the dtype x, a and b promote to.
    """
    if b is not None:
        x = x + b
    if lower_bound is None:
        return -a * softplus(x)
    return lower_bound * jax.nn.sigmoid(x if a is None else a * x)


def l2norm(x: jax.Array, axis: int = -1) -> jax.Array:
    """``x / sqrt(sum(x**2) + 1e-6)`` along ``axis``.

    Args:
        x: a float array, e.g. q or k [B, T, H, K].
        axis: the axis to normalise.

    Returns:
        x's shape and dtype, computed in float32 (float64 for float64 x).
    """
    xf = _f32(x)
    return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=axis, keepdims=True) + L2NORM_EPS)).astype(x.dtype)


def beta_activation(beta: jax.Array, allow_neg_eigval: bool = False) -> jax.Array:
    """``sigmoid(beta)``, or ``2 * sigmoid(beta)`` in [0, 2) when ``allow_neg_eigval``.

    Args:
        beta: raw logits, e.g. [B, T, HV].
        allow_neg_eigval: whether to double the sigmoid (eigenvalues of the transition down
            to -1).

    Returns:
        beta's shape, in float32 (float64 for float64 beta).
    """
    b = jax.nn.sigmoid(_f32(beta))
    return 2.0 * b if allow_neg_eigval else b


def in_op(q, k, g, beta, A_log, dt_bias, *, l2norm_qk, gate, lower_bound, beta_sigmoid, allow_neg_eigval):
    """The in-op transforms a KDA call asks for (``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel``,
    ``use_beta_sigmoid_in_kernel``), in XLA.

    Args:
        q, k: [B, T, H, K]; g: [B, T, HV, K]; beta: [B, T, HV]; A_log, dt_bias: as :func:`kda_gate`.
        l2norm_qk, gate, beta_sigmoid: which transforms to apply; lower_bound, allow_neg_eigval:
            as :func:`kda_gate` and :func:`beta_activation` take them.

    Returns:
        (q, k, g, beta) transformed.
    """
    if l2norm_qk:
        q, k = l2norm(q), l2norm(k)
    if gate:
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    if beta_sigmoid:
        beta = beta_activation(beta, allow_neg_eigval)
    return q, k, g, beta
