"""Paged caches: entries of ``page_size`` tokens in pages ``[P, page_size, ...]``, each request's
pages listed in position order in its row of a page table ``[R, M]`` (-1: no page). Shared by
:mod:`kdax.serving.step` and the vLLM plugin (docs/serving.md)."""

from __future__ import annotations

import jax.numpy as jnp


def page_view(pages, table):
    """Each row's cache as a layer takes it: [R, M * page_size, ...] from pages [P, page_size, ...]
    and the page table [R, M] (-1: no page; its entries read as zeros)."""
    P, size = pages.shape[:2]
    rows = jnp.take(pages, jnp.where(table < 0, P, table), axis=0, mode="fill", fill_value=0)
    return rows.reshape(table.shape[0], table.shape[1] * size, *pages.shape[2:])


def flat_rows(table, rows, positions, page_size: int):
    """Where positions lie in the pages flattened to [P * page_size, ...]: int32 of positions' shape.

    Args:
        table: [R, M] the page table (-1: no page).
        rows: ints broadcasting against positions, each position's row of the table.
        positions: ints, the positions (-1, or any negative: none).
        page_size: the tokens of a page.

    Returns:
        ``page * page_size + offset``, -1 where the position is negative or its page missing.
    """
    column = jnp.clip(positions // page_size, 0, table.shape[1] - 1)
    page = table[rows, column]
    return jnp.where((positions >= 0) & (page >= 0), page * page_size + positions % page_size, -1)


def write_rows(pages, flat, entries):
    """``pages`` [P, page_size, ...] with ``entries`` [*flat.shape, ...] (trailing shape the pages',
    zero-padded on the last axis to it) stored at the :func:`flat_rows` ``flat``; -1 drops an entry."""
    P, size, *rest = pages.shape
    if entries.shape[-1] < rest[-1]:
        entries = jnp.pad(entries, [(0, 0)] * (entries.ndim - 1) + [(0, rest[-1] - entries.shape[-1])])
    flat = jnp.where(flat < 0, P * size, flat)  # past the end: dropped (a -1 would wrap)
    return pages.reshape(P * size, *rest).at[flat].set(entries.astype(pages.dtype), mode="drop").reshape(pages.shape)
