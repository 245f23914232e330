"""Kascade calibration of a model: run it on calibration text, collect each full-attention
layer's pooled attention, selections and importance, and choose a schedule
(:mod:`kdax.ops.kascade.schedule` has the statistics and the dynamic program)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kdax.models.kda import KDAForCausalLM, Segments, _arange, _check_ids
from kdax.nn import Attention
from kdax.ops.common.validation import fail
from kdax.ops.kascade import reference
from kdax.ops.kascade.schedule import KascadeSchedule, build_schedule, layer_importance, pair_similarity


def full_attention_layers(model: KDAForCausalLM) -> list[int]:
    """The model's layers with softmax attention over every earlier key (no sliding window)."""
    return [i for i, b in enumerate(model.model.layers) if isinstance(b.attn, Attention) and b.attn.window_size is None]


def layer_statistics(model: KDAForCausalLM, input_ids, *, topk_percent=10, min_k=128, tile_size=32):
    """Run ``input_ids`` densely through the model and measure its full-attention layers.

    Args:
        model: the model.
        input_ids: [B, T] calibration tokens (full rows, no padding).
        topk_percent, min_k, tile_size: the selection's options.

    Returns:
        (layers, pairs [L, L, G, G], importance [L]): the full-attention layers, the head-pair
        similarity of each (anchor, later layer) pair (:func:`pair_similarity`; 0 below the
        diagonal) and each layer's importance (:func:`layer_importance`).

    Raises:
        ValueError: the model has no full-attention layer, or their KV head counts differ.
    """
    layers = full_attention_layers(model)
    if not layers:
        fail("model", "a model with full-attention (softmax, no window) layers", "none")
    heads = {model.model.layers[i].attn.num_kv_heads for i in layers}
    if len(heads) > 1:
        fail("model", "full-attention layers with one KV head count", sorted(heads))
    B, T = _check_ids(input_ids, model.config.vocab_size)
    seg = Segments(None, _arange(B, T), None)
    x = model.model.embeddings(jnp.asarray(input_ids, jnp.int32))
    probs, selections, importance = [], [], []
    for i, block in enumerate(model.model.layers):
        if i in layers:
            attn = block.attn
            h = block.attn_norm(x)
            q, k, _ = attn.project(h, seg.positions)
            P = reference.pooled_probabilities(q, k, tile_size=tile_size)
            probs.append(np.asarray(P, np.float64))
            rows = jnp.full((B,), T, jnp.int32)
            sel = reference.select_tiles(P, rows, tile_size=tile_size, topk_percent=topk_percent, min_k=min_k)
            selections.append(np.asarray(sel))
            importance.append(layer_importance(x, attn(h, positions=seg.positions)[0]))
        x = block(x, seg)[0]
    L = len(layers)
    pairs = np.zeros((L, L, *(heads.pop(),) * 2))
    for a in range(L):
        for l in range(a, L):
            pairs[a, l] = pair_similarity(probs[l], selections[l], selections[a], tile_size)
    return layers, pairs, np.asarray(importance)


def calibrate(model: KDAForCausalLM, input_ids, n_anchors: int, *, topk_percent=10, min_k=128,
              tile_size=32) -> KascadeSchedule:  # fmt: skip
    """A Kascade schedule for ``model`` from calibration tokens.

    Args:
        model: the model.
        input_ids: [B, T] calibration tokens.
        n_anchors: anchors to place among the full-attention layers (the first is forced).
        topk_percent, min_k, tile_size: the selection's options, kept in the schedule.

    Returns:
        The :class:`kdax.KascadeSchedule`.
    """
    layers, pairs, importance = jax.device_get(
        layer_statistics(model, input_ids, topk_percent=topk_percent, min_k=min_k, tile_size=tile_size)
    )
    return build_schedule(layers, pairs, importance, n_anchors, topk_percent=topk_percent, min_k=min_k,
                          tile_size=tile_size)  # fmt: skip
