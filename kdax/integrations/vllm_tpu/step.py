"""One engine step of a kdax hybrid on a serving engine's flat batch (docs/serving.md, "vLLM").

An engine such as vLLM hands a model every scheduled token of every request in one flat row:
prompt chunks, decode tokens and draft tokens to verify, request r's tokens at
``query_start_loc[r]:query_start_loc[r + 1]``, padding after the last request. It keeps the
caches: per MLA layer pages of ``page_size`` token entries addressed by each request's page
table, per KDA layer a pool of state slots. :func:`forward` runs the model on such a batch with
kdax's own ops, which run on every backend (CPU included):

- KDA layers: one packed call over all requests (``cu_seqlens`` from ``query_start_loc``),
  each request starting from its read slot (zeros for a request with nothing computed yet)
  and its final state written to its write slot. With ``num_spec`` draft tokens the layers run
  the recurrent form and keep the state after each of a request's last ``num_spec + 1``
  tokens in its slots ``write .. write + num_spec``, each tagged with the tokens it has seen;
  the next step starts from the slot whose tag equals its computed tokens, so a verify step
  that accepted a of its drafts continues from the state after them (the engine reports no
  acceptance counts to models; the tags recover them).
- MLA layers: the new tokens' latents and rope keys are written into their pages first, then
  the tokens attend over their requests' pages up to their positions in the absorbed form
  (:func:`kdax.ops.mla.api.paged_latent_attention`: each page read once a query block, no
  per-token copy of a context).

On an engine's mesh (:class:`StepMesh`) the weights are split over the heads and the MLPs' features,
and with data-parallel attention each group's mixers run on its own requests, pages and slots
under ``jax.shard_map`` while the MLPs see every group's tokens.

The engine's state layout (:func:`kda_state_shapes`) of one KDA slot: the q, k and v
convolution windows side by side [conv_size, H*K + H*K + HV*V] in the model's dtype, the
recurrent state [HV, K, V] float32, and the tag [1] int32.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kdax.models.glm5 import Glm5Model
from kdax.models.kda import KDAForCausalLM, is_kda
from kdax.nn.dsa import IndexedMLA
from kdax.nn.hyper import HyperConnection
from kdax.nn.kda import KDACache, KimiDeltaAttention
from kdax.ops.common.sharding import axis_names, heads_over
from kdax.ops.kda import slots as pool_slots
from kdax.serving.pages import flat_rows, page_view, write_rows


class StateSlots(NamedTuple):
    """Where the requests of one KDA layer keep their states.

    Attributes:
        write: [R] int32, each request's slot (it owns ``write .. write + num_spec``).
        read: [R] int32, the slot each request starts from (prefix caching: the state of its
            cached prefix), or None: the one of its own slots whose tag equals its computed
            tokens.
    """

    write: jax.Array
    read: jax.Array | None = None


class StepBatch(NamedTuple):
    """The engine's batch of one step.

    Attributes:
        tokens: [T] int32, the requests' new tokens back to back, padding after.
        positions: [T] int32, each token's position in its request.
        query_start_loc: [R + 1] int32, request r's tokens at ``[query_start_loc[r],
            query_start_loc[r + 1])``; padding requests repeat the last offset.
        seq_lens: [R] int32, each request's tokens after this step (computed + new).
        layers: per layer, the request's page tables [R, M] int32 (MLA layers; -1: no page),
            or a :class:`StateSlots` (KDA layers).
    """

    tokens: jax.Array
    positions: jax.Array
    query_start_loc: jax.Array
    seq_lens: jax.Array
    layers: tuple


def kda_state_shapes(layer: KimiDeltaAttention) -> tuple[tuple[int, ...], ...]:
    """The shapes of one slot of ``layer``'s state in the engine: (convolution windows
    [conv_size, H*K + H*K + HV*V], recurrent state [HV, K, V], tag [1]).

    Raises:
        ValueError: the layer has no short convolutions (every Hugging Face family has them).
    """
    if not layer.use_short_conv:
        raise ValueError("layer: expected a KimiDeltaAttention with short convolutions (use_short_conv=True)")
    width = sum(c.hidden_size for c in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d))
    return (layer.conv_size, width), (layer.num_v_heads, layer.head_k_dim, layer.head_v_dim), (1,)


def page_width(model: KDAForCausalLM) -> int:
    """The width of an MLA page's token entries: ``kv_lora_rank + qk_rope_head_dim``, and with
    GLM-5.3's indexers their keys and pooling logits after (2 * index_head_dim): every MLA layer's
    pages one width (0 for a model without MLA)."""
    widths = [0]
    for b in model.model.layers:
        if not is_kda(b):
            a = b.attn
            extra = 2 * a.indexer.head_dim if isinstance(a, IndexedMLA) and a.indexer is not None else 0
            widths.append(a.kv_lora_rank + a.qk_rope_head_dim + extra)
    return max(widths)


def init_caches(model: KDAForCausalLM, num_slots: int, num_pages: int, page_size: int, width: int | None = None):
    """Zeroed caches in the engine's layout, as the engine allocates them (tests and tools).

    Args:
        model: a Kimi Linear, Ling or GLM-5.3 model (KDA and MLA layers).
        num_slots: the state slots of each KDA layer.
        num_pages: the pages of each MLA layer.
        page_size: the tokens of a page.
        width: the entries' width of an MLA page (default :func:`page_width`).

    Returns:
        A list, per layer: (conv, recurrent, tag) arrays [num_slots, ...] (KDA) or pages
        [num_pages, page_size, width] in the model's dtype (MLA).
    """
    caches = []
    for b in model.model.layers:
        if is_kda(b):
            shapes = kda_state_shapes(b.attn)
            dtypes = (model.dtype, jnp.float32, jnp.int32)
            caches.append(tuple(jnp.zeros((num_slots, *s), d) for s, d in zip(shapes, dtypes)))
        else:
            caches.append(jnp.zeros((num_pages, page_size, width or page_width(model)), model.dtype))
    return caches


class StepMesh(NamedTuple):
    """How an engine's device mesh splits a step (each axis a mesh axis name, a tuple of them, or
    None where the engine does not split that way).

    Attributes:
        mesh: the engine's mesh.
        heads: the axis that splits the attention layers' heads (tensor parallelism).
        experts: the axis that splits the MLPs' features, the experts and the vocabulary.
        groups: the axis of data-parallel attention groups: the batch is that many groups' batches
            side by side (see :func:`forward`), each group's pages and state slots on its own
            devices.
    """

    mesh: jax.sharding.Mesh
    heads: object = None
    experts: object = None
    groups: object = None


class _Step(NamedTuple):
    """What every layer reads of one group's batch (R requests, T tokens)."""

    qsl: jax.Array  # [R + 1]
    seq_lens: jax.Array  # [R]
    lengths: jax.Array  # [R] new tokens
    computed: jax.Array  # [R] tokens before the step
    positions: jax.Array  # [T]
    request: jax.Array  # [T] each token's request
    live: jax.Array  # [T] whether it is a request's
    cu: jax.Array  # [R + 2] the requests' offsets, then the padding as one more sequence

    @classmethod
    def of(cls, positions, qsl, seq_lens) -> _Step:
        T, R = positions.shape[0], seq_lens.shape[0]
        qsl, seq_lens = qsl.astype(jnp.int32), seq_lens.astype(jnp.int32)
        lengths = qsl[1:] - qsl[:-1]
        t = jnp.arange(T, dtype=jnp.int32)
        request = jnp.clip(jnp.searchsorted(qsl[1:], t, side="right"), 0, R - 1).astype(jnp.int32)
        cu = jnp.concatenate([qsl, jnp.array([T], jnp.int32)])
        return cls(qsl, seq_lens, lengths, seq_lens - lengths, positions.astype(jnp.int32), request, t < qsl[R], cu)


