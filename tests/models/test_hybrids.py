"""Kimi Linear and the Ling hybrids beyond parity: what every kdax model does (packed sequences,
Kascade on their MLA layers, calibration), on the transformers fixtures of tests/fixtures/hf."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from kdax.bench.measure import rel_rms
from kdax.models import from_pretrained, generate
from kdax.models.kascade import layer_statistics
from kdax.ops.kascade.schedule import KascadeSchedule
from tests.tolerances import F32

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
# kimi_a and ling_a have MLA on layers 1 and 3, two heads each; Ling's (RoPE, output gate) by hand
# with -m slow (its MLA layer runs in CI through tests/nn/test_mla.py and the parity tests)
FULL = KascadeSchedule((1, 3), (1,), {3: (1, 0)}, topk_percent=100, min_k=10_000, tile_size=16, pool_size=1)
SPARSE = KascadeSchedule((1, 3), (1,), {3: (1, 0)}, topk_percent=10, min_k=2, tile_size=16, pool_size=1)


@pytest.fixture(scope="module", params=["kimi_a", pytest.param("ling_a", marks=pytest.mark.slow)])
def model(request):
    return from_pretrained(os.path.join(FIXTURES, request.param), backend="xla")


def _ids(B, T, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(3, 128, (B, T)), jnp.int32)


def test_packed_sequences_equal_each_alone(model):
    """cu_seqlens with an empty and a one-token sequence: each sequence's logits as if run alone."""
    lengths = [30, 0, 1, 39]
    ids = _ids(1, sum(lengths))
    cu = np.concatenate([[0], np.cumsum(lengths)])
    packed = model(ids, cu_seqlens=jnp.asarray(cu, jnp.int32))
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            assert rel_rms(packed[0, a:b], model(ids[:, a:b])[0]) <= F32["out"]


@pytest.mark.slow  # 140 s on the 2-core CI; test_calibration_statistics_on_mla_layers keeps MLA Kascade in CI
def test_kascade_on_mla_layers(model):
    """A schedule that selects every key is dense attention (forward and generation); a sparse one
    changes the logits, and its prefill and decode run through the latent cache."""
    ids = _ids(2, 70)
    dense = model(ids)
    assert rel_rms(model(ids, kascade=FULL), dense) <= F32["out"]
    prompt = _ids(2, 20, seed=1)
    np.testing.assert_array_equal(generate(model, prompt, 6, kascade=FULL), generate(model, prompt, 6))
    sparse = model(ids, kascade=SPARSE)
    assert rel_rms(sparse, dense) > 1e-4
    cache = model.init_cache(2, 80)
    pre, cache = model.prefill(ids, cache, kascade=SPARSE)
    assert rel_rms(pre, sparse) <= F32["out"]
    step, cache = model.decode(ids[:, -1], cache, kascade=SPARSE)
    assert np.isfinite(np.asarray(step)).all() and (cache.lengths == 71).all()


def test_calibration_statistics_on_mla_layers(model):
    layers, pairs, importance = layer_statistics(model, _ids(1, 64), topk_percent=10, min_k=2, tile_size=16)
    assert layers == [1, 3] and pairs.shape == (2, 2, 2, 2) and importance.shape == (2,)
    assert np.all((pairs[0, 1] >= 0) & (pairs[0, 1] <= 1 + 1e-6)) and np.all(importance > 0)


def test_from_pretrained_reads_each_tensor_once_in_the_dtype_onto_a_mesh(monkeypatch):
    """Tensor by tensor: each read once from its shard file, cast to bf16 as read (the same values
    as casting the float32 model), placed on a mesh as kdax.models.shard lays it out."""
    from kdax.models import checkpoint
    from kdax.models.sharding import make_mesh

    reads = []
    get = checkpoint._Tensors.__getitem__
    monkeypatch.setattr(checkpoint._Tensors, "__getitem__", lambda self, name: reads.append(name) or get(self, name))
    path = os.path.join(FIXTURES, "ling_b")  # two shards and an index, an MTP layer
    bf16 = from_pretrained(path, backend="xla", dtype=jnp.bfloat16, mesh=make_mesh("data=1"))
    assert sorted(reads) == sorted(set(reads)) and len(reads) == len(checkpoint._Tensors(path))
    f32 = from_pretrained(path, backend="xla").astype(jnp.bfloat16)
    kernel = lambda m: m.model.layers[2].mlp.gate_up.get_value()
    assert kernel(bf16).dtype == jnp.bfloat16 and kernel(bf16).sharding.mesh.shape == {"data": 1}
    np.testing.assert_array_equal(kernel(bf16), kernel(f32))
    ids = _ids(1, 20)
    np.testing.assert_array_equal(bf16(ids), f32(ids))


def test_from_pretrained_takes_a_hub_id(monkeypatch):
    """An "org/name" that is not a directory goes to huggingface_hub's snapshot_download; without
    the package, or when the hub says no (offline), a ValueError says so."""
    import sys
    import types

    asked = []
    fake = types.SimpleNamespace(
        snapshot_download=lambda repo, allow_patterns: asked.append(repo) or FIXTURES + "/kimi_a"
    )
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake)
    assert from_pretrained("moonshotai/Kimi-Linear-tiny", backend="xla").config.vocab_size == 128
    assert asked == ["moonshotai/Kimi-Linear-tiny"]

    def offline(repo, allow_patterns):
        raise OSError("offline mode is enabled")

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(snapshot_download=offline))
    with pytest.raises(ValueError, match="the Hugging Face hub did not give it .*offline mode"):
        from_pretrained("moonshotai/Kimi-Linear-tiny")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # not installed
    with pytest.raises(ValueError, match="without huggingface_hub installed"):
        from_pretrained("moonshotai/Kimi-Linear-tiny")
    with pytest.raises(ValueError, match="is not a directory"):
        from_pretrained("/no/such/dir")
