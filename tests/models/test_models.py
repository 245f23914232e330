"""KDAConfig, KDAForCausalLM, generate and checkpoints: shapes, jit, grads, caches, varlen, errors."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from kdax.bench.measure import rel_rms
from kdax.models import (
    PRESETS,
    BailingHybridForCausalLM,
    Glm5NextForCausalLM,
    KDAConfig,
    KDAForCausalLM,
    KimiLinearForCausalLM,
    generate,
    generation,
    model_class,
    tiny_config,
)
from kdax.models.checkpoint import from_pretrained, save_pretrained
from kdax.models.kda import row_segments
from tests.tolerances import BF16, F32

VOCAB = 61


def _config(**kw):
    attn = {"layers": [1], "num_heads": 4, "num_kv_heads": 2, "window_size": 6}
    args = {"hidden_size": 32, "head_dim": 8, "num_heads": 2, "num_v_heads": 4, "num_hidden_layers": 3}
    return KDAConfig(**{**args, "vocab_size": VOCAB, "attn": attn, "intermediate_size": 48, **kw})


@pytest.fixture(scope="module")
def model():
    return KDAForCausalLM(_config(), backend="xla", rngs=nnx.Rngs(0))


def _ids(B, T, seed=1):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, VOCAB, jnp.int32)


def test_logits_shape_and_jit(model):
    ids = _ids(2, 19)
    logits = model(ids)
    assert logits.shape == (2, 19, VOCAB) and logits.dtype == jnp.float32
    jitted = nnx.jit(lambda m, x: m(x))(model, ids)
    assert rel_rms(jitted, logits) <= F32["same"]


def test_grad_through_whole_model():
    model = KDAForCausalLM(_config(tie_word_embeddings=True, lower_bound=-5.0), backend="xla", rngs=nnx.Rngs(0))
    ids = _ids(2, 17)

    def loss(m):
        logp = jax.nn.log_softmax(m(ids[:, :-1]))
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

    value, grads = nnx.value_and_grad(loss)(model)
    assert np.isfinite(float(value))
    for path, g in nnx.to_flat_state(grads):
        g = np.asarray(g[...])
        assert np.all(np.isfinite(g)) and np.abs(g).max() > 0, path


def test_eval_mode_recurrent_equals_chunk(model):
    """FLA's rule in eval mode runs <= 64-token inputs through the recurrent kernel."""
    ids = _ids(2, 23)
    chunk = model(ids)
    model.eval()
    try:
        assert model.model.layers[0].attn.pick_mode(23) == "fused_recurrent"
        assert rel_rms(model(ids), chunk) <= F32["out"]
    finally:
        model.train()


