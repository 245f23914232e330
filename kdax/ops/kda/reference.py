"""Pure-jnp KDA references: the recurrence token by token, and the plain chunked form.

These are the gold standard the fast paths are tested against. They compute in
float32, or in float64 when given float64 inputs (enable ``jax_enable_x64``). With
``cu_seqlens`` they run each sequence separately, so ``cu_seqlens`` must be concrete
(a NumPy array or a committed jax array, not a tracer).

Shapes: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (log-space decay);
beta [B, T, HV]; initial_state [N, HV, K, V]; o [B, T, HV, V]; state [N, HV, K, V].
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kdax.ops.common.validation import fail
from kdax.ops.kda.capabilities import Capabilities
from kdax.ops.kda.checks import check_inputs, offsets

_HI = lax.Precision.HIGHEST


def _prepare(q, k, v, g, beta, scale):
    """Cast to the compute dtype, repeat q/k over value-head groups, apply the scale."""
    dt = jnp.promote_types(q.dtype, jnp.float32)
    q, k, v, g, beta = (x.astype(dt) for x in (q, k, v, g, beta))
    groups = v.shape[2] // q.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q = jnp.repeat(q, groups, axis=2) * scale
    k = jnp.repeat(k, groups, axis=2)
    return q, k, v, g, beta


def _recurrent_one(q, k, v, g, beta, S, chunk_size=64, intermediate=False):
    """One batch of equal-length sequences. q, k, g: [B, T, HV, K]; S: [B, HV, K, V].

    The token scan runs inside a scan over chunks of ``chunk_size`` tokens (of min(chunk_size, T)
    without ``intermediate``), each chunk a ``jax.checkpoint``: the gradient keeps the state
    entering each chunk and recomputes the chunk's token states from it (the same arithmetic),
    T / C + C states at a time instead of T.

    Returns (o, the final S, and with ``intermediate`` the state entering each chunk
    [B, NT, HV, K, V], else None)."""

    def step(S, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B, HV, K], [B, HV, K], [B, HV, V], [B, HV, K], [B, HV]
        S = S * jnp.exp(g_t)[..., None]
        pred = jnp.einsum("bhk,bhkv->bhv", k_t, S, precision=_HI)
        S = S + jnp.einsum("bhk,bhv->bhkv", b_t[..., None] * k_t, v_t - pred, precision=_HI)
        o_t = jnp.einsum("bhk,bhkv->bhv", q_t, S, precision=_HI)
        return S, o_t

    @jax.checkpoint
    def chunk(S, xs):
        S_end, o = lax.scan(step, S, xs)
        return S_end, (o, S)

    T = q.shape[1]
    C = chunk_size if intermediate else max(1, min(chunk_size, T))
    NT = -(-T // C)
    # padding tokens (k = beta = g = 0) leave the state as it is: the last chunk's end state is final
    xs = [jnp.pad(jnp.moveaxis(x, 1, 0), [(0, NT * C - T)] + [(0, 0)] * (x.ndim - 1)) for x in (q, k, v, g, beta)]
    S, (o, h) = lax.scan(chunk, S, tuple(x.reshape((NT, C) + x.shape[1:]) for x in xs))
    o = jnp.moveaxis(o.reshape((NT * C,) + o.shape[2:])[:T], 0, 1)
    return o, S, (jnp.moveaxis(h, 0, 1) if intermediate else None)


def _chunk_one(q, k, v, g, beta, S, chunk_size):
    """Plain chunked form: WY representation, pairwise gate differences, triangular solve."""
    B, T, HV, K = k.shape
    C = chunk_size
    pad = -T % C
    widths = ((0, 0), (0, pad), (0, 0), (0, 0))
    q, k, v, g = (jnp.pad(x, widths) for x in (q, k, v, g))
    beta = jnp.pad(beta, widths[:3])
    n = (T + pad) // C
    # [n, B, HV, C, D]
    q, k, v, g = (x.reshape(B, n, C, HV, -1).transpose(1, 0, 3, 2, 4) for x in (q, k, v, g))
    beta = beta.reshape(B, n, C, HV).transpose(1, 0, 3, 2)
    G = jnp.cumsum(g, axis=-2)
    incl = jnp.tril(jnp.ones((C, C), bool))
    # exp(G_i - G_j) for j <= i, exactly, as a [C, C, K] tensor per chunk.
    diff = G[..., :, None, :] - G[..., None, :, :]
    decay = jnp.exp(jnp.where(incl[:, :, None], diff, -jnp.inf))
    Akk = jnp.einsum("...ik,...jk,...ijk->...ij", k, k, decay, precision=_HI)
    Akk = beta[..., :, None] * jnp.where(jnp.tril(incl, -1), Akk, 0.0)
    Aqk = jnp.einsum("...ik,...jk,...ijk->...ij", q, k, decay, precision=_HI)
    eye = jnp.eye(C, dtype=k.dtype)
    rhs = jnp.concatenate([beta[..., None] * k * jnp.exp(G), beta[..., None] * v], -1)
    wu = jax.scipy.linalg.solve_triangular(eye + Akk, rhs, lower=True)
    w, u = wu[..., :K], wu[..., K:]

    def step(S, xs):
        q_c, k_c, G_c, w_c, u_c, Aqk_c = xs
        v_new = u_c - jnp.einsum("bhck,bhkv->bhcv", w_c, S, precision=_HI)
        o_c = jnp.einsum("bhck,bhkv->bhcv", q_c * jnp.exp(G_c), S, precision=_HI)
        o_c = o_c + jnp.einsum("bhij,bhjv->bhiv", Aqk_c, v_new, precision=_HI)
        G_end = G_c[..., -1, :]
        k_dec = k_c * jnp.exp(G_end[..., None, :] - G_c)
        S = S * jnp.exp(G_end)[..., None] + jnp.einsum("bhck,bhcv->bhkv", k_dec, v_new, precision=_HI)
        return S, o_c

    S, o = lax.scan(step, S, (q, k, G, w, u, Aqk))
    o = o.transpose(1, 0, 3, 2, 4).reshape(B, n * C, HV, -1)[:, :T]
    return o, S, None


def _run(
    one: Callable, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size=None, h_dtype=None
):
    """(o, final state or None, per-chunk states or None as ``one`` gives them, for every sequence),
    the arguments checked as every entry point checks them (:func:`check_inputs`); the states in
    ``h_dtype`` (default q's dtype)."""
    cu_seqlens = offsets(cu_seqlens)
    check_inputs(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size
    )
    if isinstance(cu_seqlens, jax.core.Tracer):
        fail("cu_seqlens", "a concrete array with the references (they loop over sequences)", "a tracer")
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale)
    B, _, HV, K = k.shape
    V = v.shape[-1]
    if cu_seqlens is None:
        S0 = jnp.zeros((B, HV, K, V), q.dtype) if initial_state is None else initial_state.astype(q.dtype)
        o, S, h = one(q, k, v, g, beta, S0)
    else:
        bounds = np.asarray(cu_seqlens)  # the reference needs concrete sequence boundaries
        outs, states, hs = [], [], []
        for n in range(len(bounds) - 1):
            a, b = int(bounds[n]), int(bounds[n + 1])
            S0 = (
                jnp.zeros((1, HV, K, V), q.dtype) if initial_state is None else initial_state[n : n + 1].astype(q.dtype)
            )
            if b > a:  # a sequence without tokens has no chunk
                o_n, S0, h_n = one(*(x[:, a:b] for x in (q, k, v, g, beta)), S0)
                outs.append(o_n)
                hs.append(h_n)
            states.append(S0)
        o = jnp.concatenate(outs, axis=1) if outs else jnp.zeros((1, 0, HV, V), q.dtype)
        S = jnp.concatenate(states, axis=0)
        h = jnp.concatenate(hs, axis=1) if hs and hs[0] is not None else None
    h = None if h is None else h.astype(h_dtype or out_dtype)
    return o.astype(out_dtype), (S if output_final_state else None), h