def forward(
    model: KDAForCausalLM,
    caches,
    batch: StepBatch,
    *,
    num_spec: int = 0,
    mla_backend: str = "auto",
    mesh: StepMesh | None = None,
):
    """Run the model on one engine step.

    Args:
        model: a Kimi Linear, Ling or GLM-5.3 model (:mod:`kdax.models.hybrids`).
        caches: per layer, the engine's cache (see :func:`init_caches`).
        batch: the :class:`StepBatch`; with ``mesh.groups`` of G devices, G groups' batches side
            by side (tokens and positions [G * T], ``query_start_loc`` [G * (R + 1)] with offsets
            into each group's tokens, ``seq_lens`` and the layers' tables and slots [G * R] with
            page and slot ids local to the group's shard of the caches).
        num_spec: the draft tokens a request may verify in a step (0: none).
        mla_backend: the backend of the MLA layers' paged attention
            (:func:`kdax.ops.mla.api.paged_latent_attention`).
        mesh: None, or a :class:`StepMesh`: the weights split as it says
            (:func:`kdax.models.sharding.tensor_parallel_specs`), the ops run per shard of the heads
            (:func:`kdax.ops.common.sharding.heads_over`, as the TPU kernels need), and each
            attention group's layers on its own requests, pages and slots under ``jax.shard_map``;
            the MLPs see every group's tokens.

    Returns:
        (hidden [T, hidden_size] after the final norm (group after group), the updated caches as
        a list).
    """
    if mesh is None:
        return _forward(model, caches, batch, num_spec, mla_backend, None)
    with heads_over(mesh.mesh, mesh.heads, experts=mesh.experts):
        return _forward(model, caches, batch, num_spec, mla_backend, mesh)


