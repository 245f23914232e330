"""Kascade schedules: which softmax layers are anchors, which KV head of its anchor each head of a
reuse layer reads, and the statistics and dynamic program that choose them from a calibration run.

Statistics (per calibration batch), for a candidate anchor a, a layer l >= a, a KV head g of l and
a KV head g' of a, by one of two objectives. Output error (the default of
:func:`kdax.models.kascade.calibrate`): 1 - G x the squared error of layer l's output when head g
attends a's selection of head g', relative to its dense output's squared norm. Attention mass (the
Kascade paper's): the share of layer l's pooled attention mass (head g) that falls on a's top-k
selection (head g') plus each tile's own causal block, relative to the share on l's own top-k plus
that block; the minimum over query tiles (a selection must serve every tile), averaged over the
batch's rows. Layer l's similarity to anchor a is the mean over g of the best g'; that best g' is
the head map. A layer's importance is 1 - cos(x, x + attn(x)) averaged over tokens. Anchors
maximise sum over layers of importance x similarity to the serving anchor (the latest anchor at or
before the layer), with the first layer forced: an exact dynamic program over segments.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np

from kdax.ops.common.validation import fail
from kdax.ops.kascade.checks import POOL_SIZE, TILE_SIZE, check_options


@dataclasses.dataclass(frozen=True)
class KascadeSchedule:
    """Which of a model's softmax attention layers run dense, anchor or reuse.

    Attributes:
        layers: the model's softmax attention layers it covers (model layer indices, ascending).
        anchors: the anchor layers among them, ascending; the first layer is an anchor with dense
            output (it computes exact attention and selects for the layers after it).
        head_maps: for each reuse layer (a layer of ``layers`` not in ``anchors``), the KV head of
            its anchor (the latest anchor before it) that each of its KV heads reads.
        topk_percent, min_k, tile_size, pool_size: the selection's options (see
            :func:`kdax.kascade_anchor`).
    """

    layers: tuple[int, ...]
    anchors: tuple[int, ...]
    head_maps: dict[int, tuple[int, ...]]
    topk_percent: float = 10
    min_k: int = 128
    tile_size: int = TILE_SIZE
    pool_size: int = POOL_SIZE

    def __post_init__(self):
        layers, anchors = tuple(int(x) for x in self.layers), tuple(int(x) for x in self.anchors)
        maps = {int(k): tuple(int(g) for g in m) for k, m in dict(self.head_maps).items()}
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "anchors", anchors)
        object.__setattr__(self, "head_maps", maps)
        check_options(self.topk_percent, self.min_k, self.tile_size, pool_size=self.pool_size)
        if not layers or list(layers) != sorted(set(layers)) or layers[0] < 0:
            fail("layers", "distinct non-negative layer indices, ascending, at least one", layers)
        if (
            not anchors
            or anchors[0] != layers[0]
            or list(anchors) != sorted(set(anchors))
            or set(anchors) - set(layers)
        ):
            fail("anchors", f"ascending layers of {layers}, starting with layer {layers[0]}", anchors)
        reuse = [x for x in layers if x not in anchors]
        if sorted(maps) != reuse:
            fail("head_maps", f"one head map for each reuse layer {reuse}", sorted(maps))
        widths = {len(m) for m in maps.values()}
        if len(widths) > 1 or any(min(m, default=0) < 0 or max(m, default=0) >= len(m) for m in maps.values()):
            fail("head_maps", "maps of one length G with values in [0, G)", maps)
        object.__setattr__(self, "_hash", hash(self.to_json()))  # once: jit hashes it on every call

    def __hash__(self) -> int:  # hashable, so jit can take a schedule as a static argument
        return self._hash

    def role(self, layer: int) -> tuple[str, int | None, tuple[int, ...] | None]:
        """What ``layer`` runs.

        Returns:
            ("dense", None, None) for a layer the schedule does not cover (dense attention);
            ("anchor", None, None) for an anchor (the first one with dense output);
            ("reuse", its anchor, its head map) for a reuse layer.
        """
        if layer not in self.layers:
            return "dense", None, None
        if layer in self.anchors:
            return "anchor", None, None
        return "reuse", max(a for a in self.anchors if a < layer), self.head_maps[layer]

    def to_json(self) -> str:
        """The schedule as a JSON text (``from_json`` reads it back)."""
        d = dataclasses.asdict(self)
        d["head_maps"] = {str(k): list(v) for k, v in self.head_maps.items()}
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> KascadeSchedule:
        """Read :meth:`to_json`'s text.

        Raises:
            ValueError: the text is not a schedule (naming what is wrong).
        """
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"schedule: expected JSON text, got an error: {e}") from e
        known = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, dict) or set(d) - known or not {"layers", "anchors", "head_maps"} <= set(d):
            fail("schedule", f"a JSON object with the keys {sorted(known)}", sorted(d) if isinstance(d, dict) else d)
        if "tile_size" in d:  # written before block selection: tokens
            d.setdefault("pool_size", 1)
        return cls(**d)

    def save(self, path: str | os.PathLike) -> None:
        """Write the schedule as JSON to ``path``."""
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> KascadeSchedule:
        """Read a schedule :meth:`save` wrote.

        Raises:
            ValueError: the file is not a schedule (the message names the file).
        """
        with open(path) as f:
            text = f.read()
        try:
            return cls.from_json(text)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e


def own_starts(NT: int, tile_size: int, pool_size: int = 1) -> np.ndarray:
    """[NT] where each tile's own block starts: its pool boundary floor(s_t / P) P."""
    return np.arange(NT) * tile_size // pool_size * pool_size