def test_attention_mask_and_cu_seqlens_equal_per_sequence_runs(model):
    lengths = [5, 1, 12]
    seqs = [_ids(1, L, seed=10 + i) for i, L in enumerate(lengths)]
    forward = nnx.jit(lambda m, ids, mask=None, cu=None: m(ids, attention_mask=mask, cu_seqlens=cu))
    singles = [forward(model, s)[0] for s in seqs]
    T = max(lengths)
    ids = jnp.zeros((3, T), jnp.int32)
    mask = np.zeros((3, T), np.int32)
    for b, (s, L) in enumerate(zip(seqs, lengths)):  # left, right and no padding
        start = T - L if b == 0 else 0
        ids = ids.at[b, start : start + L].set(s[0])
        mask[b, start : start + L] = 1
    out = forward(model, ids, mask)
    for b in range(len(lengths)):
        assert rel_rms(out[b][mask[b] == 1], singles[b]) <= F32["out"]
        assert float(jnp.abs(out[b][mask[b] == 0]).max(initial=0.0)) == 0.0
    cu = jnp.array(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    packed = forward(model, jnp.concatenate(seqs, axis=1), cu=cu)[0]
    for n, single in enumerate(singles):
        assert rel_rms(packed[int(cu[n]) : int(cu[n + 1])], single) <= F32["out"]


def test_prefill_then_decode_equals_full_forward(model):
    ids = _ids(2, 20)
    full = model(ids)
    lengths = jnp.array([14, 9], jnp.int32)
    prompt = jnp.where(jnp.arange(14)[None] < lengths[:, None], ids[:, :14], 0)
    logits, cache = model.prefill(prompt, model.init_cache(2, 24), lengths)
    assert rel_rms(logits[0], full[0, :14]) <= F32["out"] and rel_rms(logits[1, :9], full[1, :9]) <= F32["out"]
    decode = nnx.jit(lambda m, tokens, cache: m.decode(tokens, cache))
    for step in range(6):
        pos = lengths + step
        logits, cache = decode(model, ids[jnp.arange(2), pos], cache)
        assert rel_rms(logits, full[jnp.arange(2), pos]) <= F32["out"]


def test_bfloat16_weights_serve_in_bfloat16(model, tmp_path):
    """astype(bf16): activations, KV and conv caches in bf16, KDA states and logits float32;
    full forward and prefill + decode within the bf16 bar of the float32 model."""
    ids = _ids(2, 20)
    full = model(ids)
    save_pretrained(model, str(tmp_path))
    bf16 = from_pretrained(str(tmp_path), backend="xla", dtype=jnp.bfloat16)
    attn, kda = bf16.model.layers[1].attn, bf16.model.layers[0].attn
    assert bf16.dtype == attn.q_proj.kernel.dtype == kda.q_conv1d.weight.dtype == jnp.bfloat16
    assert kda.A_log.dtype == kda.dt_bias.dtype == kda.o_norm.weight.dtype == jnp.float32
    hidden, _ = jax.eval_shape(lambda: bf16.model(ids, row_segments(2, 20, jnp.full((2,), 20, jnp.int32))))
    logits = bf16(ids)
    assert hidden.dtype == jnp.bfloat16 and logits.dtype == jnp.float32 and rel_rms(logits, full) <= BF16["grad"]
    cache = bf16.init_cache(2, 24)
    assert cache.layers[1][0].dtype == cache.layers[0].conv[0].dtype == jnp.bfloat16
    assert cache.layers[0].recurrent.dtype == jnp.float32
    logits, cache = nnx.jit(lambda m, x, c: m.prefill(x, c))(bf16, ids[:, :16], cache)
    assert rel_rms(logits, full[:, :16]) <= BF16["grad"]
    decode = nnx.jit(lambda m, tokens, c: m.decode(tokens, c))
    for pos in range(16, 20):
        logits, cache = decode(bf16, ids[:, pos], cache)
        assert rel_rms(logits, full[:, pos]) <= BF16["grad"]
    assert cache.layers[1][0].dtype == cache.layers[0].conv[0].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        bf16.astype(jnp.int32)


def test_generate_greedy_equals_rerunning_full_forward(model):
    """Causality makes one forward over the final sequence equal to re-running the model on
    every grown prefix: the logits at position n - 1 see only tokens < n."""
    ids = _ids(2, 7)
    mask = np.ones((2, 7), np.int32)
    mask[1, :3] = 0  # left padding
    out = generate(model, ids, 6, attention_mask=mask)
    assert out.shape == (2, 13) and bool(jnp.all(out[:, :7] == ids))
    logits = model(out, attention_mask=np.concatenate([mask, np.ones((2, 6), np.int32)], axis=1))
    assert bool(jnp.all(jnp.argmax(logits[:, 6:-1], axis=-1) == out[:, 7:]))


def _compiles(fn) -> int:
    """The XLA compilations (jitted functions and eager ops alike) that running fn() triggers."""
    seen = []
    listener = lambda event, _secs, **_: (
        seen.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
    )
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jax.block_until_ready(fn())
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return len(seen)


def test_generate_compiles_once_per_bucket():
    """A prompt of another length and another max_new_tokens in the same bucket compile
    nothing: not the prefill, not the decode step, not an eager op; the padded prompt
    continues as the unpadded one does."""
    model = KDAForCausalLM(
        _config(attn={"layers": [1], "num_heads": 4, "num_kv_heads": 2}), backend="xla", rngs=nnx.Rngs(0)
    )
    assert generation.buckets(5, 9) == generation.buckets(13, 20) == (16, 64)
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 13), np.int32)  # NumPy: no compile in the test itself
    assert _compiles(lambda: generate(model, ids[:, :5], 9)) > 0
    assert _compiles(lambda: generate(model, ids, 20)) == 0
    assert _compiles(lambda: generate(model, ids[:, :11], 7, attention_mask=np.ones((2, 11), np.int32))) == 0
    out = generate(model, ids, 6)
    assert np.array_equal(np.stack(list(generation.stream(model, ids, 6)), axis=1), out[:, 13:])
    with pytest.raises(ValueError, match=r"options: expected generate\(\)'s keywords"):
        generation.stream(model, ids, 6, temp=0.5)
    logits = model(out[:, :-1])
    assert bool(jnp.all(jnp.argmax(logits[:, 12:], axis=-1) == out[:, 13:]))


