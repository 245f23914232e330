"""Token-by-token KDA for decoding: one ``lax.scan`` over the packed tokens.

Variable-length batches reset the state to the sequence's initial state at each
sequence start, so ``cu_seqlens`` may be traced. Differentiable by autodiff through the
scan (it stores one state per token: meant for short T, e.g. decode steps).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST


def fused_recurrent_kda_xla(q, k, v, g, beta, h0, cu_seqlens=None, token_states=False):
    """q, k: [B, T, HV, K] (q scaled); v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV];
    h0: [B, N, HV, K, V]; cu_seqlens: [N + 1] or None (then N = 1 per batch row).

    Returns (o [B, T, HV, V], final [B, N, HV, K, V]) in the inputs' dtype, and with
    ``token_states`` a third output, the state after each token [B, T, HV, K, V].
    """
    T = q.shape[1]
    t = jnp.arange(T, dtype=jnp.int32)
    if cu_seqlens is None:
        seq = jnp.zeros((T,), jnp.int32)
        first, last = t == 0, t == T - 1
    else:
        cu = cu_seqlens.astype(jnp.int32)
        seq = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
        first, last = t == cu[seq], t == cu[seq + 1] - 1

    def step(carry, xs):
        S, final = carry  # [B, HV, K, V], [B, N, HV, K, V]
        q_t, k_t, v_t, g_t, b_t, n, is_first, is_last = xs
        S = jnp.where(is_first, h0[:, n], S) * jnp.exp(g_t)[..., None]
        pred = jnp.einsum("bhk,bhkv->bhv", k_t, S, precision=_HI)
        S = S + (b_t[..., None] * k_t)[..., None] * (v_t - pred)[..., None, :]
        o_t = jnp.einsum("bhk,bhkv->bhv", q_t, S, precision=_HI)
        final = final.at[:, n].set(jnp.where(is_last, S, final[:, n]))
        return (S, final), (o_t, S if token_states else None)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)) + (seq, first, last)
    (_, final), (o, states) = lax.scan(step, (jnp.zeros_like(h0[:, 0]), h0), xs)
    o = jnp.moveaxis(o, 0, 1)
    return (o, final, jnp.moveaxis(states, 0, 1)) if token_states else (o, final)
