"""GLM-5.3-Flash beyond parity (tests/models/test_hf_parity.py): the indexer's cache over a prompt
prefilled in parts, gradients, the config's and the model's errors."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdax.bench.measure import rel_rms
from kdax.models import Glm5NextConfig, Glm5NextForCausalLM, from_pretrained, glm5_tiny_config
from kdax.nn.dsa import IndexedMLA
from kdax.train import loss_fn
from tests.tolerances import F32

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")


@pytest.fixture(scope="module")
def model():
    return from_pretrained(os.path.join(FIXTURES, "glm5_b"), backend="xla")  # a shared indexed layer, pools of 4


def _ids(B, T, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(3, 128, (B, T)), jnp.int32)


@pytest.mark.slow  # 140 s on the 2-core CI; test_hf_parity's greedy continuation keeps GLM's caches in CI
def test_a_prompt_prefilled_in_parts_then_decoded_is_the_forward(model):
    """Parts of 29 and 12 tokens (not multiples of the pools) into one cache, then a decode step: the
    logits of the whole 42 tokens' forward, the later queries selecting among the cached pools."""
    ids = _ids(2, 42)
    whole = model(ids)
    prefill, decode = nnx.jit(lambda m, x, c: m.prefill(x, c)), nnx.jit(lambda m, x, c: m.decode(x, c))
    cache = model.init_cache(2, 48)
    first, cache = prefill(model, ids[:, :29], cache)
    second, cache = prefill(model, ids[:, 29:41], cache)
    step, cache = decode(model, ids[:, 41], cache)
    assert rel_rms(first, whole[:, :29]) <= F32["out"]
    assert rel_rms(second, whole[:, 29:41]) <= F32["out"]
    assert rel_rms(step, whole[:, 41]) <= F32["out"] and (cache.lengths == 42).all()


@pytest.mark.slow  # CI's time; run by hand with -m slow
def test_rows_of_different_lengths_prefill_as_each_alone(model):
    ids = _ids(2, 30, seed=1)
    cache = model.init_cache(2, 32)
    logits, _ = nnx.jit(lambda m, x, c: m.prefill(x, c, lengths=jnp.array([30, 17])))(model, ids, cache)
    assert rel_rms(logits[1, :17], model(ids[1:, :17])[0]) <= F32["out"]


@pytest.mark.slow  # CI's time; run by hand with -m slow
def test_gradients_reach_every_weight_but_the_indexers():
    """transformers runs the indexer without gradients; everything else learns."""
    model = Glm5NextForCausalLM(glm5_tiny_config(), rngs=nnx.Rngs(0))
    grads = nnx.grad(loss_fn)(model, _ids(2, 40))
    for path, g in nnx.to_flat_state(grads):
        g = np.asarray(g.get_value())
        assert np.isfinite(g).all(), path
        if "indexer" in path:
            assert not g.any(), path
        elif path[-1] not in ("base",):  # hyper-connection biases at zero still get gradients
            assert g.any(), path


def test_what_the_model_refuses(model):
    ids = _ids(1, 8)
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(ids, cu_seqlens=jnp.array([0, 8]))
    with pytest.raises(ValueError, match="kascade"):
        model(ids, kascade=object())
    with pytest.raises(ValueError, match="pixel_values"):
        model(ids, pixel_values=jnp.zeros((1, 3, 8, 8)))
    shared = next(b.attn for b in model.model.layers if isinstance(b.attn, IndexedMLA) and b.attn.indexer is None)
    with pytest.raises(ValueError, match="indices: layer 2 shares"):
        shared(jnp.zeros((1, 4, 40)))


@pytest.mark.parametrize(
    "change, match",
    [
        ({"qk_rope_head_dim": 64}, "qk_rope_head_dim: expected 0"),
        ({"q_lora_rank": None}, "q_lora_rank"),
        ({"index_topk": 18}, "index_topk: expected a multiple of index_kpool=4"),
        ({"indexer_types": ["full", "shared", "full", "full"]}, "indexer_types: layer 1 is 'shared'"),
        ({"indexer_types": ["full", "full", "sometimes", "full"]}, "indexer_types: expected entries"),
        ({"layer_types": ["linear_attention"] * 3 + ["sliding"]}, "layer_types: expected entries"),
        ({"linear_lower_bound": 1.0}, "linear_lower_bound"),
        ({"hc_mult": 0}, "hc_mult"),
    ],
)
def test_config_errors_name_the_field(change, match):
    with pytest.raises(ValueError, match=match):
        glm5_tiny_config(**change)


def test_config_reads_transformers_spellings():
    """Legacy layer-type names, indexer_types from index_topk_pattern, linear_attn_config, a text
    config's model_type; to_dict writes the multimodal form that reads back the same."""
    d = glm5_tiny_config().to_dict()["text_config"]
    d = {**d, "model_type": "glm5_next_text", "indexer_types": None, "index_topk_pattern": "FFSF"}
    d["layer_types"] = ["mamba", "deepseek_sparse_attention", "full_attention", "linear_attention"]
    d["linear_attn_config"] = {"num_heads": 4, "head_dim": 32, "gate_lower_bound": -4.0}
    config = Glm5NextConfig.from_dict(d)
    assert config.layer_types == ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"]
    assert config.indexer_types == ["full", "full", "shared", "full"] and config.linear_lower_bound == -4.0
    assert Glm5NextConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="model_type"):
        Glm5NextConfig.from_dict({"model_type": "kimi_linear"})


@pytest.mark.slow  # CI's time; run by hand with -m slow
def test_selections_shapes_and_tracing(model):
    ids = _ids(2, 25)
    got = model.selections(ids)
    assert sorted(got) == [1, 5] and all(s.shape == (2, 25, 11) and s.dtype == jnp.int32 for s in got.values())
    again = jax.vmap(lambda x: model.selections(x[None]))(ids)
    for k in got:
        np.testing.assert_array_equal(again[k][:, 0], got[k])