def test_generate_eos_and_sampling(model):
    ids = _ids(3, 6)
    greedy = generate(model, ids, 8)
    eos = int(greedy[0, 8])  # row 0 emits it at its third step
    out = generate(model, ids, 8, eos_token_id=eos)
    first = int(np.argmax(np.asarray(out[0, 6:]) == eos))
    assert first <= 2 and bool(jnp.all(out[0, 6 + first :] == eos))
    assert bool(jnp.all(out[0, : 6 + first] == greedy[0, : 6 + first]))
    key = jax.random.key(5)
    assert bool(jnp.all(generate(model, ids, 5, temperature=0.7, top_k=1, rng=key) == greedy[:, :11]))
    assert bool(jnp.all(generate(model, ids, 5, temperature=1.3, top_p=1e-6, rng=key) == greedy[:, :11]))
    a = generate(model, ids, 5, temperature=1.0, rng=key)
    assert bool(jnp.all(a == generate(model, ids, 5, temperature=1.0, rng=key)))
    assert int(a[:, 6:].min()) >= 0 and int(a[:, 6:].max()) < VOCAB


def test_sample_logits_top_p_keeps_the_smallest_set():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    draws = {int(generation.sample_logits(logits, jax.random.key(i), 1.0, None, 0.7)[0]) for i in range(200)}
    assert draws == {0, 1}
    draws = {int(generation.sample_logits(logits, jax.random.key(i), 1.0, 3, None)[0]) for i in range(200)}
    assert draws == {0, 1, 2}


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 1.5}, "top_p"),
        ({"eos_token_id": VOCAB}, "eos_token_id"),
        ({"temperature": 1.0}, "rng"),
        ({"input_ids": jnp.zeros((2, 3, 1), jnp.int32)}, "input_ids"),
        ({"input_ids": jnp.full((1, 3), VOCAB, jnp.int32)}, "input_ids"),
        ({"attention_mask": np.zeros((2, 4))}, "attention_mask"),
        ({"attention_mask": np.ones((2, 3))}, "attention_mask"),
    ],
)
def test_generate_bad_arguments_name_the_field(model, kw, field):
    args = {"input_ids": jnp.zeros((2, 4), jnp.int32), "max_new_tokens": 2, **kw}
    with pytest.raises(ValueError, match=field):
        generate(model, **args)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_v_heads": 3}, "num_v_heads"),
        ({"expand_v": 0.3}, "expand_v"),
        ({"attn_mode": "parallel"}, "attn_mode"),
        ({"safe_gate": True}, "lower_bound"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attn": {"layers": [5], "num_heads": 4}}, "attn.layers"),
        ({"attn": {"layers": [0], "num_heads": 5}}, "attn.num_heads"),
        ({"attn": {"layers": [0], "num_heads": 4, "num_kv_heads": 3}}, "attn.num_kv_heads"),
        ({"attn": {"layers": [0], "num_heads": 4, "window": 3}}, "attn"),
        ({"attnres_block_size": 2}, "attnres_block_size"),
        ({"eos_token_id": VOCAB}, "eos_token_id"),
        ({"head_dim": 320}, "head_dim: expected at most 256"),
    ],
)
def test_bad_configs_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        _config(**kw)


def test_config_round_trips_through_json():
    config = _config(lower_bound=-5.0, tie_word_embeddings=True)
    d = json.loads(json.dumps(config.to_dict()))
    assert KDAConfig.from_dict({**d, "architectures": ["KDAForCausalLM"], "torch_dtype": "float32"}) == config
    with pytest.raises(ValueError, match="model_type"):
        KDAConfig.from_dict({**d, "model_type": "llama"})