def _masses(P, selections, tile_size: int, pool_size: int):
    """(each tile's own-block mass [B, G, NT], mass on the selections [B, G(P), G(selections), NT])."""
    P = np.asarray(P, np.float64)
    NT, T = P.shape[2:]
    block = np.where(np.arange(T)[None, :] >= own_starts(NT, tile_size, pool_size)[:, None], P, 0).sum(-1)
    sel = np.asarray(selections)
    picked = np.take_along_axis(P[:, :, None], np.maximum(sel, 0)[:, None], axis=-1)
    return block, np.where(sel[:, None] >= 0, picked, 0).sum(-1)


def pair_similarity(P, own, anchor, tile_size: int, pool_size: int = 1) -> np.ndarray:
    """How well an anchor's selection serves a layer, per head pair.

    Args:
        P: [B, G, NT, T] the layer's pooled probabilities (every key, the tile's own included;
            :func:`kdax.ops.kascade.reference.pooled_probabilities`).
        own: [B, G, NT, k] the layer's own selection (-1 for none).
        anchor: [B, G, NT, k'] the anchor's selection.
        tile_size, pool_size: queries per tile, keys per selected pool.

    Returns:
        [G, G] float64: entry (g, g') is the mass of the layer's head g on the anchor's head g'
        selection plus the tile's block, over that on its own selection plus the block; the minimum
        over query tiles, the mean over rows.
    """
    block, on_anchor = _masses(P, anchor, tile_size, pool_size)
    _, on_own = _masses(P, own, tile_size, pool_size)
    mine = np.diagonal(on_own, axis1=1, axis2=2).transpose(0, 2, 1)  # [B, G, NT]
    ratio = (on_anchor + block[:, :, None]) / np.maximum(mine + block, 1e-300)[:, :, None]
    return ratio.min(axis=-1).mean(axis=0)


def output_similarity(run, selections, tile_size: int, pool_size: int = 1) -> np.ndarray:
    """Head-pair similarities by the error of a layer's output: entry [a, l, g, g'] is
    ``1 - G * e``, e the squared error of layer l's output when its KV head g attends anchor
    a's head-g' selection (plus each tile's own block) and its other heads every key, relative
    to the squared norm of its output with every key, over the calibration rows. The mean over
    g of the best entries is then 1 - the summed error of the layer with its best head map (the
    heads' cross terms left out): the measure :func:`choose_anchors`
    maximises.

    Args:
        run: ``run(l, indices)`` -> layer l's output (any shape) when its KV heads attend
            indices [B, G, NT, W] (-1 for none) besides each tile's own block.
        selections: per layer its own selection [B, G, NT, k] (:func:`kdax.models.kascade.dense_pass`).
        tile_size, pool_size: queries per tile, keys per selected pool.

    Returns:
        [L, L, G, G] float64 (0 below the diagonal).
    """
    B, G, NT = selections[0].shape[:3]
    starts = own_starts(NT, tile_size, pool_size)
    W = int(starts[-1])
    keys = np.arange(W)[None, :]
    every = np.where(keys < starts[:, None], keys, -1).astype(np.int32)
    every = np.broadcast_to(every, (B, G, NT, W))
    L = len(selections)
    pairs = np.zeros((L, L, G, G))
    for l in range(L):
        dense = np.asarray(run(l, jnp.asarray(every)), np.float64)
        norm = max(float(np.sum(dense**2)), 1e-300)
        for a in range(l + 1):
            chosen = np.pad(selections[a], [(0, 0)] * 3 + [(0, W - selections[a].shape[-1])], constant_values=-1)
            for g in range(G):
                for g2 in range(G):
                    idx = every.copy()
                    idx[:, g] = chosen[:, g2]
                    y = np.asarray(run(l, jnp.asarray(idx)), np.float64)
                    pairs[a, l, g, g2] = 1 - G * float(np.sum((y - dense) ** 2)) / norm
    return pairs


def recall(P, selection, tile_size: int, pool_size: int = 1) -> float:
    """The share of a layer's dense attention mass that a selection (plus each tile's own block) keeps.

    Args:
        P: [B, G, NT, T] the layer's pooled probabilities (as :func:`pair_similarity`).
        selection: [B, G, NT, k] the keys each tile attends besides its block (-1 for none),
            already remapped to the layer's heads.
        tile_size, pool_size: queries per tile, keys per selected pool.

    Returns:
        The kept mass over the total, summed over rows, heads and tiles 1.. (tile 0 attends
        only its own block).
    """
    block, on = _masses(P, selection, tile_size, pool_size)
    kept = block + np.diagonal(on, axis1=1, axis2=2).transpose(0, 2, 1)
    total = np.asarray(P, np.float64).sum(-1)
    return float(kept[:, :, 1:].sum() / max(total[:, :, 1:].sum(), 1e-300))


