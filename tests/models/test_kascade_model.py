"""The model under a Kascade schedule: forward, prefill and decode steps, generate()."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdax import KascadeSchedule
from kdax.models import KDAConfig, KDAForCausalLM, generate
from tests.tolerances import F32

# Layers 0, 1, 3, 4 softmax attention (2 KV heads), layer 2 KDA.
CONFIG = KDAConfig(
    hidden_size=32,
    head_dim=8,
    num_heads=4,
    num_hidden_layers=5,
    vocab_size=64,
    attn={"layers": [0, 1, 3, 4], "num_heads": 4, "num_kv_heads": 2},
)
SPARSE = KascadeSchedule(
    (0, 1, 3, 4), (0, 3), {1: (0, 1), 4: (1, 0)}, topk_percent=10, min_k=2, tile_size=16, pool_size=1
)
FULL_TOKENS = KascadeSchedule(
    (0, 1, 3, 4), (0, 3), {1: (0, 1), 4: (1, 0)}, topk_percent=100, min_k=10_000, tile_size=16
)


@pytest.fixture(scope="module")
def model():
    return KDAForCausalLM(CONFIG, rngs=nnx.Rngs(0))


def _ids(B=2, T=70, seed=0):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, 64, jnp.int32)


@pytest.mark.parametrize("pool_size", [pytest.param(1, marks=pytest.mark.slow), 32])  # 1: 75 s on the CI
def test_a_schedule_that_selects_every_key_is_dense(model, pool_size):
    """Every key selected (tokens, or whole pools and each tile's own block from its pool boundary)
    is dense attention, in the forward, with padded rows, and in generation."""
    full = dataclasses.replace(FULL_TOKENS, pool_size=pool_size)
    ids = _ids()
    np.testing.assert_allclose(model(ids, kascade=full), model(ids), atol=2 * F32["out"])
    mask = jnp.ones_like(ids).at[1, 50:].set(0)
    np.testing.assert_allclose(
        model(ids, attention_mask=mask, kascade=full), model(ids, attention_mask=mask), atol=2 * F32["out"]
    )
    prompt = _ids(2, 20)
    np.testing.assert_array_equal(generate(model, prompt, 8, kascade=full), generate(model, prompt, 8))


def test_sparse_prefill_and_decode_agree_with_the_forward(model):
    """Sparse prefill logits are the sparse forward's (and differ from dense); a decode step after
    it runs and advances the cache (its exactness: the full-budget test, where it equals dense)."""
    ids = _ids()
    logits = model(ids, kascade=SPARSE)
    assert np.abs(np.asarray(logits - model(ids))).max() > 1e-4  # sparse attention changes the logits
    cache = model.init_cache(2, 80)
    pre, cache = model.prefill(ids, cache, kascade=SPARSE)
    np.testing.assert_allclose(pre, logits, atol=2 * F32["out"])
    step, cache = model.decode(ids[:, -1], cache, kascade=SPARSE)
    assert np.isfinite(np.asarray(step)).all() and (cache.lengths == 71).all()


def test_generate_with_a_schedule_compiles_each_step_once(model):
    from kdax.models import generation

    generation.decode_sample.clear_cache()
    out = generate(model, _ids(2, 40), 6, kascade=SPARSE)
    assert out.shape == (2, 46)
    assert generation.decode_sample._cache_size() == 1
    generate(model, _ids(2, 40, seed=1), 6, kascade=SPARSE)
    assert generation.decode_sample._cache_size() == 1


@pytest.mark.parametrize(
    ("schedule", "kwargs", "match"),
    [
        (KascadeSchedule((0, 2), (0,), {2: (0, 1)}), {}, "full-attention layers"),
        (KascadeSchedule((0, 1), (0,), {1: (0, 1, 2)}), {}, "head maps of"),
        ("schedule.json", {}, "KascadeSchedule"),
        (SPARSE, {"cu_seqlens": [0, 30, 70]}, "cu_seqlens"),
    ],
)
def test_bad_schedules_raise(model, schedule, kwargs, match):
    ids = _ids(1 if kwargs else 2)
    with pytest.raises(ValueError, match=match):
        model(ids, kascade=schedule, **kwargs)


@pytest.mark.parametrize("objective", ["output", "mass"])
def test_calibration_statistics_and_schedule(model, objective):
    from kdax.models.kascade import calibrate, layer_statistics

    ids = _ids(2, 96, seed=3)
    opts = {"topk_percent": 10, "min_k": 4, "tile_size": 16, "pool_size": 1, "objective": objective}
    if objective == "output":  # and selections of whole pools
        opts |= {"topk_percent": 40, "pool_size": 16}
    layers, pairs, importance = layer_statistics(model, ids, **opts)
    assert layers == [0, 1, 3, 4] and pairs.shape == (4, 4, 2, 2) and importance.shape == (4,)
    if objective == "mass":
        for i in range(4):
            np.testing.assert_allclose(np.diagonal(pairs[i, i]), 1.0, rtol=F32["same"])  # a layer's own selection
    else:  # 1 - G x a relative squared error: below 1 for every pair, a sparse selection changes the output
        assert (pairs[np.triu_indices(4)] < 1).all() and (pairs[np.triu_indices(4)] > -1).all()
    assert (pairs[np.triu_indices(4)] <= 1 + 1e-6).all() and (importance > 0).all()
    schedule = calibrate(model, ids, 2, **opts)
    assert schedule.layers == (0, 1, 3, 4) and schedule.anchors[0] == 0 and len(schedule.anchors) == 2
    assert schedule.pool_size == opts["pool_size"]
    assert np.isfinite(np.asarray(model(ids, kascade=schedule))).all()


def test_calibration_objective_is_checked(model):
    from kdax.models.kascade import calibrate

    with pytest.raises(ValueError, match="objective: expected one of"):
        calibrate(model, _ids(1, 32), 1, objective="recall")


def test_sparse_pass_measures_recall_on_its_own_run(model):
    """The study's pass: the schedule's logits, recall 1 on the dense first layer, and on the
    others the share of that run's attention mass; at a full budget every share is 1."""
    from kdax.models.kascade import sparse_pass

    ids = _ids(1, 96, seed=4)
    logits, kept = sparse_pass(model, ids, schedule=SPARSE)
    np.testing.assert_allclose(logits, model(ids, kascade=SPARSE), atol=2 * F32["out"])
    assert kept[0] == 1.0 and all(0 < r < 1 for r in kept[1:]), kept
    _, full = sparse_pass(model, ids, schedule=FULL_TOKENS)
    np.testing.assert_allclose(full, 1.0, rtol=1e-6)


def test_kdax_kascade_calibrate_writes_a_schedule(model, tmp_path, capsys):
    from kdax.cli import main
    from kdax.models import save_pretrained

    save_pretrained(model, tmp_path / "small_vocab")
    for argv, says in [
        (["--checkpoint", str(tmp_path / "small_vocab")], "--checkpoint: its vocab_size 64 is too small"),  # bytes: 256
        (["--checkpoint", str(tmp_path / "missing")], "--checkpoint: expected a model directory with a config.json"),
        (["--checkpoint", str(tmp_path / "missing"), "--rows", "0"], "argument --rows: expected an int >= 1, got '0'"),
        (["--checkpoint", "x", "--topk-percent", "0"], "argument --topk-percent: expected a percentage in (0, 100]"),
    ]:
        with pytest.raises(SystemExit) as exit:
            main(["kascade", "calibrate", *argv])
        assert exit.value.code == 2 and f"kdax kascade calibrate: error: {says}" in capsys.readouterr().err
    bytes_model = KDAForCausalLM(dataclasses.replace(CONFIG, vocab_size=256), rngs=nnx.Rngs(1))
    save_pretrained(bytes_model, tmp_path / "model")
    out = tmp_path / "schedule.json"
    argv = [
        "kascade",
        "calibrate",
        "--checkpoint",
        str(tmp_path / "model"),
        "--rows",
        "1",
        "--seq-len",
        "64",
        "--anchors",
        "3",
        "--min-k",
        "4",
        "--tile-size",
        "16",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    schedule = KascadeSchedule.load(out)
    assert schedule.layers == (0, 1, 3, 4) and len(schedule.anchors) == 3 and schedule.tile_size == 16
    assert "anchors" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # anchors beyond the model's full-attention layers: named before the pass
        main([*argv, "--anchors", "5"])
    assert (
        "--anchors: expected an int in [1, 4] (the checkpoint's full-attention layers), got 5"
        in capsys.readouterr().err
    )


def test_kdax_kascade_calibrate_defaults_fit_one_attention_layer(tmp_path, capsys):
    """kdax train's model has one full-attention layer: the default --anchors is then 1 (here a
    one-layer model, which compiles in seconds)."""
    from kdax.cli import main
    from kdax.models import save_pretrained, tiny_config

    config = tiny_config(
        hidden_size=16, head_dim=8, num_heads=2, num_hidden_layers=1, attn={"layers": [0], "num_heads": 2}
    )
    save_pretrained(KDAForCausalLM(config, backend="xla", rngs=nnx.Rngs(0)), tmp_path / "model")
    out = tmp_path / "schedule.json"
    argv = [
        "kascade",
        "calibrate",
        "--checkpoint",
        str(tmp_path / "model"),
        "--rows",
        "1",
        "--seq-len",
        "32",
        "--min-k",
        "4",
        "--tile-size",
        "16",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    assert KascadeSchedule.load(out).anchors == (0,) and "anchors [0]" in capsys.readouterr().out


@pytest.mark.slow  # 25 s of CI's budget; the study's own code path (run by hand)
def test_quality_study_methods_agree_at_full_budget(model):
    from kdax.bench.kascade_quality import METHODS, baseline_indices, evaluate, format_table

    ids = _ids(1, 96, seed=5)
    full = dataclasses.replace(SPARSE, min_k=10_000)
    rows = evaluate(model, {"output": full, "mass": full}, ids, 100)
    assert [r["method"] for r in rows] == list(METHODS) and "oracle" in METHODS
    dense = rows[0]["perplexity"]
    for r in rows:  # every method keeps every key
        assert abs(r["perplexity"] - dense) < F32["grad"] * dense and r["recall"] == [1.0] * 4, r
    assert "| 100% | 1 | kascade |" in format_table(rows, [0, 1, 3, 4])
    win = baseline_indices("sink_window", 1, 2, 96, dataclasses.replace(SPARSE, topk_percent=50), 0)
    assert win[0, 0, 5].tolist() == [0, 1, 2, 3, *range(44, 80)]  # tile 5 starts at 80: budget 40
    assert win[0, 0, 1].tolist() == [0, 1, 2, 3, *range(12, 16)] + [-1] * 32  # tile 1: budget 8
    pooled = dataclasses.replace(SPARSE, topk_percent=50, pool_size=16)
    win = baseline_indices("sink_window", 1, 2, 96, pooled, 0)  # tile 5: 2 pools of the 5 before it
    assert win[0, 0, 5].tolist() == [*range(16), *range(64, 80)] and win.shape[-1] == 32
