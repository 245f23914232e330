"""The custom VJP around the kernels: the forward keeps what ``keep`` says (by default Aqk,
Kkk and T), the backward recomputes the rest and runs the backward's kernels (:mod:`.calls`)."""

from __future__ import annotations

import functools

import jax

from kdax.ops.kda.pallas_gpu import calls
from kdax.ops.kda.pallas_gpu.calls import Static


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def core(q, k, v, g, gp, beta, h0t, ranges, s: Static, keep: bool, states: bool):
    """(o, final, S_in or None) of :func:`~.calls.forward`; ``keep``: the backward gets every
    intermediate (``disable_recompute``) instead of Aqk, Kkk and T."""
    o, final, S_in, _ = calls.forward(s, q, k, v, g, gp, beta, h0t, ranges, keep=None)
    return o, final, (S_in if states else None)


def _fwd(q, k, v, g, gp, beta, h0t, ranges, s, keep, states):
    o, final, S_in, kept = calls.forward(s, q, k, v, g, gp, beta, h0t, ranges, "all" if keep else "pairs")
    return (o, final, (S_in if states else None)), (q, k, v, g, gp, beta, ranges, S_in, kept)


def _bwd(s, keep, states, res, cts):
    q, k, v, g, gp, beta, ranges, S_in, kept = res
    do, dfinal_t, dS_in = cts
    (qp, kp), pull = jax.vjp(s.qk.prepare, q, k)
    dq, dk, dv, dG, dbeta, dh0t = calls.backward(s, qp, kp, v, g, gp, beta, ranges, S_in, kept, do, dfinal_t, dS_in)
    return (*pull((dq, dk)), dv, *s.gate.vjp(g, gp, dG), dbeta, dh0t, (None, None))


core.defvjp(_fwd, _bwd)