def layer_similarity(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Layer-level similarity and head maps from head-pair similarities.

    Args:
        pairs: [L, L, G, G]: pairs[a, l] the :func:`pair_similarity` of anchor a serving layer l
            (used for a <= l).

    Returns:
        (similarity [L, L]: the mean over l's heads of the best anchor head; head maps [L, L, G]:
        that best head (ties toward the smaller index)).
    """
    pairs = np.asarray(pairs, np.float64)
    return pairs.max(axis=-1).mean(axis=-1), pairs.argmax(axis=-1).astype(np.int32)


def choose_anchors(similarity, importance, n_anchors: int) -> tuple[int, ...]:
    """The anchors that maximise the importance-weighted similarity of every layer to its anchor.

    Layer 0 is always an anchor; layer l is served by the latest anchor a <= l and scores
    importance[l] * similarity[a, l]. Exact: a dynamic program over the segments each anchor
    serves, O(n_anchors L^2).

    Args:
        similarity: [L, L], similarity[a, l] for a <= l (similarity[l, l] is a layer's own: 1).
        importance: [L] non-negative weights.
        n_anchors: anchors to place, 1 <= n_anchors <= L.

    Returns:
        The anchors' positions in 0..L-1, ascending, layer 0 first.

    Raises:
        ValueError: ``n_anchors`` is out of range or the shapes disagree.
    """
    S = np.asarray(similarity, np.float64)
    w = np.asarray(importance, np.float64)
    L = len(w)
    if S.shape != (L, L):
        fail("similarity", f"shape ({L}, {L}) matching importance", S.shape)
    if isinstance(n_anchors, bool) or not isinstance(n_anchors, (int, np.integer)) or not 1 <= n_anchors <= L:
        fail("n_anchors", f"an int in [1, {L}]", repr(n_anchors))
    # serve[a, b]: the score of layers a..b-1 served by anchor a
    weighted = np.triu(S * w[None, :])
    serve = np.full((L, L + 1), -np.inf)
    for a in range(L):
        serve[a, a + 1 :] = np.cumsum(weighted[a, a:])
    # best[n, b]: the best score of layers 0..b-1 with n anchors, the last one's segment ending at b
    best = np.full((n_anchors + 1, L + 1), -np.inf)
    back = np.zeros((n_anchors + 1, L + 1), int)
    best[1, 1:] = serve[0, 1:]
    for n in range(2, n_anchors + 1):
        for b in range(n, L + 1):
            cand = best[n - 1, 1:b] + serve[1:b, b]  # the last anchor a in 1..b-1, the previous ones end at a
            back[n, b] = 1 + int(np.argmax(cand))
            best[n, b] = cand[back[n, b] - 1]
    anchors, b = [], L
    for n in range(n_anchors, 1, -1):
        b = back[n, b]
        anchors.append(b)
    return (0, *sorted(anchors))


def layer_importance(x, attn) -> float:
    """1 - cos(x, x + attn(x)), averaged over tokens: how much a layer turns the residual stream.

    Args:
        x: [..., d] the residual stream entering the attention sublayer.
        attn: [..., d] the sublayer's output.

    Returns:
        A float in [0, 2].
    """
    x, y = jnp.asarray(x, jnp.float32), jnp.asarray(x, jnp.float32) + jnp.asarray(attn, jnp.float32)
    cos = jnp.sum(x * y, -1) / jnp.maximum(jnp.linalg.norm(x, axis=-1) * jnp.linalg.norm(y, axis=-1), 1e-30)
    return float(jnp.mean(1 - cos))


def build_schedule(
    layers,
    pairs,
    importance,
    n_anchors: int,
    *,
    topk_percent=10,
    min_k=128,
    tile_size=TILE_SIZE,
    pool_size=POOL_SIZE,
) -> KascadeSchedule:
    """A schedule from calibration statistics.

    Args:
        layers: the model's softmax layers (L of them), ascending.
        pairs: [L, L, G, G] head-pair similarities (:func:`pair_similarity`, anchor first).
        importance: [L] layer importances (:func:`layer_importance`).
        n_anchors: anchors to place (the first layer among them).
        topk_percent, min_k, tile_size, pool_size: the options the statistics were computed with.

    Returns:
        The :class:`KascadeSchedule`.
    """
    layers = tuple(int(x) for x in layers)
    similarity, maps = layer_similarity(pairs)
    picks = choose_anchors(similarity, importance, n_anchors)
    head_maps = {}
    for i, layer in enumerate(layers):
        if i not in picks:
            anchor = max(a for a in picks if a < i)
            head_maps[layer] = tuple(int(g) for g in maps[anchor, i])
    anchors = tuple(layers[a] for a in picks)
    return KascadeSchedule(layers, anchors, head_maps, topk_percent, min_k, tile_size, pool_size)
