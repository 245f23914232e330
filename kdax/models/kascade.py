"""Kascade calibration of a model: run it on calibration text, collect each full-attention
layer's pooled attention, selections and importance, and choose a schedule
(:mod:`kdax.ops.kascade.schedule` has the statistics and the dynamic program)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kdax.models.kda import KDAForCausalLM, Segments, _arange, _check_ids, full_attention_layers
from kdax.ops.common.validation import fail
from kdax.ops.kascade import reference
from kdax.ops.kascade.schedule import KascadeSchedule, build_schedule, layer_importance, pair_similarity


def _check_layers(model: KDAForCausalLM) -> tuple[list[int], int]:
    layers = full_attention_layers(model)
    if not layers:
        fail("model", "a model with full-attention (softmax, no window) layers", "none")
    heads = {model.model.layers[i].attn.num_kv_heads for i in layers}
    if len(heads) > 1:
        fail("model", "full-attention layers with one KV head count", sorted(heads))
    return layers, heads.pop()


def dense_pass(model: KDAForCausalLM, input_ids, *, topk_percent=10, min_k=128, tile_size=32):
    """Run ``input_ids`` densely through the model, measuring its full-attention layers.

    Memory O(B H T^2) per layer (the pooled probabilities come from the dense reference):
    meant for calibration lengths (a few thousand tokens).

    Args:
        model: the model.
        input_ids: [B, T] tokens (full rows, no padding).
        topk_percent, min_k, tile_size: the selection's options.

    Returns:
        (layers, probs, selections, importance): the full-attention layers; per layer its pooled
        probabilities [B, G, NT, T] (float64 NumPy) and its own top-k selection [B, G, NT, k_max];
        the layers' importance [L].

    Raises:
        ValueError: the model has no full-attention layer, or their KV head counts differ.
    """
    layers, _ = _check_layers(model)
    B, T = _check_ids(input_ids, model.config.vocab_size)
    seg = Segments(None, _arange(B, T), None)
    x = model.model.embeddings(jnp.asarray(input_ids, jnp.int32))
    rows = jnp.full((B,), T, jnp.int32)
    probs, selections, importance = [], [], []
    for i, block in enumerate(model.model.layers):
        if i in layers:
            h = block.attn_norm(x)
            q, k, _ = block.attn.project(h, seg.positions)
            P = reference.pooled_probabilities(q, k, tile_size=tile_size)
            sel = reference.select_tiles(P, rows, tile_size=tile_size, topk_percent=topk_percent, min_k=min_k)
            probs.append(np.asarray(P, np.float64))
            selections.append(np.asarray(sel))
            importance.append(layer_importance(x, block.attn(h, positions=seg.positions)[0]))
        x = block(x, seg)[0]
    return layers, probs, selections, np.asarray(importance)


def layer_statistics(model: KDAForCausalLM, input_ids, *, topk_percent=10, min_k=128, tile_size=32):
    """The calibration statistics of a model's full-attention layers.

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
    _, G = _check_layers(model)
    layers, probs, selections, importance = dense_pass(
        model, input_ids, topk_percent=topk_percent, min_k=min_k, tile_size=tile_size
    )
    L = len(layers)
    pairs = np.zeros((L, L, G, G))
    for a in range(L):
        for l in range(a, L):
            pairs[a, l] = pair_similarity(probs[l], selections[l], selections[a], tile_size)
    return layers, pairs, importance


def forward_with(model: KDAForCausalLM, input_ids, steps: dict) -> jax.Array:
    """Logits of full rows with chosen Kascade steps on some layers (dense elsewhere): for
    studies that set a layer's selection directly (baselines such as a sliding window).

    Args:
        model: the model.
        input_ids: [B, T] tokens.
        steps: layer index -> :class:`kdax.nn.KascadeStep` (a reuse step carries its indices).

    Returns:
        logits [B, T, vocab_size] float32.
    """
    B, T = _check_ids(input_ids, model.config.vocab_size)
    seg = Segments(None, _arange(B, T), None)
    x = model.model.embeddings(jnp.asarray(input_ids, jnp.int32))
    for i, block in enumerate(model.model.layers):
        x = block(x, seg, kascade=steps.get(i))[0]
    return model._logits(model.model.norm(x))


def calibrate(
    model: KDAForCausalLM, input_ids, n_anchors: int, *, topk_percent=10, min_k=128, tile_size=32
) -> KascadeSchedule:
    """A Kascade schedule for ``model`` from calibration tokens.

    Args:
        model: the model.
        input_ids: [B, T] calibration tokens.
        n_anchors: anchors to place among the full-attention layers (the first is forced).
        topk_percent, min_k, tile_size: the selection's options, kept in the schedule.

    Returns:
        The :class:`kdax.KascadeSchedule`.
    """
    layers, pairs, importance = layer_statistics(
        model, input_ids, topk_percent=topk_percent, min_k=min_k, tile_size=tile_size
    )
    return build_schedule(
        layers, pairs, importance, n_anchors, topk_percent=topk_percent, min_k=min_k, tile_size=tile_size
    )
