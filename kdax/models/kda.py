"""The hybrid KDA causal language model (FLA's ``KDAModel`` / ``KDAForCausalLM``) in Flax NNX."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdax.models.config import KDAConfig
from kdax.nn import Attention, GatedMLP, KascadeStep, KimiDeltaAttention, MoE, RMSNorm, ShortConvolution
from kdax.ops.common import dispatch
from kdax.ops.common.sharding import Layout
from kdax.ops.kascade.schedule import KascadeSchedule


class ModelCache(NamedTuple):
    """Decoding caches of a batch of B rows (:meth:`KDAForCausalLM.init_cache`).

    Attributes:
        layers: per layer, a :class:`kdax.nn.KDACache` (KDA layers) or the (k, v) cache, each
            [B, slots, kv_heads, head_dim] (attention layers; slots = max_length, or the
            window of a sliding-window layer, see :meth:`kdax.nn.Attention.init_cache`).
        lengths: [B] int32, the tokens stored so far in each row (the next token's position).
    """

    layers: tuple
    lengths: jax.Array


class Segments(NamedTuple):
    """How the tokens of a [B, T] batch group into sequences.

    Attributes:
        kda_cu: [N + 1] int32 offsets of the KDA sequences over the B * T flattened tokens
            (None: one sequence per row).
        positions: [B, T] int32 RoPE positions.
        segment_ids: [B, T] int32 attention groups (None: one per row).
        kda_slots: None, or the KDA sequences' slots in pools of states (the KDA layers' caches
            are then pools: :mod:`kdax.serving`), [N] or [N, Tmax] as the layers take them.
        kda_accepted: None, or with [N, Tmax] slots the sequences' accepted counts [N]: each
            starts from slot column accepted - 1 (:func:`kdax.fused_recurrent_kda`).
    """

    kda_cu: jax.Array | None
    positions: jax.Array
    segment_ids: jax.Array | None
    kda_slots: jax.Array | None = None
    kda_accepted: jax.Array | None = None


def _arange(B: int, T: int) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


def row_segments(B: int, T: int, lengths: jax.Array, first=None) -> Segments:
    """Segments of rows holding lengths[b] tokens followed by padding.

    Each row's tokens and its padding become two KDA sequences (2B in all; row b's tokens are
    sequence 2b) and two attention segments (0: the tokens, 1: the padding).

    Args:
        B: the rows.
        T: the row length.
        lengths: [B] int32, each in [0, T].
        first: [B] int32, the position of each row's first token (default 0).

    Returns:
        The :class:`Segments`, positions counted from ``first``.
    """
    starts = jnp.arange(B, dtype=jnp.int32) * T
    cu = jnp.concatenate([jnp.stack([starts, starts + lengths], 1).reshape(-1), jnp.array([B * T], jnp.int32)])
    positions = _arange(B, T) if first is None else first[:, None] + _arange(B, T)
    return Segments(cu, positions, (_arange(B, T) >= lengths[:, None]).astype(jnp.int32))


def packed_segments(T: int, cu_seqlens: jax.Array) -> Segments:
    """Segments of one row (B = 1) of sequences packed back to back.

    Args:
        T: the row length.
        cu_seqlens: [N + 1] int32 offsets, 0 first and T last.

    Returns:
        The :class:`Segments`: KDA sequences at ``cu_seqlens``, positions counted from each
        sequence's start, segment_ids the sequence index.
    """
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_seqlens[1:], t, side="right").astype(jnp.int32)
    return Segments(cu_seqlens, (t - cu_seqlens[seq])[None], seq[None])


def fla_layer(config: KDAConfig, layer_idx: int, *, backend: str, rngs: nnx.Rngs):
    """FLA's token mixer and MLP of a layer: softmax Attention on the layers ``config.attn`` lists,
    else KimiDeltaAttention; a GatedMLP.

    Returns:
        (mixer, mlp).
    """
    c = config
    spec = c.attention_spec(layer_idx)
    if spec is not None:
        attn = Attention(
            c.hidden_size,
            num_heads=spec["num_heads"],
            num_kv_heads=spec["num_kv_heads"],
            qkv_bias=spec["qkv_bias"],
            window_size=spec["window_size"],
            rope_theta=spec["rope_theta"],
            max_position_embeddings=c.max_position_embeddings,
            layer_idx=layer_idx,
            rngs=rngs,
        )
    else:
        attn = KimiDeltaAttention(
            c.hidden_size,
            expand_v=c.expand_v,
            head_dim=c.head_dim,
            num_heads=c.num_heads,
            num_v_heads=c.num_v_heads,
            mode=c.attn_mode,
            use_short_conv=c.use_short_conv,
            allow_neg_eigval=c.allow_neg_eigval,
            safe_gate=c.safe_gate,
            lower_bound=c.lower_bound,
            conv_size=c.conv_size,
            layer_idx=layer_idx,
            norm_eps=c.norm_eps,
            backend=backend,
            rngs=rngs,
        )
    mlp = GatedMLP(
        c.hidden_size,
        hidden_ratio=c.hidden_ratio,
        intermediate_size=c.intermediate_size,
        hidden_act=c.hidden_act,
        rngs=rngs,
    )
    return attn, mlp


class KDABlock(nnx.Module):
    """Pre-norm block: x + mixer(norm(x)), then + mlp(norm(.)).

    Args:
        attn: the token mixer: a :class:`kdax.nn.KimiDeltaAttention`, or a softmax layer
            (:class:`kdax.nn.Attention`, :class:`kdax.nn.MLA`).
        mlp: the channel mixer (:class:`kdax.nn.GatedMLP`, :class:`kdax.nn.MoE`).
        hidden_size: the model width.
        eps: the RMSNorms' epsilon.
    """

    def __init__(self, attn: nnx.Module, mlp: nnx.Module, hidden_size: int, *, eps: float):
        self.attn_norm = RMSNorm(hidden_size, eps=eps)
        self.attn = attn
        self.mlp_norm = RMSNorm(hidden_size, eps=eps)
        self.mlp = mlp

    def __call__(self, x, seg: Segments, cache=None, output_cache=False, mode=None, kascade=None):
        """Apply the block.

        Args:
            x: [B, T, hidden_size].
            seg, cache, output_cache, mode, kascade: as :meth:`mix`.

        Returns:
            (x [B, T, hidden_size], the mixer's new cache or None, a Kascade anchor's selection
            or None).
        """
        h, cache, indices = self.mix(self.attn_norm(x), seg, cache, output_cache, mode, kascade)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), cache, indices

    def mix(self, h, seg: Segments, cache=None, output_cache=False, mode=None, kascade=None):
        """The token mixer on the normalised input h [B, T, hidden_size].

        Args:
            h: [B, T, hidden_size].
            seg: how the tokens group into sequences.
            cache: the mixer's cache (a :class:`kdax.nn.KDACache` with one state per KDA
                sequence, or an attention layer's (k, v)), or None.
            output_cache: whether a KDA mixer returns its final state.
            mode: the KDA mixer's mode (None: its own choice).
            kascade: the :class:`kdax.nn.KascadeStep` an attention mixer runs, or None (dense).

        Returns:
            (the mixer's output [B, T, hidden_size], its new cache or None, a Kascade anchor's
            selection or None).
        """
        indices = None
        if not is_kda(self) and kascade is not None:
            h, cache, indices = self.attn(
                h, positions=seg.positions, segment_ids=seg.segment_ids, cache=cache, kascade=kascade
            )
        elif not is_kda(self):
            h, cache = self.attn(h, positions=seg.positions, segment_ids=seg.segment_ids, cache=cache)
        else:
            B, T, D = h.shape
            flat = h if seg.kda_cu is None else h.reshape(1, B * T, D)
            flat, cache = self.attn(
                flat,
                cu_seqlens=seg.kda_cu,
                cache=cache,
                output_cache=output_cache,
                mode=mode,
                slots=seg.kda_slots,
                accepted=seg.kda_accepted,
            )
            h = flat.reshape(B, T, D)
        return h, cache, indices


def embed(model, input_ids, caches=None):
    """(spread, the embeddings [B, T, D]) of a model with ``embeddings`` and ``layout``: on a mesh
    (``layout`` set, no caches) the table gathered before the look-up (FSDP) and ``spread`` laying
    activations [B, T, ...] out with rows and time over the mesh; else the identity (decoding: as
    XLA partitions it)."""
    L = model.layout if caches is None else None
    if L is None:
        return (lambda x: x), model.embeddings(input_ids)
    spread = lambda x: L.constrain(x, L.data, L.context, *(None,) * (x.ndim - 2))
    return spread, spread(jnp.take(L.constrain(model.embeddings.embedding[...], None, None), input_ids, axis=0))


def is_kda(block: KDABlock) -> bool:
    """Whether the block's mixer is a KDA layer (else a softmax one)."""
    return isinstance(block.attn, KimiDeltaAttention)


