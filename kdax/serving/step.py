"""One compiled serving step over pools: the interface a serving engine calls (docs/serving.md).

The model's state lives in a :class:`Pool`: per KDA layer one recurrent state and three
convolution caches per *slot* ([S, ...]); per softmax layer (Attention, MLA) the cached entries
in *pages* of ``page_size`` tokens ([P, page_size, ...]: keys and values, or MLA's latent and
rope key). A :class:`Batch` gives N rows, each up to C new tokens of one request (a prompt's
next chunk, a decode token, or a token and its draft tokens to verify), the request's slot and
its page table. :func:`step` runs them all in one compiled call, compiled once per (N, C) and
mode, whatever the requests, and updates the pool in place (it is donated).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from kdax.models.kda import KDAForCausalLM, Segments, is_kda, row_segments
from kdax.nn.kda import KDACache
from kdax.ops.common import dispatch
from kdax.ops.kda import slots as pool_slots
from kdax.serving.pages import flat_rows, page_view, write_rows


class Pool(NamedTuple):
    """The state of every request being served (:func:`init_pool`).

    Attributes:
        layers: per layer, a :class:`kdax.nn.KDACache` of [S, ...] arrays (KDA layers: slot s
            holds one sequence's recurrent state and convolution caches), or a tuple of page
            arrays [P, page_size, ...] (softmax layers: the cache arrays of
            ``layer.init_cache``, their length axis split into pages).
    """

    layers: tuple


class Batch(NamedTuple):
    """The rows of one step (host arrays or device arrays; shapes fix the compilation).

    Attributes:
        tokens: [N, C] int32, row n's new tokens first (``counts[n]`` of them), padding after.
        counts: [N] int32 in [0, C]: 0 for an idle row.
        slots: [N] int32, the row's slot (-1 for an idle row). A verify step writes the state
            after token t to slot ``slots[n] + t``: a request owns C consecutive slots there.
        sources: [N] int32, the slot whose state the row starts from, copied into ``slots[n]``
            first: ``slots[n]`` itself to continue, ``slots[n] + a - 1`` after a verify step
            that accepted a tokens, a prefix-cache slot on a cache hit.
        starts: [N] int32, the position of the row's first new token (the tokens the request
            has in its cache).
        pages: [N, M] int32, the request's pages in position order (-1 where none yet): position
            p lives in page ``pages[n, p // page_size]`` at offset ``p % page_size``; M pages
            bound a request's length.
    """

    tokens: jax.Array
    counts: jax.Array
    slots: jax.Array
    sources: jax.Array
    starts: jax.Array
    pages: jax.Array


def init_pool(model: KDAForCausalLM, num_slots: int, num_pages: int, page_size: int) -> Pool:
    """A zeroed pool for ``model``.

    Args:
        model: a :class:`kdax.models.KDAForCausalLM` (or a Hugging Face family's model).
        num_slots: S, the KDA state slots (requests at once, times the slots each one needs).
        num_pages: P, the pages of each softmax layer.
        page_size: the tokens of a page.

    Returns:
        The :class:`Pool`: KDA states float32, convolution caches and pages in ``model.dtype``.

    Raises:
        ValueError: a size that is not a positive int.
    """
    for name, n in (("num_slots", num_slots), ("num_pages", num_pages), ("page_size", page_size)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{name}: expected a positive int, got {n!r}")
    layers = []
    for b in model.model.layers:
        if is_kda(b):
            layers.append(b.attn.init_cache(num_slots, model.dtype))
        else:
            one = b.attn.init_cache(1, 1, model.dtype)
            layers.append(tuple(jnp.zeros((num_pages, page_size, *c.shape[2:]), c.dtype) for c in one))
    return Pool(tuple(layers))


def step(model: KDAForCausalLM, pool: Pool, batch: Batch, *, verify: bool = False):
    """Run one step of mixed prefill chunks and decode tokens (or, with ``verify``, draft tokens).

    Args:
        model: the model (in any mode: the step is inference).
        pool: the :class:`Pool`; donated: use the returned one.
        batch: the :class:`Batch`.
        verify: speculative decoding: the logits at every position, and the state after every
            token kept in slot ``slots[n] + t`` (the recurrent form over C tokens); the next
            step's ``sources`` says how many tokens were accepted.

    Returns:
        (logits float32: [N, vocab] at each row's last new token, or with ``verify`` [N, C,
        vocab] at every position; the updated pool).

    Raises:
        ValueError: a batch whose arrays do not fit each other or the pool.
    """
    _check(model, pool, batch)
    graphdef, state = nnx.split(model)
    return _compiled(
        graphdef, state, pool, Batch(*(jnp.asarray(x, jnp.int32) for x in batch)), verify, dispatch.context()
    )


def _check(model, pool: Pool, batch: Batch) -> None:
    if not isinstance(pool, Pool) or len(pool.layers) != len(model.model.layers):
        raise ValueError(f"pool: expected the Pool of init_pool(model, ...), got {type(pool).__name__}")
    if jnp.ndim(batch.tokens) != 2:
        raise ValueError(f"batch.tokens: expected [N, C] ints, got shape {jnp.shape(batch.tokens)}")
    N = jnp.shape(batch.tokens)[0]
    for name in ("counts", "slots", "sources", "starts"):
        if jnp.shape(getattr(batch, name)) != (N,):
            raise ValueError(f"batch.{name}: expected shape ({N},), got {jnp.shape(getattr(batch, name))}")
    if jnp.ndim(batch.pages) != 2 or jnp.shape(batch.pages)[0] != N:
        raise ValueError(f"batch.pages: expected [N={N}, M] ints, got shape {jnp.shape(batch.pages)}")


def _store(pages, view, batch: Batch):
    """pages with each row's new entries (positions starts + t, t < counts) taken from its view."""
    N, C = batch.tokens.shape
    pos = batch.starts[:, None] + jnp.arange(C, dtype=jnp.int32)  # [N, C]
    keep = (jnp.arange(C) < batch.counts[:, None]) & (batch.slots >= 0)[:, None]
    new = jnp.take_along_axis(view, jnp.clip(pos, 0, view.shape[1] - 1).reshape(N, C, *(1,) * (view.ndim - 2)), 1)
    flat = flat_rows(batch.pages, jnp.arange(N)[:, None], jnp.where(keep, pos, -1), pages.shape[1])
    return write_rows(pages, flat, new)


@functools.partial(jax.jit, static_argnums=(0, 4, 5), donate_argnums=(2,))
def _compiled(graphdef, state, pool: Pool, batch: Batch, verify: bool, ctx):
    model = nnx.merge(graphdef, state)
    N, C = batch.tokens.shape
    blocks = model.model.layers
    one_row = verify or C == 1  # one KDA sequence a row (the decode kernels' layout)
    with dispatch.restored(ctx):
        caches = []
        for b, c in zip(blocks, pool.layers):
            if is_kda(b) and not one_row:  # the row's start state into its slot
                start = lambda p: pool_slots.write(p, batch.slots, pool_slots.read(p, batch.sources))
                caches.append(jax.tree.map(start, c))
            else:
                caches.append(c if is_kda(b) else tuple(page_view(p, batch.pages) for p in c))
        t = jnp.arange(C, dtype=jnp.int32)
        if one_row:  # slots per token, the source last: the ops read it in place (no copy into the slot)
            live = (t < batch.counts[:, None]) & (batch.slots >= 0)[:, None]
            kda = jnp.where(live, batch.slots[:, None] + (t if verify else 0), -1)  # its padding writes no state
            kda = jnp.concatenate([kda, batch.sources[:, None]], axis=1)  # [N, C + 1]
            padding = (t >= batch.counts[:, None]).astype(jnp.int32)
            seg = Segments(None, batch.starts[:, None] + t, padding, kda, jnp.full((N,), C + 1, jnp.int32))
        else:  # a row's tokens and its padding: KDA sequences 2n and 2n + 1
            kda = jnp.stack([batch.slots, jnp.full_like(batch.slots, -1)], 1).reshape(-1)
            seg = row_segments(N, C, batch.counts, batch.starts)._replace(kda_slots=kda)
        mode = "fused_recurrent" if verify or C == 1 else "chunk"
        h, new = model.model(batch.tokens, seg, tuple(caches), True, mode)
        layers = []
        for b, c, n in zip(blocks, pool.layers, new):
            layers.append(KDACache(*n) if is_kda(b) else tuple(_store(p, v, batch) for p, v in zip(c, n)))
        if not verify:
            h = jnp.take_along_axis(h, jnp.maximum(batch.counts - 1, 0)[:, None, None], axis=1)[:, 0]
        return model._logits(h), Pool(tuple(layers))


@functools.partial(jax.jit, donate_argnums=(0,))
def copy_slots(pool: Pool, src, dst) -> Pool:
    """The pool with the KDA states of slots ``src`` copied to slots ``dst`` (int [M] each; a
    prefix cache keeps a prompt's state so); the pages are left as they are (share them instead).

    Args:
        pool: the :class:`Pool`; donated.
        src, dst: [M] int slots.

    Returns:
        The updated pool.
    """
    copy = lambda p: pool_slots.write(p, dst, pool_slots.read(p, src))
    return Pool(tuple(jax.tree.map(copy, c) if isinstance(c, KDACache) else c for c in pool.layers))
