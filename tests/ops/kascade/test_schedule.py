"""Kascade schedules: the anchor dynamic program against brute force, the statistics against loops,
JSON round trips and checks."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax.ops.kascade import reference
from kdax.ops.kascade.schedule import (
    KascadeSchedule,
    build_schedule,
    choose_anchors,
    layer_importance,
    layer_similarity,
    output_similarity,
    pair_similarity,
)
from tests.tolerances import F32, F64


def _score(S, w, anchors):
    L = len(w)
    serving = [max(a for a in anchors if a <= l) for l in range(L)]
    return sum(w[l] * S[serving[l], l] for l in range(L))


@pytest.mark.parametrize("seed", range(4))
def test_anchor_program_matches_brute_force(seed):
    r = np.random.default_rng(seed)
    L = 8
    S = np.triu(r.uniform(0.2, 1.0, (L, L)))
    np.fill_diagonal(S, 1.0)
    w = r.uniform(0.0, 1.0, L)
    for n in range(1, L + 1):
        got = choose_anchors(S, w, n)
        assert got[0] == 0 and len(got) == n and list(got) == sorted(set(got))
        best = max(_score(S, w, (0, *c)) for c in itertools.combinations(range(1, L), n - 1))
        assert np.isclose(_score(S, w, got), best, rtol=F64["same"])


def test_anchor_program_finds_the_block_structure():
    L = 6
    S = np.full((L, L), 0.1)
    S[:3, :3] = S[3:, 3:] = 0.95  # two groups of similar layers
    np.fill_diagonal(S, 1.0)
    assert choose_anchors(S, np.ones(L), 2) == (0, 3)
    with pytest.raises(ValueError, match="n_anchors"):
        choose_anchors(S, np.ones(L), 7)


def _inputs(seed, B=2, T=96, H=4, G=2, D=8):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.standard_normal((B, T, H, D)) * 2)
    return q, jnp.asarray(r.standard_normal((B, T, G, D)))


def test_pair_similarity_matches_loops_and_is_one_for_itself():
    tile, opts = 16, {"topk_percent": 20, "min_k": 2, "tile_size": 16}
    (q1, k1), (q2, k2) = _inputs(0), _inputs(1)
    P = np.asarray(reference.pooled_probabilities(q1, k1, tile_size=tile))
    own, _ = reference.naive_kascade_anchor(q1, k1, k1, **opts)
    other, _ = reference.naive_kascade_anchor(q2, k2, k2, **opts)
    got = pair_similarity(P, own, other, tile)
    B, G, NT, _ = P.shape
    want = np.zeros((B, G, G))
    for b, g, g2 in itertools.product(range(B), range(G), range(G)):
        ratios = []
        for t in range(NT):
            block = P[b, g, t, t * tile :].sum()
            on_other = sum(P[b, g, t, j] for j in np.asarray(other[b, g2, t]) if j >= 0)
            on_own = sum(P[b, g, t, j] for j in np.asarray(own[b, g, t]) if j >= 0)
            ratios.append((on_other + block) / (on_own + block))
        want[b, g, g2] = min(ratios)
    np.testing.assert_allclose(got, want.mean(0), rtol=F64["same"])
    itself = pair_similarity(P, own, own, tile)
    np.testing.assert_allclose(np.diagonal(itself), 1.0, rtol=F64["same"])
    assert (got <= 1 + 1e-12).all()  # a layer's own top-k holds the most mass a budget can


def test_layer_similarity_and_build_schedule():
    L, G = 4, 2
    pairs = np.full((L, L, G, G), 0.5)
    pairs[0, 1] = [[0.2, 0.9], [0.8, 0.3]]  # layer 1 reads anchor 0's heads swapped
    for layer in range(L):
        pairs[layer, layer] = np.eye(G) * 0.5 + 0.5
    sim, maps = layer_similarity(pairs)
    assert np.isclose(sim[0, 1], 0.85) and maps[0, 1].tolist() == [1, 0]
    schedule = build_schedule([1, 3, 5, 7], pairs, np.ones(L), 2, topk_percent=10, min_k=64, tile_size=32)
    assert schedule.anchors == (1, 5)  # position 2 or 3 scores 3.35, position 1 scores 3 (ties: the first)
    assert schedule.role(0) == ("dense", None, None)
    assert schedule.role(1) == ("anchor", None, None)
    assert schedule.role(3) == ("reuse", 1, (1, 0))
    assert schedule.role(7) == ("reuse", 5, (0, 0))


def test_schedule_round_trips_through_json(tmp_path):
    schedule = KascadeSchedule((0, 2, 3, 5), (0, 3), {2: (1, 0), 5: (0, 0)}, topk_percent=12.5, min_k=64)
    path = tmp_path / "schedule.json"
    schedule.save(path)
    assert KascadeSchedule.load(path) == schedule
    assert hash(KascadeSchedule.load(path)) == hash(schedule)  # a static argument of jit
    assert kdax.KascadeSchedule is KascadeSchedule
    assert (schedule.tile_size, schedule.pool_size) == (128, 128)  # the ops' defaults


def test_a_schedule_written_before_block_selection_loads_as_token_selection():
    """Its JSON has a tile size and no pool size: it selected tokens, and still does."""
    text = (
        '{"layers": [0, 1], "anchors": [0], "head_maps": {"1": [0]}, "topk_percent": 10, "min_k": 128, "tile_size": 32}'
    )
    assert KascadeSchedule.from_json(text).pool_size == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"layers": (2, 1), "anchors": (2,), "head_maps": {1: (0,)}}, "layers"),
        ({"layers": (0, 1), "anchors": (1,), "head_maps": {0: (0,)}}, "anchors"),
        ({"layers": (0, 1, 2), "anchors": (0,), "head_maps": {1: (0,)}}, "head_maps"),
        ({"layers": (0, 1), "anchors": (0,), "head_maps": {1: (2, 0)}}, "head_maps"),
        ({"layers": (0,), "anchors": (0,), "head_maps": {}, "tile_size": 8}, "tile_size"),
        ({"layers": (0,), "anchors": (0,), "head_maps": {}, "pool_size": 8}, "pool_size"),
    ],
)
def test_bad_schedules_raise_value_errors_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KascadeSchedule(**kwargs)


def test_load_names_the_file_of_a_bad_schedule(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"layers": [0], "anchors": [0]}')
    with pytest.raises(ValueError, match="bad.json: schedule"):
        KascadeSchedule.load(path)


def test_layer_importance():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5, 8)))
    assert abs(layer_importance(x, jnp.zeros_like(x))) < F32["same"]
    assert abs(layer_importance(x, -2 * x) - 2.0) < F32["same"]


def test_output_error_and_mass_disagree_and_output_picks_the_output_better_head():
    """Keys 3 and 5 hold 0.3 of a layer's attention each with opposite values, key 7 holds 0.4
    with the mean value. Anchor head 0 selected {3, 7} (0.7 of the mass), head 1 {3, 5} (0.6):
    mass prefers head 0, while head 1's keys reproduce the output exactly, so the output
    objective prefers head 1, and the schedule's head maps follow each objective."""
    T, D, tile = 48, 16, 16
    q = np.zeros((1, T, 2, D))
    q[..., 0] = 1.0
    k = np.zeros((1, T, 2, D))
    for key, mass in ((3, 0.3), (5, 0.3), (7, 0.4)):
        k[0, key, :, 0] = (np.log(mass) + 12) * np.sqrt(D)  # scores ln(mass) + 12 against ~0 elsewhere
    v = np.zeros((1, T, 2, D))
    v[..., 1] = 1.0  # a common part, so the output is not 0
    v[0, 3, :, 0], v[0, 5, :, 0] = 1.0, -1.0
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    anchor = -np.ones((1, 2, 3, 2), np.int32)
    anchor[0, 0, 1:] = [3, 7]
    anchor[0, 1, 1:] = [3, 5]
    own = anchor[:, [0, 0]]  # the layer's own top 2: key 7, then 3 (ties toward the smaller index)

    def run(l, indices):
        return kdax.kascade_reuse(q, k, v, indices, tile_size=tile, pool_size=1, backend="xla")

    out = output_similarity(run, [anchor, own], tile)[0, 1]  # anchor layer 0 serving layer 1
    P = reference.pooled_probabilities(q, k, tile_size=tile)
    mass = pair_similarity(P, own, anchor, tile)
    assert (out.argmax(-1) == 1).all() and (mass.argmax(-1) == 0).all(), (out, mass)
    assert out[:, 1] == pytest.approx(1.0, abs=1e-6) and (out[:, 0] < 0.9).all()
    for pairs, head in ((out, 1), (mass, 0)):
        full = np.zeros((2, 2, 2, 2))
        full[0, 1] = pairs
        full[0, 0] = full[1, 1] = 1.0
        assert build_schedule([0, 1], full, [1.0, 1.0], 1, min_k=2, tile_size=tile, pool_size=1).head_maps == {
            1: (head, head)
        }
