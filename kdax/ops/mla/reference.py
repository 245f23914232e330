"""The reference: each token's request's pages gathered whole, one softmax (float64-capable)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kdax.ops.common.capabilities import Capabilities


def naive_paged_latent_attention(q, pages, page_table, query_start_loc, seq_lens, *, scale):
    """Each token over its request's entries up to its position, keys and values the entries.

    Args:
        q: [T, H, W] queries, zero past the keys' width.
        pages: [P, page, W] entries; page_table [R, M] (-1: none); query_start_loc [R + 1];
            seq_lens [R] (a request's new tokens are its last ones).
        scale: the scores' scale.

    Returns:
        [T, H, W] in float32 (float64 inputs: float64); zeros for padding tokens.
    """
    T = q.shape[0]
    R, M = page_table.shape
    P, page, _ = pages.shape
    qsl = query_start_loc.astype(jnp.int32)
    t = jnp.arange(T, dtype=jnp.int32)
    r = jnp.clip(jnp.searchsorted(qsl[1:], t, side="right"), 0, R - 1)
    pos = seq_lens[r] - (qsl[r + 1] - t)
    live = t < qsl[R]
    table = page_table[r]  # [T, M]
    view = jnp.take(pages, jnp.where(table < 0, P, table), axis=0, mode="fill", fill_value=0)
    view = view.reshape(T, M * page, -1)  # [T, S, W]
    f = jnp.promote_types(q.dtype, jnp.float32)
    s = jnp.einsum("thw,tsw->ths", q.astype(f), view.astype(f)) * scale
    ok = (jnp.arange(M * page) <= pos[:, None]) & live[:, None]
    p = jax.nn.softmax(jnp.where(ok[:, None], s, -jnp.inf), axis=-1)
    p = jnp.where(live[:, None, None], p, 0)
    return jnp.einsum("ths,tsw->thw", p, view.astype(f))


CAPABILITIES = Capabilities(
    "naive", cores={"paged_latent_attention": naive_paged_latent_attention}, portable=True, reference=True
)