class KDAModel(nnx.Module):
    """Embeddings, ``num_hidden_layers`` :class:`KDABlock`, final RMSNorm.

    Args:
        config: the model's config (vocab_size, hidden_size, num_hidden_layers).
        layer: ``layer(config, i, backend=, rngs=) -> (mixer, mlp)`` of layer i (:func:`fla_layer`).
        eps: the RMSNorms' epsilon.
        backend: the KDA layers' backend.
        rngs: the parameters' random keys.
    """

    def __init__(self, config, layer, *, eps: float, backend: str = "auto", rngs: nnx.Rngs):
        self.embeddings = nnx.Embed(config.vocab_size, config.hidden_size, rngs=rngs)
        blocks = []
        for i in range(config.num_hidden_layers):
            attn, mlp = layer(config, i, backend=backend, rngs=rngs)
            blocks.append(KDABlock(attn, mlp, config.hidden_size, eps=eps))
        self.layers = nnx.List(blocks)
        self.norm = RMSNorm(config.hidden_size, eps=eps)
        self.layout: Layout | None = None  # set by kdax.models.shard

    def __call__(self, input_ids, seg: Segments, caches=None, output_cache=False, mode=None, kascade=None):
        """Embed, run the blocks, normalise.

        Args:
            input_ids: [B, T] ints.
            seg: how the tokens group into sequences.
            caches: per-layer caches (see :class:`ModelCache`), or None.
            output_cache: whether the KDA layers return their final states.
            mode: the KDA layers' mode (None: their own choice).
            kascade: a :class:`kdax.KascadeSchedule` for the softmax layers, or None (dense).

        Returns:
            (hidden [B, T, hidden_size], a tuple of per-layer caches, None for a layer that
            returned none).
        """
        spread, x = embed(self, input_ids, caches)
        caches = (None,) * len(self.layers) if caches is None else caches
        new, selections = [], {}
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            step = None
            if kascade is not None:
                role, anchor, head_map = kascade.role(i)
                if role == "anchor":
                    step = KascadeStep(kascade, "anchor", dense_output=i == kascade.anchors[0])
                elif role == "reuse":
                    step = KascadeStep(kascade, "reuse", indices=selections[anchor], head_map=head_map)
            x, cache, indices = layer(x, seg, cache, output_cache, mode, step)
            x = spread(x)
            if indices is not None:
                selections[i] = indices
            new.append(cache)
        return self.norm(x), tuple(new)


