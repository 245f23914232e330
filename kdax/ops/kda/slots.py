"""KDA states kept in one pool of slots, as serving engines keep them (SPEC.md, "Serving interface").

A call with ``ssm_state_indices`` reads each sequence's initial state from the pool, runs the op
as it runs without slots, and writes the final state (or, for speculative decoding, the state
after every token) back into the pool. The reads gather N states and the writes scatter N (or one
per token); under ``jax.jit`` with the pool donated the scatter updates the pool in place, so a
call costs O(tokens) whatever the number of slots S. The decode kernels instead address the pool
themselves (:func:`kernel_tables` gives them the slots; :func:`kdax.ops.kda.decode.fused_recurrent_slots`).

Shapes: pool [S, HV, K, V] ([S, HV, V, K] with ``state_v_first``); indices [N] (one slot per
sequence) or [N, Tmax] (one per token) with accepted [N] in [1, Tmax]. A negative index is a
padding row: it reads zeros and writes nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kdax.ops.common.validation import check_array, fail


def check(pool, indices, accepted, *, N: int, state_shape: tuple, per_token: bool, lengths) -> None:
    """Check the pool and the slots of a call with ``ssm_state_indices``.

    Args:
        pool: the ``initial_state`` argument, [S, *state_shape].
        indices: ``ssm_state_indices``, int [N] or (``per_token``) [N, Tmax].
        accepted: ``num_accepted_tokens``, int [N] or None.
        N: the sequences of the call.
        state_shape: (HV, K, V), or (HV, V, K) with ``state_v_first``.
        per_token: whether the op takes [N, Tmax] indices (fused_recurrent_kda).
        lengths: the tokens of each sequence, a NumPy array where known, else None.

    Raises:
        ValueError: naming the first argument that is not as above, or whose concrete values are
            out of range: slots >= S, a slot written twice, a sequence starting from a slot that
            another sequence writes (the kernels read and write the pool in place, so the call
            would race), accepted counts outside [1, Tmax], a sequence longer than Tmax.
    """
    if pool is None:
        fail("initial_state", f"the state pool [S, {', '.join(map(str, state_shape))}] with ssm_state_indices", None)
    check_array("initial_state", pool, 4)
    if tuple(pool.shape[1:]) != tuple(state_shape) or pool.shape[0] < 1:
        fail("initial_state", f"a state pool of shape (S, {', '.join(map(str, state_shape))})", tuple(pool.shape))
    S = pool.shape[0]
    if not hasattr(indices, "ndim") or indices.ndim not in ((1, 2) if per_token else (1,)):
        shapes = f"int [{N}] or [{N}, Tmax]" if per_token else f"int [{N}] (one slot per sequence)"
        fail("ssm_state_indices", shapes, getattr(indices, "shape", type(indices).__name__))
    check_array("ssm_state_indices", indices, indices.ndim, integer=True)
    if indices.shape[0] != N:
        fail("ssm_state_indices", f"one row per sequence ({N})", f"shape {tuple(indices.shape)}")
    if accepted is not None:
        if indices.ndim != 2:
            fail("num_accepted_tokens", "None unless ssm_state_indices is [N, Tmax] (one slot per token)", "an array")
        check_array("num_accepted_tokens", accepted, 1, (N,), integer=True)
    Tmax = indices.shape[1] if indices.ndim == 2 else None
    if Tmax is not None and lengths is not None and lengths.size and lengths.max() > Tmax:
        fail("ssm_state_indices", f"a slot per token: Tmax >= the longest sequence ({lengths.max()})", f"Tmax={Tmax}")
    if not isinstance(indices, jax.core.Tracer):
        idx = np.asarray(indices)
        if Tmax is not None and lengths is not None:  # only the slots of real tokens are written
            idx = np.where(np.arange(Tmax)[None] < lengths[:, None], idx, -1)
        used = idx[idx >= 0]
        if used.size and used.max() >= S:
            fail("ssm_state_indices", f"slots in [0, {S}) or negative (padding)", f"slot {used.max()}")
        if np.unique(used).size != used.size:
            fail("ssm_state_indices", "each slot written at most once per call", f"{np.asarray(indices).tolist()}")
        if Tmax is not None and (accepted is None or not isinstance(accepted, jax.core.Tracer)):
            start = _starts(np.asarray(indices), None if accepted is None else np.asarray(accepted), np)
            writer = {int(slot): n for n, row in enumerate(idx) for slot in row if slot >= 0}
            for n, slot in enumerate(start.tolist()):
                if writer.get(slot, n) != n:
                    fail(
                        "ssm_state_indices",
                        "no sequence starting from a slot that another sequence of the call writes",
                        f"sequence {n} starts from slot {slot}, which sequence {writer[slot]} writes",
                    )
    if accepted is not None and not isinstance(accepted, jax.core.Tracer):
        acc = np.asarray(accepted)
        if acc.size and (acc.min() < 1 or acc.max() > Tmax):
            fail("num_accepted_tokens", f"counts in [1, Tmax={Tmax}]", acc.tolist())


def _valid(indices, S):
    """Negative indices (padding) as S, one past the last slot, which reads zeros and writes nothing."""
    return jnp.where(indices < 0, S, indices).astype(jnp.int32)


def _starts(indices, accepted, xp=jnp):
    """Each sequence's start slot [N]: ``indices`` [N], or column ``accepted - 1`` of [N, Tmax]
    (column 0 without ``accepted``; counts clipped to [1, Tmax]). ``xp``: jnp, or np for the
    concrete values :func:`check` reads (inside a jit trace jnp would make them tracers)."""
    if indices.ndim == 1:
        return indices
    col = xp.zeros(indices.shape[:1], xp.int32) if accepted is None else accepted.astype(xp.int32) - 1
    col = xp.clip(col, 0, indices.shape[1] - 1)
    return xp.take_along_axis(indices, col[:, None], axis=1)[:, 0]


def read(pool, indices, accepted=None):
    """The initial state of each sequence.

    Args:
        pool: [S, ...].
        indices: [N], or [N, Tmax] (then the start is column ``accepted - 1``, column 0 without ``accepted``).
        accepted: [N] or None; traced counts are clipped to [1, Tmax].

    Returns:
        [N, ...] in the pool's dtype, zeros for padding rows.
    """
    return jnp.take(pool, _valid(_starts(indices, accepted), pool.shape[0]), axis=0, mode="fill", fill_value=0)


def kernel_tables(S: int, indices, accepted, T: int):
    """The slots of a call on rows of T tokens as the decode kernel reads them (-1: none, for
    padding rows and slots out of range).

    Args:
        S: the pool's slots; indices: [N] or [N, Tmax >= T]; accepted: [N] or None; T >= 1.

    Returns:
        (read [N] int32: each row's start slot, write [N, T] int32: where the state after each
        token goes; with one slot per sequence only the last token's state is written).
    """
    ok = lambda i: jnp.where((i >= 0) & (i < S), i, -1).astype(jnp.int32)
    start = _starts(indices, accepted)
    last = jnp.arange(T) == T - 1
    write = indices[:, :T] if indices.ndim == 2 else jnp.where(last[None], indices[:, None], -1)
    return ok(start), ok(write)


def write(pool, indices, states):
    """``pool`` with ``states[n]`` at slot ``indices[n]`` (padding rows and out-of-range slots dropped).

    Args:
        pool: [S, ...]; indices: [M] ints; states: [M, ...].

    Returns:
        The updated pool, in its dtype.
    """
    return pool.at[_valid(indices, pool.shape[0])].set(states.astype(pool.dtype), mode="drop")


def write_tokens(pool, indices, states, cu_seqlens):
    """``pool`` with the state after each token written to that token's slot.

    Args:
        pool: [S, ...].
        indices: [N, Tmax]: token t of sequence n writes ``indices[n, t]``.
        states: [B, T, ...] the state after each token: B = N rows, or with ``cu_seqlens`` one row of
            packed sequences.
        cu_seqlens: [N + 1] offsets, or None.

    Returns:
        The updated pool.
    """
    B, T = states.shape[:2]
    Tmax = indices.shape[1]
    t = jnp.arange(T, dtype=jnp.int32)
    if cu_seqlens is None:
        seq, pos = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, T)), jnp.broadcast_to(t, (B, T))
    else:
        cu = cu_seqlens.astype(jnp.int32)
        seq = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
        seq = jnp.minimum(seq, indices.shape[0] - 1)[None]
        pos = t[None] - cu[seq]
    slot = jnp.where(pos < Tmax, indices[seq, jnp.clip(pos, 0, Tmax - 1)], -1)
    return write(pool, slot.reshape(-1), states.reshape(B * T, *states.shape[2:]))