def _forward(model, caches, batch: StepBatch, num_spec: int, mla_backend: str, mesh):
    if isinstance(model.model, Glm5Model):
        return _forward_streams(model, caches, batch, num_spec, mesh)
    step = _per_group(mesh, _Step.of, batch.positions, batch.query_start_loc, batch.seq_lens)
    x = model.model.embeddings(batch.tokens[None])
    new = []
    for b, cache, layer in zip(model.model.layers, caches, batch.layers):
        graph, weights = nnx.split(b)
        mix = functools.partial(_mix, graph, num_spec=num_spec, backend=mla_backend)
        y, cache = _per_group(mesh, mix, weights, x, cache, layer, step, whole=1, time=1)
        x = x + y
        if mesh is not None and mesh.groups is not None:  # every group's tokens to the MLP's devices
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh.mesh, P()))
        x = x + b.mlp(b.mlp_norm(x))
        new.append(cache)
    return model.model.norm(x)[0], new


def _forward_streams(model, caches, batch: StepBatch, num_spec: int, mesh):
    """:func:`_forward` of GLM-5.3 (:class:`kdax.models.glm5.Glm5Model`): the residual streams
    through each layer's hyper-connections, the indexed layers on the pages (:func:`_dsa_mix`), a
    shared one with the selection of the layer before it."""
    step = _per_group(mesh, _Step.of, batch.positions, batch.query_start_loc, batch.seq_lens)
    m = model.model
    x = m.embeddings(batch.tokens[None])
    x = jnp.broadcast_to(x[:, :, None], (*x.shape[:2], m.streams, x.shape[-1]))
    new, indices = [], None
    for b, cache, layer in zip(m.layers, caches, batch.layers):
        h, post, comb = b.attn_hc(x)
        graph, weights = nnx.split(b)
        mix = functools.partial(_stream_mix, graph, num_spec=num_spec)
        if is_kda(b):
            y, cache = _per_group(mesh, mix, weights, h, cache, layer, step, whole=1, time=1)
            indices = None
        else:
            before = () if indices is None else (indices,)  # the selection of the layer before
            args = (weights, h, *before, cache, layer, step)
            y, cache, indices = _per_group(mesh, mix, *args, whole=1, time=1 + len(before), out_time=(1, 0, 1))
        x = HyperConnection.combine(x, y, post, comb)
        if mesh is not None and mesh.groups is not None:  # every group's tokens to the MLP's devices
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh.mesh, P()))
        h, post, comb = b.ffn_hc(x)
        x = HyperConnection.combine(x, b.mlp(b.mlp_norm(h)), post, comb)
        new.append(cache)
    return m.norm(x.mean(axis=-2))[0], new


def _stream_mix(graph, weights, h, *rest, num_spec: int):
    """The mixer of GLM-5.3's block ``nnx.merge(graph, weights)`` over one group's requests, its
    input h [1, T, hidden] from the streams: KDA's (output, cache) from ``rest`` (cache, slots,
    step); an indexed layer's (output, pages, selection) from ``rest`` ([the selection of the
    layer before,] pages, table, step)."""
    b = nnx.merge(graph, weights)
    if is_kda(b):
        return _kda_mix(b, h, *rest, num_spec)
    shared, rest = (None, rest) if len(rest) == 3 else (rest[0], rest[1:])
    return _dsa_mix(b, h, *rest, shared)


