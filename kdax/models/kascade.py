"""Kascade calibration of a model: run it on calibration text, collect each full-attention
layer's pooled attention, selections and importance, and choose a schedule
(:mod:`kdax.ops.kascade.schedule` has the statistics and the dynamic program)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kdax.models.kda import KDAForCausalLM, Segments, _arange, _check_ids, full_attention_layers
from kdax.nn import KascadeStep
from kdax.ops.common.validation import fail
from kdax.ops.kascade import reference
from kdax.ops.kascade.checks import POOL_SIZE, TILE_SIZE
from kdax.ops.kascade.schedule import (
    KascadeSchedule,
    build_schedule,
    layer_importance,
    output_similarity,
    pair_similarity,
    recall,
)

OBJECTIVES = ("output", "mass")


def _check_layers(model: KDAForCausalLM) -> tuple[list[int], int]:
    layers = full_attention_layers(model)
    if not layers:
        fail("model", "a model with full-attention (softmax, no window) layers", "none")
    heads = {model.model.layers[i].attn.num_kv_heads for i in layers}
    if len(heads) > 1:
        fail("model", "full-attention layers with one KV head count", sorted(heads))
    return layers, heads.pop()


def dense_pass(
    model: KDAForCausalLM, input_ids, *, topk_percent=10, min_k=128, tile_size=TILE_SIZE, pool_size=POOL_SIZE
):
    """Run ``input_ids`` densely through the model, measuring its full-attention layers.

    Memory O(B H T^2) per layer (the pooled probabilities come from the dense reference):
    meant for calibration lengths (a few thousand tokens).

    Args:
        model: the model.
        input_ids: [B, T] tokens (full rows, no padding).
        topk_percent, min_k, tile_size, pool_size: the selection's options.

    Returns:
        (layers, probs, selections, importance, inputs): the full-attention layers; per layer its
        pooled probabilities [B, G, NT, T] (float64 NumPy) and its own top-k selection
        [B, G, NT, k_max]; the layers' importance [L]; per layer the input of its attention
        (after the norm, [B, T, hidden_size]).

    Raises:
        ValueError: the model has no full-attention layer, or their KV head counts differ.
    """
    layers, _ = _check_layers(model)
    B, T = _check_ids(input_ids, model.config.vocab_size)
    seg = Segments(None, _arange(B, T), None)
    x = model.model.embeddings(jnp.asarray(input_ids, jnp.int32))
    rows = jnp.full((B,), T, jnp.int32)
    probs, selections, importance, inputs = [], [], [], []
    for i, block in enumerate(model.model.layers):
        if i in layers:
            h = block.attn_norm(x)
            q, k, _ = block.attn.project(h, seg.positions)
            P = reference.pooled_probabilities(q, k, tile_size=tile_size)
            opts = {"tile_size": tile_size, "topk_percent": topk_percent, "min_k": min_k, "pool_size": pool_size}
            sel = reference.select_tiles(P, rows, **opts)
            probs.append(np.asarray(P, np.float64))
            selections.append(np.asarray(sel))
            importance.append(layer_importance(x, block.attn(h, positions=seg.positions)[0]))
            inputs.append(h)
        x = block(x, seg)[0]
    return layers, probs, selections, np.asarray(importance), inputs


def layer_statistics(
    model: KDAForCausalLM,
    input_ids,
    *,
    topk_percent=10,
    min_k=128,
    tile_size=TILE_SIZE,
    pool_size=POOL_SIZE,
    objective: str = "output",
):
    """The calibration statistics of a model's full-attention layers.

    Args:
        model: the model.
        input_ids: [B, T] calibration tokens (full rows, no padding).
        topk_percent, min_k, tile_size, pool_size: the selection's options.
        objective: "output" (:func:`kdax.ops.kascade.schedule.output_similarity`: the error of
            each layer's output) or "mass" (:func:`kdax.ops.kascade.schedule.pair_similarity`: the attention mass an
            anchor's selection keeps, as the Kascade paper ranks heads).

    Returns:
        (layers, pairs [L, L, G, G], importance [L]): the full-attention layers, the head-pair
        similarity of each (anchor, later layer) pair (0 below the diagonal; larger is better)
        and each layer's importance (:func:`layer_importance`).

    Raises:
        ValueError: the model has no full-attention layer, their KV head counts differ, or
            ``objective`` is neither.
    """
    if objective not in OBJECTIVES:
        fail("objective", f"one of {OBJECTIVES}", repr(objective))
    _, G = _check_layers(model)
    opts = {"topk_percent": topk_percent, "min_k": min_k, "tile_size": tile_size, "pool_size": pool_size}
    layers, probs, selections, importance, inputs = dense_pass(model, input_ids, **opts)
    if objective == "output":
        sched = KascadeSchedule((layers[0],), (layers[0],), {}, **opts)
        positions = _arange(*inputs[0].shape[:2])

        def run(l, indices):  # the layer's attention output, after its output projection
            step = KascadeStep(sched, "reuse", indices=indices)
            return model.model.layers[layers[l]].attn(inputs[l], positions=positions, kascade=step)[0]

        return layers, output_similarity(run, selections, tile_size, pool_size), importance
    L = len(layers)
    pairs = np.zeros((L, L, G, G))
    for a in range(L):
        for l in range(a, L):
            pairs[a, l] = pair_similarity(probs[l], selections[l], selections[a], tile_size, pool_size)
    return layers, pairs, importance


def sparse_pass(model: KDAForCausalLM, input_ids, *, schedule: KascadeSchedule | None = None, fixed=None):
    """Logits of full rows under a Kascade schedule, or with fixed selections on some layers
    (baselines such as a sliding window), and how much of each full-attention layer's attention
    the keys it attended keep, measured on this run (its own dense attention over this run's
    activations, not a dense run's).

    Args:
        model: the model.
        input_ids: [B, T] tokens.
        schedule: the schedule (None and no ``fixed``: dense attention everywhere).
        fixed: layer -> indices [B, G, NT, k]: these layers attend the given keys (plus each
            tile's own block), the others dense; ``schedule`` then gives only the options.

    Returns:
        (logits [B, T, vocab_size] float32, recall [L] floats: per full-attention layer the
        share of its pooled attention mass on the keys it attended, tiles 1 onward; 1 for a
        dense layer).
    """
    layers, _ = _check_layers(model)
    B, T = _check_ids(input_ids, model.config.vocab_size)
    seg = Segments(None, _arange(B, T), None)
    x = model.model.embeddings(jnp.asarray(input_ids, jnp.int32))
    selections, kept = {}, []
    for i, block in enumerate(model.model.layers):
        step = None
        if fixed is not None:
            step = KascadeStep(schedule, "reuse", indices=fixed[i]) if i in fixed else None
        elif schedule is not None and i in schedule.layers:
            role, anchor, head_map = schedule.role(i)
            if role == "anchor":
                step = KascadeStep(schedule, "anchor", dense_output=i == schedule.anchors[0])
            else:
                step = KascadeStep(schedule, "reuse", indices=selections[anchor], head_map=head_map)
        sparse = step is not None and not step.dense_output
        if sparse:
            q, k, _ = block.attn.project(block.attn_norm(x), seg.positions)
            P = reference.pooled_probabilities(q, k, tile_size=schedule.tile_size)
        x, _, indices = block(x, seg, kascade=step)
        if indices is not None:
            selections[i] = indices
        if i in layers:
            if not sparse:
                kept.append(1.0)
                continue
            used = indices if step.role == "anchor" else step.indices
            if step.head_map is not None:
                used = jnp.asarray(used)[:, list(step.head_map)]
            kept.append(recall(P, used, schedule.tile_size, schedule.pool_size))
    return model._logits(model.model.norm(x)), kept


def calibrate(
    model: KDAForCausalLM,
    input_ids,
    n_anchors: int,
    *,
    topk_percent=10,
    min_k=128,
    tile_size=TILE_SIZE,
    pool_size=POOL_SIZE,
    objective: str = "output",
) -> KascadeSchedule:
    """A Kascade schedule for ``model`` from calibration tokens.

    Args:
        model: the model.
        input_ids: [B, T] calibration tokens.
        n_anchors: anchors to place among the full-attention layers (the first is forced).
        topk_percent, min_k, tile_size, pool_size: the selection's options, kept in the schedule.
        objective: what ranks anchor heads and anchors, "output" (the error of each layer's
            output) or "mass" (the attention mass kept); see :func:`layer_statistics`.

    Returns:
        The :class:`kdax.KascadeSchedule`.
    """
    opts = {"topk_percent": topk_percent, "min_k": min_k, "tile_size": tile_size, "pool_size": pool_size}
    layers, pairs, importance = layer_statistics(model, input_ids, objective=objective, **opts)
    return build_schedule(layers, pairs, importance, n_anchors, **opts)
