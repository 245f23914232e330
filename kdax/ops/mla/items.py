"""The work list shared by the XLA op and the TPU kernel (docs/mla_paged.md).

The flat token row is cut into query blocks of ``block_q`` tokens. A work item is one request's
tokens within one block: a block spanning requests r .. r' gives items r .. r', a block of padding
alone gives one item with no request. There are at most ``T / block_q + R`` items, in block order;
an item reads its request's pages once, ``block_k`` keys a step, up to its last token's position.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Items(NamedTuple):
    """The work items, each an int32 array [W] (W = blocks + R; dead items after the live ones).

    Attributes:
        block: the item's query block (dead items: the last block).
        request: its request, -1 for a padding block or a dead item.
        first: 1 for the first item of its block (it writes the block's other rows as zeros).
        lo, hi: its tokens within the block, ``[lo, hi)``.
        offset: the position of the block's token i in the request is ``i + offset``.
        steps: the key blocks it reads (0: none).
    """

    block: jax.Array
    request: jax.Array
    first: jax.Array
    lo: jax.Array
    hi: jax.Array
    offset: jax.Array
    steps: jax.Array


def query_block(T: int, R: int, H: int = 1) -> int:
    """The tokens of a query block by default: the tokens a request has on average, a power of
    two from 8 (decode steps: one request a block, few wasted rows) to 128 (prefill chunks: each
    page read once every 128 tokens), and at most 1024 rows of tokens x ``H`` heads above 8 (a
    block's queries, output and scores stay within the kernel's VMEM: 32 heads at 128 tokens
    overflow it)."""
    n = 8
    while n < 128 and n * max(R, 1) < T and 2 * n * H <= 1024:
        n *= 2
    return n


def work_items(query_start_loc, seq_lens, T: int, block_q: int, block_k: int) -> Items:
    """The :class:`Items` of a step of T tokens (int32 ``query_start_loc`` [R + 1], ``seq_lens``
    [R]: a request's tokens after the step; its new tokens are its last ones)."""
    i32 = jnp.int32
    R = seq_lens.shape[0]
    qsl = query_start_loc.astype(i32)
    live = qsl[R]
    nb = -(-T // block_q)
    request_of = lambda t: jnp.clip(jnp.searchsorted(qsl[1:], t, side="right"), 0, R - 1).astype(i32)
    j = jnp.arange(nb, dtype=i32)
    used = j * block_q < live
    lo_r = request_of(j * block_q)
    hi_r = request_of(jnp.minimum((j + 1) * block_q, live) - 1)
    count = jnp.where(used, hi_r - lo_r + 1, 1)
    ends = jnp.cumsum(count)
    w = jnp.arange(nb + R, dtype=i32)
    block = jnp.minimum(jnp.searchsorted(ends, w, side="right").astype(i32), nb - 1)
    start = ends[block] - count[block]
    dead = w >= ends[-1]
    request = jnp.where(dead | ~used[block], -1, lo_r[block] + w - start)
    r = jnp.maximum(request, 0)
    lo = jnp.clip(qsl[r] - block * block_q, 0, block_q)
    hi = jnp.where(request >= 0, jnp.clip(qsl[r + 1] - block * block_q, 0, block_q), 0)
    lo = jnp.minimum(lo, hi)
    computed = seq_lens.astype(i32) - (qsl[1:] - qsl[:-1])
    offset = computed[r] - qsl[r] + block * block_q
    steps = jnp.where(hi > lo, (offset + hi - 1) // block_k + 1, 0)
    first = ((w == start) & ~dead).astype(i32)
    return Items(block, request, first, lo, hi, offset, steps)


def to_blocks(q: jax.Array, block_q: int) -> jax.Array:
    """q [T, H, D] as query blocks, heads major within a block: [blocks, H * block_q, D] (row
    ``h * block_q + i`` is token i of the block, head h)."""
    T, H, D = q.shape
    nb = -(-T // block_q)
    q = jnp.pad(q, ((0, nb * block_q - T), (0, 0), (0, 0)))
    return q.reshape(nb, block_q, H, D).transpose(0, 2, 1, 3).reshape(nb, H * block_q, D)


def from_blocks(o: jax.Array, T: int, H: int) -> jax.Array:
    """The inverse of :func:`to_blocks`: [blocks, H * block_q, D] -> [T, H, D]."""
    nb, rows, D = o.shape
    block_q = rows // H
    return o.reshape(nb, H, block_q, D).transpose(0, 2, 1, 3).reshape(nb * block_q, H, D)[:T]
