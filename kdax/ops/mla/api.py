"""The public entry point: argument checks, backend dispatch."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from kdax.ops.common.dispatch import BACKENDS, OpBackends, register
from kdax.ops.common.sharding import heads_axis, per_shard
from kdax.ops.common.validation import fail
from kdax.ops.mla import pallas_tpu, reference, xla

RECORDS = {c.name: c for c in (xla.CAPABILITIES, pallas_tpu.CAPABILITIES, reference.CAPABILITIES)}
_KERNELS = tuple(n for n, c in RECORDS.items() if not c.portable)
_OP = register(OpBackends("paged_latent_attention", _KERNELS, {n: RECORDS[n].config for n in _KERNELS}))
_ROLES = ((None, "heads", None), None, None, None, None)


def paged_latent_attention(
    q, pages, page_table, query_start_loc, seq_lens, *, scale: float, backend: str = "auto", config=None
):
    """Causal attention of an engine step's ragged tokens over their requests' pages, where an
    entry is both key and value (MLA's absorbed form: the latent and the rope key, one head shared
    by all query heads).

    Token t of request r (``query_start_loc[r] <= t < query_start_loc[r + 1]``) sits at position
    ``seq_lens[r] - (query_start_loc[r + 1] - t)`` and attends to the request's entries at
    positions up to its own: position p at row ``p % page`` of page ``page_table[r, p // page]``.
    Its entries must be in the pages already (this step's too).

    Args:
        q: [T, H, D] queries (D <= W: they meet an entry's first D features).
        pages: [P, page, W] the entries.
        page_table: [R, M] int, each request's pages in position order (-1: none).
        query_start_loc: [R + 1] int, nondecreasing from 0; tokens past the last are padding.
        seq_lens: [R] int, each request's tokens after the step.
        scale: the scores' scale.
        backend: "auto", "naive", "xla" or "pallas_tpu".
        config: the TPU kernel's :class:`kdax.ops.mla.pallas_tpu.Config`, or None.

    Returns:
        o [T, H, W] float32 (float64 for float64 inputs): each token's softmax-weighted entries;
        zeros for padding tokens.

    Raises:
        ValueError: arrays of the wrong rank, sizes or dtypes; an unknown backend.
    """
    if backend not in BACKENDS:
        fail("backend", f"one of {BACKENDS}", repr(backend))
    if jnp.ndim(q) != 3 or not jnp.issubdtype(q.dtype, jnp.floating):
        fail("q", "floats [T, H, D]", f"{jnp.shape(q)} {getattr(q, 'dtype', None)}")
    if jnp.ndim(pages) != 3 or not jnp.issubdtype(pages.dtype, jnp.floating):
        fail("pages", "floats [P, page, W]", f"{jnp.shape(pages)} {getattr(pages, 'dtype', None)}")
    T, H, D = q.shape
    W = pages.shape[2]
    if D > W:
        fail("q", f"a last dim <= the entries' width {W}", f"D={D}")
    if jnp.ndim(page_table) != 2 or not jnp.issubdtype(page_table.dtype, jnp.integer):
        fail("page_table", "ints [R, M]", f"{jnp.shape(page_table)}")
    R = page_table.shape[0]
    if jnp.shape(query_start_loc) != (R + 1,) or not jnp.issubdtype(query_start_loc.dtype, jnp.integer):
        fail("query_start_loc", f"ints [R + 1 = {R + 1}]", f"{jnp.shape(query_start_loc)}")
    if jnp.shape(seq_lens) != (R,) or not jnp.issubdtype(seq_lens.dtype, jnp.integer):
        fail("seq_lens", f"ints [R = {R}]", f"{jnp.shape(seq_lens)}")
    q = jnp.pad(q, ((0, 0), (0, 0), (0, W - D)))
    backend, cfg = _OP.resolve(backend, q.dtype, config)
    caps = RECORDS[backend]
    static = {"scale": scale} | ({"cfg": cfg} if caps.config else {})
    run = functools.partial(caps.cores["paged_latent_attention"], **static)
    args = (q, pages, page_table.astype(jnp.int32), query_start_loc.astype(jnp.int32), seq_lens.astype(jnp.int32))
    return per_shard(run, args, _ROLES, (None, "heads", None), heads_axis())
