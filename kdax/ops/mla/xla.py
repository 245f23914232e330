"""The portable op: work items (:mod:`kdax.ops.mla.items`) over their requests' pages, ``block_k``
keys a loop step, with an online softmax; the temporaries are a step's gathered pages and scores
([W, block_k, width] and [W, H * block_q, block_k]), never a token's whole context."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kdax.ops.common.capabilities import Capabilities
from kdax.ops.mla.items import from_blocks, query_block, to_blocks, work_items


def paged_latent_attention_xla(q, pages, page_table, query_start_loc, seq_lens, *, scale, block_q=None, block_k=None):
    """:func:`kdax.ops.mla.api.paged_latent_attention` in XLA ops; ``block_k`` a multiple of the page
    (None: the most whole pages in 512 keys, at least one), ``block_q`` None: :func:`query_block`'s."""
    T, H, Wd = q.shape
    R, M = page_table.shape
    page = pages.shape[1]
    block_q = query_block(T, R, H) if block_q is None else block_q
    block_k = max(1, 512 // page) * page if block_k is None else block_k
    per = block_k // page
    it = work_items(query_start_loc, seq_lens, T, block_q, block_k)
    f = jnp.promote_types(q.dtype, jnp.float32)
    qb = to_blocks(q, block_q)[it.block].astype(f)  # [W, rows, Wd]
    rows = qb.shape[1]
    tok = jnp.arange(rows, dtype=jnp.int32) % block_q
    member = (tok >= it.lo[:, None]) & (tok < it.hi[:, None])  # [W, rows]
    pos = tok + it.offset[:, None]
    table = page_table[jnp.maximum(it.request, 0)]  # [W, M]

    def step(b, state):
        m, l, acc = state
        cols = jnp.minimum(b * per + jnp.arange(per), M - 1)
        kv = pages[jnp.maximum(table[:, cols], 0)].reshape(-1, block_k, Wd).astype(f)  # [W, block_k, Wd]
        s = jnp.einsum("wrd,wsd->wrs", qb, kv) * scale
        key = b * block_k + jnp.arange(block_k, dtype=jnp.int32)
        ok = member[:, :, None] & (key <= pos[:, :, None]) & (b < it.steps)[:, None, None]
        s = jnp.where(ok, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        ref = jnp.where(m_new == -jnp.inf, 0, m_new)
        p = jnp.exp(s - ref[..., None])
        alpha = jnp.exp(m - ref)
        return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + jnp.einsum("wrs,wsd->wrd", p, kv)

    W = qb.shape[0]
    state = jnp.full((W, rows), -jnp.inf, f), jnp.zeros((W, rows), f), jnp.zeros((W, rows, Wd), f)
    _, l, acc = lax.fori_loop(0, jnp.max(it.steps), step, state)
    o = jnp.where((member & (l > 0))[..., None], acc / jnp.where(l > 0, l, 1)[..., None], 0)
    blocks = jnp.zeros((-(-T // block_q), rows, Wd), f).at[it.block].add(o)  # a row belongs to one item
    return from_blocks(blocks, T, H)


CAPABILITIES = Capabilities("xla", cores={"paged_latent_attention": paged_latent_attention_xla}, portable=True)