def _dsa_mix(b, x, pages, table, step: _Step, shared):
    """An indexed layer's mixer (:class:`kdax.nn.dsa.IndexedMLA`) over the step's requests: the
    tokens' entries (latent, then the indexer's key and pooling logits) into their pages; the
    indexer over each request's keys read from its pages (:func:`kdax.index_select` with each
    token's request as its row), or the previous layer's selection (``shared``); then each token
    over its selected latents, read from the pages where they lie (no copy of a context). Returns
    (its output [1, T, hidden], the pages, the selection [1, T, W])."""
    attn, positions = b.attn, step.positions
    h = b.attn_norm(x)
    q_resid, q_nope, new = attn.entries(h)
    entry = jnp.concatenate([a[0, :, 0] for a in new], -1)  # [T, r (+ 2d)]
    pages = _store_entries(pages, table, entry, step)
    N, size, _ = pages.shape
    r = attn.kv_lora_rank
    if attn.indexer is not None:
        d = attn.indexer.head_dim
        at = r + attn.qk_rope_head_dim
        cols = page_view(pages[:, :, at : at + 2 * d], table)  # [R, M * size, 2d]
        query_at = jnp.where(step.live, positions, -1)[None]  # padding selects nothing
        shared = attn.select(h, q_resid, cols[..., :d], cols[..., d:], query_at, step.seq_lens, step.request[None])
    flat = flat_rows(table, step.request[:, None], shared[0], size)[None]  # each selected key's row, [1, T, W]
    latent = pages[:, :, :r].reshape(1, N * size, 1, r)
    return attn.attend(h, q_nope, latent, flat), pages, shared


def _store_entries(pages, table, entry, step: _Step):
    """The pages [N, page, width] with the step's tokens' entries [T, <= width] at their positions in
    their requests' pages (padding tokens dropped)."""
    positions = jnp.where(step.live, step.positions, -1)
    return write_rows(pages, flat_rows(table, step.request, positions, pages.shape[1]), entry)


def _mix(graph, weights, x, cache, layer, step: _Step, *, num_spec: int, backend: str):
    """The mixer of block ``nnx.merge(graph, weights)`` over one group's requests: (its output
    [1, T, hidden], the layer's cache)."""
    b = nnx.merge(graph, weights)
    if is_kda(b):
        return _kda_mix(b, x, cache, layer, step, num_spec)
    return _mla_mix(b, x, cache, layer, step, backend)


def _per_group(mesh, fn, *args, whole: int = 0, time: int = 0, out_time=(1, 0)):
    """``fn(*args)`` with one attention group's share of each argument under ``jax.shard_map`` over
    ``mesh.groups`` (or as it is without groups): the first ``whole`` arguments every group's, the
    next ``time`` split on their second dim ([1, T, ...]: the group's tokens), the rest on their
    first; the outputs likewise (with ``time``, those ``out_time`` marks on their second dim)."""
    if mesh is None or mesh.groups is None:
        return fn(*args)
    g = mesh.groups
    spec = lambda i: P() if i < whole else P(None, g) if i < whole + time else P(g)
    out = P(g) if time == 0 else tuple(P(None, g) if t else P(g) for t in out_time)
    # every axis but the heads' manual: a Pallas call is not left to XLA's partitioner on any axis
    manual = set(mesh.mesh.axis_names) - set(axis_names(mesh.heads))
    in_specs = tuple(spec(i) for i in range(len(args)))
    return jax.shard_map(fn, mesh=mesh.mesh, in_specs=in_specs, out_specs=out, axis_names=manual, check_vma=False)(
        *args
    )


def _read_slots(tags, slots: StateSlots, computed, num_spec: int):
    """[R] the slot each request starts from, -1 for none (a fresh request starts from zeros)."""
    if slots.read is not None:
        read = slots.read
    elif num_spec == 0:
        read = slots.write
    else:
        own = slots.write[:, None] + jnp.arange(num_spec + 1, dtype=jnp.int32)  # [R, num_spec + 1]
        match = jnp.take(tags[:, 0], own, mode="fill", fill_value=-1) == computed[:, None]
        read = jnp.where(match.any(1), jnp.take_along_axis(own, jnp.argmax(match, 1)[:, None], 1)[:, 0], -1)
    return jnp.where(computed > 0, read, -1)


