"""The pallas_tpu backend's custom VJP: the forward saves what the backward kernel reads."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kdax.ops.kda.pallas_tpu.calls import backward, forward
from kdax.ops.kda.pallas_tpu.kernels import KEPT, SAVED


def _if_empty(empty, x, y):
    """Per sequence: x where the sequence has no tokens (no chunk of its own, so the kernels
    never write its final state or dh0), else y. empty: [N]; x, y: [B, N, ...]."""
    return jnp.where(empty.reshape((1, -1) + (1,) * (x.ndim - 2)), x, y)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12))
def core(q, k, v, g, beta, h0t, sched, empty, groups, cfg, keep, states, o_dtype):
    o, final, S_in, _ = forward(q, k, v, g, beta, h0t, sched, groups, cfg, states, (), o_dtype)
    return o, _if_empty(empty, h0t, final), S_in


def _fwd(q, k, v, g, beta, h0t, sched, empty, groups, cfg, keep, states, o_dtype):
    o, final, S_in, kept = forward(q, k, v, g, beta, h0t, sched, groups, cfg, True, KEPT if keep else SAVED, o_dtype)
    return (o, _if_empty(empty, h0t, final), S_in if states else None), (q, k, v, g, beta, sched, empty, S_in, kept)


def _bwd(groups, cfg, keep, states, o_dtype, res, cts):
    q, k, v, g, beta, sched, empty, S_in, kept = res
    do, dfinal_t, dS_in = cts
    # dv in the caller's dtype (v, unlike q, k, g and beta, reaches the op unchanged): the kernel
    # writes, and XLA's relayout reads, half the bytes (static cycles, docs/kda_tpu.md, Precision)
    dq, dk, dv, dg, dbeta, dh0t = backward(
        q, k, v, g, beta, sched, S_in, kept, do, dfinal_t, dS_in, groups, cfg, o_dtype
    )
    dq, dk, dv, dg = (jnp.moveaxis(x, 2, 1).astype(jnp.float32) for x in (dq, dk, dv, dg))  # XLA drops (below)
    return dq, dk, dv, dg, dbeta, _if_empty(empty, dfinal_t, dh0t), (None, None, None), None


core.defvjp(_fwd, _bwd)