def naive_recurrent_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: jax.Array | Sequence[int] | None = None,
    return_intermediate_states: bool = False,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array | None] | tuple[jax.Array, jax.Array | None, jax.Array]:
    """KDA by the token-by-token recurrence of SPEC.md (``lax.scan`` over time): the reference,
    float64-capable, differentiable by autodiff (which keeps the state entering each chunk of
    ``chunk_size`` tokens and recomputes the chunk's token states: T / C + C states, not T).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V], HV a multiple of H.
        g: [B, T, HV, K] log-space decay (<= 0); beta: [B, T, HV].
        scale: the scale of q (K ** -0.5 when None).
        initial_state: [N, HV, K, V] or None (zeros).
        output_final_state: return the final states.
        cu_seqlens: [N + 1] concrete int offsets of packed sequences (B = 1), or None.
        return_intermediate_states: return the state entering each chunk too.
        chunk_size: the chunk those states are taken at.

    Returns:
        ``(o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] or None)``, and with
        ``return_intermediate_states`` a third output: the state entering each chunk in q's
        dtype (FLA's ``h``), [B, NT, HV, K, V] with NT = ceil(T / chunk_size), or with
        ``cu_seqlens`` [1, total chunks, HV, K, V], each sequence's chunks in turn.
    """
    one = functools.partial(_recurrent_one, chunk_size=chunk_size, intermediate=return_intermediate_states)
    chunk = chunk_size if return_intermediate_states else None
    o, S, h = _run(one, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk)
    return (o, S, h) if return_intermediate_states else (o, S)


def naive_token_states(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    """:func:`naive_recurrent_kda` with the state after every token (speculative decoding's
    per-token slots, :func:`kdax.fused_recurrent_kda`'s ``num_accepted_tokens``).

    Args:
        q, k, v, g, beta, scale, initial_state, cu_seqlens: as :func:`naive_recurrent_kda`.

    Returns:
        ``(o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V], states [B, T, HV, K, V])``,
        the states in the compute dtype (float32, or float64 for float64 inputs).
    """

    def one(q, k, v, g, beta, S):
        o, S, h = _recurrent_one(q, k, v, g, beta, S, chunk_size=1, intermediate=True)
        return o, S, jnp.concatenate([h[:, 1:], S[:, None]], axis=1)  # h[t]: the state entering token t

    dt = jnp.promote_types(q.dtype, jnp.float32)  # T >= 1: some sequence has tokens, so states is not None
    return _run(one, q, k, v, g, beta, scale, initial_state, True, cu_seqlens, h_dtype=dt)


def naive_chunk_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: jax.Array | Sequence[int] | None = None,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array | None]:
    """KDA by the plain chunked algorithm: pairwise ``exp(G_i - G_j)``, exact triangular solve.
    A second reference (it overflows in float32 under strong decay; use float64).

    Args:
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens: as
            :func:`naive_recurrent_kda`.
        chunk_size: the chunk length C; memory grows as C * C * K per chunk.

    Returns:
        ``(o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] or None)``.
    """

    def one(q, k, v, g, beta, S):
        return _chunk_one(q, k, v, g, beta, S, chunk_size)

    return _run(one, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size)[:2]


CAPABILITIES = Capabilities("naive", portable=True, reference=True)