def _kda_mix(b, x, cache, slots: StateSlots, step: _Step, num_spec: int):
    """A KDA block's mixer over one group's packed requests; returns (its output [1, T, hidden],
    the layer's (conv, recurrent, tag) pool).

    Without drafts every request runs the chunked form. With drafts the requests of at most
    ``num_spec + 1`` new tokens (decode and verify rows) run the recurrent form, which keeps the
    state after each token, on their tokens alone (gathered into a row of at most R * (num_spec + 1)
    tokens); the longer ones (prompt chunks) run the chunked form."""
    conv, recurrent, tags = cache
    cu, lengths, computed, request = step.cu, step.lengths, step.computed, step.request
    R, T = lengths.shape[0], x.shape[1]
    read = _read_slots(tags, slots, computed, num_spec)
    start = pool_slots.read(recurrent, read), pool_slots.read(conv, read)  # [R, ...]: zeros where read < 0
    live = lengths > 0
    kept = num_spec + 1
    short = live & (lengths <= kept) & (num_spec > 0)
    long = live & ~short
    h = b.attn_norm(x)
    seqs = jnp.concatenate([jnp.where(long, jnp.arange(R, dtype=jnp.int32), -1), jnp.array([-1], jnp.int32)])
    y, final = _kda_call(b, h, cu, start, seqs, "chunk")
    recurrent, conv = (
        pool_slots.write(p, jnp.where(long, slots.write, -1), s) for p, s in zip((recurrent, conv), final)
    )
    if num_spec == 0:
        return y, (conv, recurrent, tags)  # the tags are read only with drafts
    # the short requests' tokens back to back in a row of Tv tokens; request r's state after its
    # token j in local slot r * kept + j, its start state there before
    n = jnp.where(short, lengths, 0)
    cu_v = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(n).astype(jnp.int32)])
    Tv = min(T, R * kept)
    t = jnp.arange(T, dtype=jnp.int32)
    mine = short[request] & step.live
    at = jnp.where(mine, cu_v[request] + t - cu[request], Tv)  # token t's place in the row (Tv: none)
    src = jnp.zeros(Tv, jnp.int32).at[at].set(t, mode="drop")
    base = jnp.arange(R, dtype=jnp.int32) * kept
    j = jnp.arange(Tv, dtype=jnp.int32)
    idx = jnp.where(j[None] < n[:, None], base[:, None] + j[None], -1)  # [R, Tv]
    idx = jnp.concatenate([idx, jnp.full((1, Tv), -1, jnp.int32)])  # the padding sequence
    local = tuple(
        jnp.zeros((R * kept, *a.shape[1:]), a.dtype).at[jnp.where(short, base, R * kept)].set(a, mode="drop")
        for a in start
    )
    y_v, states = _kda_call(
        b, h[:, src], jnp.concatenate([cu_v, jnp.array([Tv], jnp.int32)]), local, idx, "fused_recurrent"
    )
    y = jnp.where(mine[None, :, None], y_v[:, jnp.minimum(at, Tv - 1)], y)
    k = jnp.arange(kept, dtype=jnp.int32)
    keep = k[None] < n[:, None]  # [R, kept]
    dst = jnp.where(keep, slots.write[:, None] + k, -1).reshape(-1)
    src_state = (base[:, None] + k).reshape(-1)
    recurrent, conv = (pool_slots.write(p, dst, s[src_state]) for p, s in zip((recurrent, conv), states))
    # tags: the tokens a kept state has seen; a prompt chunk's final state is in its first slot; others dead
    tag = jnp.where(
        keep, computed[:, None] + k + 1, jnp.where(long[:, None] & (k == 0), (computed + lengths)[:, None], -1)
    )
    tags = pool_slots.write(
        tags, jnp.where(live[:, None], slots.write[:, None] + k, -1).reshape(-1), tag.reshape(-1, 1)
    )
    return y, (conv, recurrent, tags)


def _kda_call(b, h, cu, start, idx, mode: str):
    """The KDA mixer of block b on packed sequences (offsets ``cu``) over a local pool of (recurrent,
    conv) states [S, ...] in the engine's layout, slots ``idx``; returns (y, the pool after)."""
    widths = [c.hidden_size for c in (b.attn.q_conv1d, b.attn.k_conv1d, b.attn.v_conv1d)]
    parts = jnp.split(start[1], [widths[0], widths[0] + widths[1]], axis=2)
    pool = KDACache(start[0], tuple(jnp.swapaxes(c, 1, 2) for c in parts))  # kdax's [N, D, conv_size]
    y, out = b.attn(h, cu_seqlens=cu, cache=pool, output_cache=True, mode=mode, slots=idx)
    return y, (out.recurrent, jnp.concatenate([jnp.swapaxes(c, 1, 2) for c in out.conv], axis=2))


def _mla_mix(b, x, pages, table, step: _Step, backend: str):
    """An MLA block's mixer over one group's requests: the step's entries into their pages, then
    its tokens over their requests' pages (:meth:`kdax.nn.MLA.paged`), the latents computed once;
    returns (its output [1, T, hidden], the pages)."""
    attn, positions = b.attn, step.positions
    h = b.attn_norm(x)
    q_nope, q_rope, latent, k_rope = attn.latents(h, positions[None])
    entry = jnp.concatenate([latent, k_rope], -1)[0, :, 0]  # [T, r + dr]
    pages = _store_entries(pages, table, entry, step)
    return attn.paged(h, q_nope, q_rope, pages, table, step.qsl, step.seq_lens, backend=backend), pages