def test_presets_build_their_configs():
    assert set(PRESETS) == {"tiny", "attn8", "24x2048", "kimi-tiny", "ling-tiny", "glm5-tiny"}
    assert PRESETS["tiny"] is tiny_config and model_class(PRESETS["glm5-tiny"]()) is Glm5NextForCausalLM
    kimi, ling = PRESETS["kimi-tiny"](), PRESETS["ling-tiny"]()
    assert model_class(kimi) is KimiLinearForCausalLM and model_class(ling) is BailingHybridForCausalLM
    assert kimi.vocab_size == ling.vocab_size == 256 and model_class(tiny_config()) is KDAForCausalLM
    with pytest.raises(ValueError, match="config: expected one of"):
        model_class({"model_type": "kda"})
    assert PRESETS["tiny"]().vocab_size == 256 and tiny_config(num_hidden_layers=3).num_hidden_layers == 3
    big = PRESETS["24x2048"]()
    assert (big.num_hidden_layers, big.hidden_size, big.attn["layers"]) == (24, 2048, [3, 7, 11, 15, 19, 23])
    with pytest.raises(ValueError, match="hidden_size"):
        tiny_config(hidden_size=0)


@pytest.mark.parametrize("tie", [False, True])
def test_checkpoint_round_trip_in_fla_layout(tmp_path, tie):
    model = KDAForCausalLM(_config(tie_word_embeddings=tie), backend="xla", rngs=nnx.Rngs(2))
    save_pretrained(model, str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["model.layers.0.attn.q_proj.weight"].shape == (16, 32)  # torch [out, in]
    assert tensors["model.layers.0.attn.q_conv1d.weight"].shape == (16, 1, 4)
    assert ("lm_head.weight" in tensors) == (not tie)
    assert {"model.layers.0.attn.f_proj.1.weight", "model.layers.0.attn.g_proj.1.bias"} <= set(tensors)
    loaded = from_pretrained(str(tmp_path), backend="xla")
    ids = _ids(2, 11)
    assert rel_rms(loaded(ids), model(ids)) == 0.0


def test_checkpoint_errors_name_the_tensor(tmp_path):
    model = KDAForCausalLM(_config(), backend="xla", rngs=nnx.Rngs(2))
    save_pretrained(model, str(tmp_path))
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    save_file({k: v for k, v in tensors.items() if k != "model.norm.weight"}, path)
    with pytest.raises(ValueError, match="model.norm.weight"):
        from_pretrained(str(tmp_path))
    save_file({**tensors, "model.layers.0.attn.A_log": np.zeros(3, np.float32)}, path)
    with pytest.raises(ValueError, match="A_log"):
        from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="directory"):
        from_pretrained(str(tmp_path / "missing"))


def test_safetensors_bf16_round_trip(tmp_path):
    """safetensors' NumPy API stores and loads bfloat16 (ml_dtypes) as it is."""
    import ml_dtypes

    a = {"x": np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16), "y": np.array([1, 2], np.int64)}
    save_file(a, str(tmp_path / "t.safetensors"))
    b = load_file(str(tmp_path / "t.safetensors"))
    assert b["x"].dtype == a["x"].dtype and np.array_equal(b["x"], a["x"]) and np.array_equal(b["y"], a["y"])


def test_bfloat16_checkpoint_loads(tmp_path):
    """A checkpoint stored in bfloat16 (as FLA's often are) loads, into float32 parameters."""
    import ml_dtypes

    model = KDAForCausalLM(_config(), backend="xla", rngs=nnx.Rngs(2))
    save_pretrained(model, str(tmp_path))
    path = str(tmp_path / "model.safetensors")
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(path).items()}, path)
    loaded = from_pretrained(str(tmp_path), backend="xla")
    kernel = model.model.layers[0].attn.q_proj.kernel[...]
    assert loaded.model.layers[0].attn.q_proj.kernel.dtype == jnp.float32
    np.testing.assert_array_equal(loaded.model.layers[0].attn.q_proj.kernel[...], kernel.astype(jnp.bfloat16))


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors_name_the_file(tmp_path, damage):
    model = KDAForCausalLM(_config(), backend="xla", rngs=nnx.Rngs(2))
    save_pretrained(model, str(tmp_path))
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100] if damage == "truncated" else b"not a safetensors file" * 4)
    with pytest.raises(ValueError, match=re.escape(f"complete safetensors file at '{path}'")):
        from_pretrained(str(tmp_path))


def test_missing_directory_and_corrupt_json_name_the_path(tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"'{tmp_path / 'nowhere'}' is not a directory")):
        from_pretrained(str(tmp_path / "nowhere"))
    model = KDAForCausalLM(_config(), backend="xla", rngs=nnx.Rngs(2))
    save_pretrained(model, str(tmp_path))
    config = tmp_path / "config.json"
    config.write_text(config.read_text()[:20])
    with pytest.raises(ValueError, match=re.escape(f"expected valid JSON in '{config}'")):
        from_pretrained(str(tmp_path))
