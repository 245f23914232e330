"""Chunk layout for fixed-length batches and packed variable-length sequences.

Every chunked backend works on a padded token axis of ``n_chunks * chunk_size`` slots
in which each sequence starts on a chunk boundary, so no chunk mixes two sequences.
Sequence boundaries (``cu_seqlens``) may be traced; only their number ``N`` is static,
so the padded length is the static bound ``sum(ceil(L_n / C)) <= (T + N (C - 1)) // C``.
Concrete offsets are checked by the ops; traced ones are made valid (:func:`valid_offsets`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import checkify


class ChunkLayout(NamedTuple):
    """Where tokens sit in the padded chunk axis: ``N`` sequences, ``NC`` chunks of size C.

    Attributes:
        slot_token: [NC * C] int32, the packed token index of each slot, or None (plain padding).
        slot_valid: [NC * C] bool, the slot holds a real token (None with plain padding).
        token_slot: [T] int32, the slot of each token (None with plain padding).
        chunk_seq: [NC] int32, the sequence of each chunk.
        chunk_first: [NC] bool, the chunk starts its sequence (the state resets to h0).
        chunk_last: [NC] bool, the chunk ends its sequence (its end state is final).
        seq_chunk_start: [N] int32, the first chunk of each sequence.
        seq_chunk_end: [N] int32, one past its last chunk (= start for a sequence with no tokens).
        chunk_size: C.
        num_tokens: T.
    """

    slot_token: jax.Array | None  # [NC * C] int32 packed token index of each slot, or None (plain padding)
    slot_valid: jax.Array | None  # [NC * C] bool, slot holds a real token
    token_slot: jax.Array | None  # [T] int32 slot of each token
    chunk_seq: jax.Array  # [NC] int32 sequence of each chunk
    chunk_first: jax.Array  # [NC] bool, chunk starts its sequence (state resets to h0)
    chunk_last: jax.Array  # [NC] bool, chunk ends its sequence (its end state is final)
    seq_chunk_start: jax.Array  # [N] int32 first chunk of each sequence
    seq_chunk_end: jax.Array  # [N] int32 one past its last chunk (= start for a sequence with no tokens)
    chunk_size: int
    num_tokens: int

    @property
    def n_chunks(self) -> int:
        """NC, the chunks."""
        return self.chunk_seq.shape[0]

    @property
    def seq_empty(self) -> jax.Array:
        """[N] bool, sequence has no tokens (no chunk of its own)."""
        return self.seq_chunk_start == self.seq_chunk_end

    def pack(self, x: jax.Array, fill: float = 0.0) -> jax.Array:
        """Scatter tokens into the chunk axis.

        Args:
            x: [B, T, ...].
            fill: the value of padding slots.

        Returns:
            [B, NC * C, ...] in x's dtype.
        """
        if self.slot_token is None:
            pad = self.n_chunks * self.chunk_size - self.num_tokens
            return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        mask = self.slot_valid.reshape((1, -1) + (1,) * (x.ndim - 2))
        return jnp.where(mask, jnp.take(x, self.slot_token, axis=1), jnp.full((), fill, x.dtype))

    def zero_unused(self, x: jax.Array) -> jax.Array:
        """[B, NC, ...] per-chunk values with the chunks no sequence uses (those past the last
        sequence's under ``cu_seqlens``: the static bound exceeds their number) set to 0."""
        if self.slot_token is None:
            return x
        used = jnp.arange(self.n_chunks) < self.seq_chunk_end[-1]
        return jnp.where(used.reshape((1, -1) + (1,) * (x.ndim - 2)), x, jnp.zeros((), x.dtype))

    def unpack(self, x: jax.Array) -> jax.Array:
        """Gather tokens back from the chunk axis (the inverse of :meth:`pack`).

        Args:
            x: [B, NC * C, ...].

        Returns:
            [B, T, ...] in x's dtype.
        """
        if self.token_slot is None:
            return x[:, : self.num_tokens]
        return jnp.take(x, self.token_slot, axis=1)


def valid_offsets(cu_seqlens: jax.Array, num_tokens: int, check: bool = False) -> jax.Array:
    """Offsets as the ops take them when they cannot be checked (traced): clipped to [0, T],
    non-decreasing (a running maximum), the first 0 and the last T. Valid offsets are unchanged.

    Args:
        cu_seqlens: [N + 1] ints.
        num_tokens: T.
        check: also ``checkify.check`` that they were valid (:func:`kdax.debug_checks`).

    Returns:
        [N + 1] int32.
    """
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    if check:
        ok = (cu[0] == 0) & (cu[-1] == num_tokens) & jnp.all(cu[1:] >= cu[:-1])
        checkify.check(
            ok, f"cu_seqlens: expected offsets from 0 to T = {num_tokens}, non-decreasing, got {{cu}}", cu=cu
        )
    cu = lax.cummax(jnp.clip(cu, 0, num_tokens), axis=0)
    return cu.at[0].set(0).at[-1].set(num_tokens)


def chunk_layout(num_tokens: int, chunk_size: int, cu_seqlens: jax.Array | None = None) -> ChunkLayout:
    """Layout of ``num_tokens`` tokens in chunks of ``chunk_size``.

    Without ``cu_seqlens``: one sequence per batch row, padded at the end.
    With ``cu_seqlens`` [N + 1] (B must be 1): N packed sequences, each padded to chunks.

    Args:
        num_tokens: T.
        chunk_size: C.
        cu_seqlens: [N + 1] int offsets (may be traced; not checked), or None.

    Returns:
        The :class:`ChunkLayout`.
    """
    T, C = num_tokens, chunk_size
    i32 = jnp.int32
    if cu_seqlens is None:
        NC = max(1, -(-T // C))
        c = jnp.arange(NC, dtype=i32)
        first, ends = jnp.zeros((1,), i32), jnp.full((1,), NC, i32)
        return ChunkLayout(None, None, None, jnp.zeros((NC,), i32), c == 0, c == NC - 1, first, ends, C, T)
    cu = cu_seqlens.astype(i32)
    N = cu.shape[0] - 1
    NC = max(1, (T + N * (C - 1)) // C)
    # A traced cu_seqlens cannot be checked: clamping keeps malformed offsets (decreasing, or
    # past T) from sending the kernels' chunk loops outside the NC chunks. Valid ones are unchanged.
    lengths = jnp.maximum(cu[1:] - cu[:-1], 0)  # [N]
    n_seq_chunks = (lengths + C - 1) // C  # [N]
    ends = jnp.cumsum(n_seq_chunks)
    chunk_end = jnp.minimum(ends, NC)  # [N] exclusive end chunk of each sequence
    chunk_start = jnp.minimum(ends - n_seq_chunks, NC)  # [N]
    c = jnp.arange(NC, dtype=i32)
    # Sequence of each chunk; chunks past the last sequence get N - 1 and hold no tokens.
    chunk_seq = jnp.minimum(jnp.searchsorted(chunk_end, c, side="right"), N - 1).astype(i32)
    used = c < chunk_end[-1]
    chunk_first = used & (c == chunk_start[chunk_seq])
    chunk_last = used & (c == chunk_end[chunk_seq] - 1)
    s = jnp.arange(NC * C, dtype=i32)
    seq_of_slot = chunk_seq[s // C]
    pos = s - chunk_start[seq_of_slot] * C  # position of the slot inside its sequence
    slot_valid = (pos < lengths[seq_of_slot]) & used[s // C]
    slot_token = jnp.where(slot_valid, cu[seq_of_slot] + pos, 0)
    t = jnp.arange(T, dtype=i32)
    seq_of_token = jnp.searchsorted(cu[1:], t, side="right").astype(i32)
    token_slot = chunk_start[seq_of_token] * C + t - cu[seq_of_token]
    return ChunkLayout(
        slot_token,
        slot_valid,
        token_slot,
        chunk_seq,
        chunk_first,
        chunk_last,
        chunk_start.astype(i32),
        chunk_end.astype(i32),
        C,
        T,
    )