class KDAForCausalLM(nnx.Module):
    """``model(input_ids) -> logits [B, T, vocab_size]`` (float32), FLA's parameter layout and
    initialisation (normal(initializer_range) linears, convolutions and embeddings, zero
    biases).

    Args:
        config: the :class:`KDAConfig`.
        backend: the backend of every KDA layer ("auto", "xla", "naive", "pallas_tpu",
            "pallas_gpu").
        rngs: the parameters' random keys.

    Raises:
        ValueError: ``config`` is not a :class:`KDAConfig`.
    """

    config_class = KDAConfig
    model_class = KDAModel

    def __init__(self, config: KDAConfig, *, backend: str = "auto", rngs: nnx.Rngs):
        if not isinstance(config, self.config_class):
            raise ValueError(f"config: expected a {self.config_class.__name__}, got {type(config).__name__}")
        self.config = config
        self.model = self.model_class(config, type(self).layer, eps=self.norm_eps(config), backend=backend, rngs=rngs)
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False, rngs=rngs)
        _init_weights(self, config.initializer_range, rngs)

    @staticmethod
    def layer(config: KDAConfig, layer_idx: int, *, backend: str, rngs: nnx.Rngs):
        """The mixer and MLP of a layer (:func:`fla_layer`)."""
        return fla_layer(config, layer_idx, backend=backend, rngs=rngs)

    @staticmethod
    def norm_eps(config: KDAConfig) -> float:
        """The RMSNorms' epsilon."""
        return config.norm_eps

    def num_parameters(self) -> int:
        """The number of parameters (elements of every ``nnx.Param``)."""
        return sum(int(np.prod(p.shape)) for _, p in nnx.to_flat_state(nnx.state(self, nnx.Param)))

    def astype(self, dtype) -> KDAForCausalLM:
        """Cast the weights of every linear and convolution and the embeddings to ``dtype``, in
        place (``jnp.bfloat16`` to serve in bf16); A_log, dt_bias and norm weights stay float32.
        Activations then flow in ``dtype``; KDA states and logits stay float32.

        Args:
            dtype: a floating dtype.

        Returns:
            self.

        Raises:
            ValueError: ``dtype`` is not a floating dtype.
        """
        if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
            raise ValueError(f"dtype: expected a floating dtype, got {jnp.dtype(dtype)}")
        for _, p in _weights(self):
            v = p.get_value()  # an array, or a ShapeDtypeStruct in an abstract model (nnx.eval_shape)
            p.set_value(v.astype(dtype) if hasattr(v, "astype") else jax.ShapeDtypeStruct(v.shape, dtype))
        self.model.embeddings.dtype = jnp.dtype(dtype)  # nnx.Embed fixes its output dtype at init
        return self

    @property
    def dtype(self) -> jnp.dtype:
        """The activations' dtype: that of the embeddings (float32 unless :meth:`astype`)."""
        return self.model.embeddings.embedding.dtype

    def _logits(self, h):
        if self.config.tie_word_embeddings:
            return self.model.embeddings.attend(h).astype(jnp.float32)
        return self.lm_head(h).astype(jnp.float32)

    def __call__(self, input_ids, *, attention_mask=None, cu_seqlens=None, kascade: KascadeSchedule | None = None):
        """Logits of every position.

        Compiled once per model structure and input shapes: an eager call costs about what
        one under ``nnx.jit`` does.

        Args:
            input_ids: [B, T] ints in [0, vocab_size).
            attention_mask: [B, T], 1 on tokens and 0 on padding (each row's tokens form one
                sequence, positions counted from its first token; padded positions' logits
                are 0), or None.
            cu_seqlens: [N + 1] int offsets of sequences packed in one row (B = 1),
                non-decreasing from 0 to T, or None. Trusted: the compiled forward sees them
                traced, so malformed offsets give meaningless logits rather than an error.
            kascade: a :class:`kdax.KascadeSchedule` over the model's softmax layers (its
                anchors select, the layers between reuse), or None: dense attention.

        Returns:
            logits [B, T, vocab_size] float32.

        Raises:
            ValueError: ``input_ids`` is not a [B, T] integer array with T >= 1, or (when
                concrete) holds ids outside [0, vocab_size); both ``attention_mask`` and
                ``cu_seqlens`` are given; ``input_ids``' batch size is not 1 with
                ``cu_seqlens``; ``attention_mask`` is not [B, T] or (when concrete) has a row
                without a token; ``kascade`` is not a schedule of this model's full-attention
                layers, or comes with ``cu_seqlens``.
        """
        B, T = _check_ids(input_ids, self.config.vocab_size)
        self._check_kascade(kascade)
        if kascade is not None and cu_seqlens is not None:
            raise ValueError("kascade: expected None with cu_seqlens (Kascade runs on rows, not packed sequences)")
        if attention_mask is not None and cu_seqlens is not None:
            raise ValueError("attention_mask: expected None when cu_seqlens is given (pass one of them)")
        if cu_seqlens is not None:
            if B != 1:
                raise ValueError(f"input_ids: expected batch size 1 with cu_seqlens, got {B}")
            cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32)
        if attention_mask is not None:
            attention_mask = _check_mask(attention_mask, (B, T))
        graphdef, state = nnx.split(self)
        return _forward(graphdef, state, input_ids, attention_mask, cu_seqlens, dispatch.context(), kascade)

    def _check_kascade(self, kascade) -> None:
        """Raise ValueError unless ``kascade`` is None or a schedule of this model's full-attention layers."""
        if kascade is None:
            return
        if not isinstance(kascade, KascadeSchedule):
            raise ValueError(f"kascade: expected None or a kdax.KascadeSchedule, got {type(kascade).__name__}")
        full = full_attention_layers(self)
        if set(kascade.layers) - set(full):
            raise ValueError(
                f"kascade: expected a schedule over the full-attention layers {full}, got layers {list(kascade.layers)}"
            )
        widths = {len(m) for m in kascade.head_maps.values()}
        heads = {self.model.layers[i].attn.num_kv_heads for i in kascade.layers}
        if widths and widths != heads:
            raise ValueError(f"kascade: expected head maps of {sorted(heads)} KV heads, got {sorted(widths)}")

    def _forward(self, input_ids, attention_mask, cu_seqlens, kascade=None):
        B, T = input_ids.shape
        if cu_seqlens is not None:
            return self._logits(self.model(input_ids, packed_segments(T, cu_seqlens))[0])
        if attention_mask is None:
            return self._logits(self.model(input_ids, Segments(None, _arange(B, T), None), kascade=kascade)[0])
        mask, order, lengths = align_rows(attention_mask, (B, T))
        ids = jnp.take_along_axis(input_ids, order, axis=1)
        logits = self._logits(self.model(ids, row_segments(B, T, lengths), kascade=kascade)[0])
        out = jnp.zeros_like(logits).at[jnp.arange(B)[:, None], order].set(logits)
        return jnp.where(mask[..., None], out, 0.0)

    def init_cache(self, batch_size: int, max_length: int) -> ModelCache:
        """Empty caches for decoding.

        Args:
            batch_size: the rows B.
            max_length: the most tokens (prompt and generated) a row will hold.

        Returns:
            A :class:`ModelCache` of zeros: KV and convolution caches in :attr:`dtype`, KDA
            states in float32, lengths 0.
        """
        layers = tuple(
            b.attn.init_cache(batch_size, max_length, self.dtype)
            if not is_kda(b)
            else b.attn.init_cache(batch_size, self.dtype)
            for b in self.model.layers
        )
        return ModelCache(layers, jnp.zeros((batch_size,), jnp.int32))

    def prefill(self, input_ids, cache: ModelCache, lengths=None, kascade: KascadeSchedule | None = None):
        """Run a prompt, or the next part of one, through the chunk path: each row continues
        from its cached tokens (none in a cache fresh from :meth:`init_cache`), so a prompt may
        be prefilled in parts, and a cache saved after a prefix (prefix caching: the KDA and
        convolution states and the keys) continues as the whole prompt's prefill does.

        Args:
            input_ids: [B, T] ints, row b's lengths[b] tokens first and padding after.
            cache: a :class:`ModelCache` (batch_size B) with room for T more tokens per row.
            lengths: [B] ints in [1, T], the tokens of each row (default T).
            kascade: a :class:`kdax.KascadeSchedule`, or None (dense attention); only into a
                fresh cache (its prefill attends to the new tokens alone).

        Returns:
            (logits [B, T, vocab_size] float32, meaningless on padding; the cache holding
            each row's tokens, lengths advanced).
        """
        B, T = input_ids.shape
        lengths = jnp.full((B,), T, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
        pad = lambda x: jnp.stack([x, jnp.zeros_like(x)], 1).reshape(-1, *x.shape[1:])  # row b: sequence 2b
        layers = tuple(jax.tree.map(pad, c) if is_kda(b) else c for b, c in zip(self.model.layers, cache.layers))
        seg = row_segments(B, T, lengths, cache.lengths)
        h, layers = self.model(input_ids, seg, layers, True, "chunk", kascade)
        rows = lambda c: jax.tree.map(lambda x: x[::2], c)
        layers = tuple(rows(c) if is_kda(b) else c for b, c in zip(self.model.layers, layers))
        return self._logits(h), ModelCache(layers, cache.lengths + lengths)

    def decode(self, tokens, cache: ModelCache, kascade: KascadeSchedule | None = None):
        """One token per row through the recurrent path.

        Args:
            tokens: [B] ints, each row's next token.
            cache: the :class:`ModelCache` of :meth:`prefill` or of an earlier decode.
            kascade: a :class:`kdax.KascadeSchedule`, or None (dense attention).

        Returns:
            (logits [B, vocab_size] float32, the cache advanced by one token).
        """
        seg = Segments(None, cache.lengths[:, None], None)
        h, layers = self.model(tokens[:, None], seg, cache.layers, True, "fused_recurrent", kascade)
        return self._logits(h)[:, 0], ModelCache(layers, cache.lengths + 1)


def full_attention_layers(model: KDAForCausalLM) -> list[int]:
    """The model's layers with softmax attention (Attention, MLA) over every earlier key (no sliding window): Kascade's
    candidates."""
    return [i for i, b in enumerate(model.model.layers) if not is_kda(b) and b.attn.window_size is None]


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def _forward(graphdef, state, input_ids, attention_mask, cu_seqlens, ctx, kascade):
    """:meth:`KDAForCausalLM.__call__` on validated inputs, compiled once per dispatch context and schedule too."""
    with dispatch.restored(ctx):
        return nnx.merge(graphdef, state)._forward(input_ids, attention_mask, cu_seqlens, kascade)


def _check_mask(attention_mask, shape):
    """A [B, T] 0/1 mask as bool (a NumPy array where concrete, checked: every row has a token)."""
    if not hasattr(attention_mask, "shape") or tuple(attention_mask.shape) != tuple(shape):
        got = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        raise ValueError(f"attention_mask: expected shape {tuple(shape)}, got {got}")
    if isinstance(attention_mask, jax.core.Tracer):
        return attention_mask.astype(bool)
    mask = np.asarray(attention_mask).astype(bool)  # on the host: no compile per shape
    if not mask.any(axis=1).all():
        raise ValueError("attention_mask: expected at least one token (a 1) in every row")
    return mask


def align_rows(attention_mask, shape):
    """Validate a 0/1 attention mask and order each row's tokens first.

    Args:
        attention_mask: [B, T], 1 on tokens and 0 on padding.
        shape: (B, T), the shape it must have.

    Returns:
        (mask [B, T] bool, order [B, T] int32 indices putting each row's tokens first in their
        original order, lengths [B] int32).

    Raises:
        ValueError: ``attention_mask`` is not of ``shape``, or (when concrete) has a row
            without a token.
    """
    mask = _check_mask(attention_mask, shape)
    order = jnp.argsort(~mask, axis=1, stable=True).astype(jnp.int32)
    return mask, order, mask.sum(axis=1).astype(jnp.int32)


def _check_ids(input_ids, vocab_size):
    if not hasattr(input_ids, "shape") or input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
        got = f"shape {tuple(input_ids.shape)} dtype {input_ids.dtype}" if hasattr(input_ids, "shape") else input_ids
        raise ValueError(f"input_ids: expected a [B, T] integer array, got {got}")
    if input_ids.shape[1] < 1:
        raise ValueError("input_ids: expected at least one token (T >= 1)")
    if not isinstance(input_ids, jax.core.Tracer):
        ids = np.asarray(input_ids)
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"input_ids: expected token ids in [0, {vocab_size}), got [{ids.min()}, {ids.max()}]")
    return input_ids.shape


_WEIGHTS = {
    nnx.Linear: ("kernel", "bias"),
    ShortConvolution: ("weight", "bias"),
    nnx.Embed: ("embedding",),
    MoE: ("gate_up", "down"),
}


def _weights(model: nnx.Module):
    """(name, Param) of every weight and bias of the linears, convolutions, embeddings and experts,
    in graph order (A_log, dt_bias, norm weights and the MoE router are not among them)."""
    for _, m in nnx.iter_graph(model):
        for name in _WEIGHTS.get(type(m), ()):
            if getattr(m, name) is not None:
                yield name, getattr(m, name)


def _init_weights(model: nnx.Module, std: float, rngs: nnx.Rngs) -> None:
    """FLA's _init_weights: normal(0, std) weights of linears, convolutions and embeddings,
    zero biases (A_log, dt_bias and norms keep their layer initialisation)."""
    for name, p in _weights(model):
        p[...] = (
            jnp.zeros(p.shape, p.dtype)
            if name == "bias"
            else std * jax.random.normal(rngs.params(), p.shape, jnp.float32)
        )
