"""vLLM's TPU engine (tpu-inference 0.32.0) serving the tiny Kimi Linear checkpoint (and Ling's,
greedy) through kdax's plugin on CPU devices: greedy tokens equal to kdax's generate(), with an n-gram drafter,
with align-mode prefix caching, under tensor parallel 2, with two data-parallel attention groups, and through ``vllm serve``'s OpenAI
completions endpoint; and the cache specs the plugin gives the engine.

They need vllm-tpu (Python 3.12) and take 3 to 4 minutes, so they carry the ``vllm`` marker and
run by hand (docs/guide.md, "Serve with vLLM")::

    python -m pytest -m vllm tests/integrations/test_vllm_engine.py
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("tpu_inference")
pytestmark = pytest.mark.vllm

from kdax.models import from_pretrained, generate  # noqa: E402

CHECKPOINT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf", "kimi_a")
WORKER = os.path.join(os.path.dirname(__file__), "vllm_engine_worker.py")
PROMPTS = [[5, 9, 17, 33, 3, 40], [7] * 11, [100, 3]]


@pytest.fixture(scope="module")
def model():
    return from_pretrained(CHECKPOINT, backend="xla")


def _greedy(model, prompt, n):
    return np.asarray(generate(model, jnp.asarray([prompt], jnp.int32), n))[0, len(prompt) :].tolist()


def _engine(scenario, prompts, max_tokens, checkpoint=CHECKPOINT):
    run = subprocess.run(
        [sys.executable, WORKER, checkpoint, scenario],
        input=json.dumps({"prompts": prompts, "max_tokens": max_tokens}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.parametrize("case", ["kimi_a", "ling_a", "glm5_a", "glm5_b"])
def test_greedy_tokens_equal_generate(case):
    """Three requests prefilled together (6, 11 and 2 tokens), then decoded together; Kimi
    Linear (MLA pages as the engine's MLA layout), Ling (vLLM takes it for plain attention:
    the plugin sizes its pages, and reads its config.json where transformers cannot) and GLM-5.3
    (multimodal and flat config.json; pages wide enough for the indexer's keys beside the latents,
    selections of 4 and 8 keys well inside these prompts and continuations)."""
    checkpoint = os.path.join(os.path.dirname(CHECKPOINT), case)
    out = _engine("greedy", PROMPTS, 6, checkpoint)
    model = from_pretrained(checkpoint, backend="xla")
    assert out["tokens"] == [_greedy(model, p, 6) for p in PROMPTS]
    assert [n for _, n, _, _ in out["steps"][0]] == [6, 11, 2]


def _verified(steps):
    """(drafts verified, drafts accepted) over the steps: a request's step of 1 + k tokens after
    its prefill verifies k drafts; its next step starts after the accepted ones."""
    last, verified, accepted = {}, 0, 0
    for step in steps:
        for computed, n, *slot in step:  # slot: (state slot, attention group)
            slot = tuple(slot)
            if slot in last and last[slot][1] > 1 and last[slot][0] > 0:
                verified += last[slot][1] - 1
                accepted += computed - last[slot][0] - 1
            last[slot] = (computed, n)
    return verified, accepted


def test_ngram_drafts_give_the_tokens_of_generate(model):
    """An n-gram drafter proposing up to 3 tokens: the tokens are those of greedy decoding, and
    the verify steps accept some drafts and reject others. The prompts are greedy continuations
    cut where the drafter's first proposal is right in its first token and wrong after (found
    by running vLLM's n-gram matcher over them), so a step continues from the second of its
    request's four state slots."""
    prompts = _drafted_prompts(model)
    out = _engine("spec", prompts, 12)
    assert out["tokens"] == [_greedy(model, p, 12) for p in prompts]
    verified, accepted = _verified(out["steps"])
    assert 0 < accepted < verified


def test_align_mode_prefix_hit_gives_the_tokens_of_generate(model):
    """Prefix caching in align mode: a second request sharing 35 tokens with a finished first
    one starts from the state checkpointed at its second 16-token block (32 tokens computed)."""
    rng = np.random.default_rng(3)
    first = rng.integers(3, 128, 40).tolist()
    second = first[:35] + rng.integers(3, 128, 7).tolist()
    out = _engine("align", [first, second], 6)
    assert out["tokens"] == [_greedy(model, first, 6), _greedy(model, second, 6)]
    starts = [computed for step in out["steps"] for computed, n, _, _ in step if n > 1]
    assert starts == [0, 32, 32]  # the first prompt in two steps of 32 and 8, the second from its hit


def test_tensor_parallel_2_gives_the_tokens_of_generate(model):
    """Two fake CPU devices on the model axis: KDA states and pages sharded as the engine shards them."""
    out = _engine("tp2", PROMPTS, 6)
    assert out["tokens"] == [_greedy(model, p, 6) for p in PROMPTS]


def test_tensor_parallel_2_with_an_odd_vocabulary_gives_the_tokens_of_generate(tmp_path):
    """A vocabulary of 127, which two devices do not divide: the plugin pads the embedding and the
    LM head to a multiple of the tensor-parallel size and masks the padding's logits."""
    from flax import nnx

    from kdax.models import KimiLinearForCausalLM, kimi_tiny_config, save_pretrained

    layers = {"layer_types": ["linear_attention", "full_attention"], "mlp_layer_types": ["dense", "sparse"]}
    odd = KimiLinearForCausalLM(kimi_tiny_config(num_hidden_layers=2, vocab_size=127, **layers), rngs=nnx.Rngs(3))
    save_pretrained(odd, str(tmp_path))
    prompts = [[5, 9, 17, 33, 3, 40], [126] * 5]
    out = _engine("tp2", prompts, 6, str(tmp_path))
    assert out["tokens"] == [_greedy(odd, p, 6) for p in prompts]


def _drafted_prompts(model):
    """Greedy continuations cut where vLLM's n-gram drafter's first proposal is right in its first
    token and wrong after (found by running its matcher over them)."""
    chains = np.asarray(generate(model, jnp.asarray(np.random.default_rng(2).integers(3, 128, (16, 6))), 50))
    return [chains[1, :38].tolist(), chains[13, :24].tolist()]


def test_data_parallel_attention_gives_the_tokens_of_generate(model):
    """Two fake CPU devices as two data-parallel attention groups (``attn_dp_size`` 2: what the
    engine makes of an MLA model in bf16 at tensor parallel 2, here in float32), with n-gram
    drafts: each group's requests, pages and state slots its own (both requests hold slot 1 of
    their group's pool), the MLPs over both devices."""
    prompts = _drafted_prompts(model)
    out = _engine("dp2+spec", prompts, 12)
    assert out["tokens"] == [_greedy(model, p, 12) for p in prompts]
    assert {group for step in out["steps"] for *_, group in step} == {0, 1}
    assert {slot for step in out["steps"] for _, _, slot, _ in step} == {1}  # each group's first slot
    verified, accepted = _verified(out["steps"])
    assert 0 < accepted < verified


def test_data_parallel_attention_with_a_prefix_hit_gives_the_tokens_of_generate(model):
    """Align-mode prefix caching under two attention groups: the second request's hit is found in
    its group's blocks (slots derived from each group's own block tables and offsets); the
    attention weights split over the groups and gathered where used (``gather_attention_weights``)."""
    rng = np.random.default_rng(3)
    first = rng.integers(3, 128, 40).tolist()
    second = first[:35] + rng.integers(3, 128, 7).tolist()
    out = _engine("dp2+align+gather", [first, second], 6)
    assert out["tokens"] == [_greedy(model, first, 6), _greedy(model, second, 6)]
    assert [computed for step in out["steps"] for computed, n, _, _ in step if n > 1] == [0, 32, 32]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_answers_an_openai_completions_request(model, tmp_path):
    """``vllm serve`` on the checkpoint with a word-level tokenizer ("t0" .. "t127"): a
    /v1/completions request's text is the greedy continuation of generate()."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    directory = tmp_path / "kimi"
    shutil.copytree(CHECKPOINT, directory)
    vocab = {f"t{i}": i for i in range(128)}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    words.decoder = tokenizers.decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", eos_token="t2").save_pretrained(directory)
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", KDAX_VLLM_CPU="1", SKIP_JAX_PRECOMPILE="1", NEW_MODEL_DESIGN="1")
    sharding = {"sharding": {"sharding_strategy": {"device_indexes": [0], "enable_dp_attention": True}}}
    args = ["--port", str(port), "--max-model-len", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "32"]
    args += ["--block-size", "16", "--num-gpu-blocks-override", "64", "--dtype", "float32"]
    args += ["--no-enable-prefix-caching", "--additional-config", json.dumps(sharding)]
    server = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", str(directory), *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 300
        while True:
            assert server.poll() is None, server.stderr.read()[-4000:]
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5)
                break
            except OSError:
                assert time.time() < deadline, "vllm serve did not come up in 300 s"
                time.sleep(2)
        prompt = [5, 9, 17, 33, 3, 40]
        body = {"model": str(directory), "prompt": " ".join(f"t{i}" for i in prompt), "max_tokens": 6}
        body["temperature"] = 0
        request = urllib.request.Request(
            f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        reply = json.loads(urllib.request.urlopen(request, timeout=300).read())
        words = reply["choices"][0]["text"].split()
        assert words == [f"t{i}" for i in _greedy(model, prompt, 6)]
    finally:
        server.terminate()
        server.wait(timeout=60)


def _config(checkpoint, mode="none", num_spec=0):
    """The parts of a VllmConfig the plugin's cache specs read."""
    import types

    import torch

    with open(os.path.join(checkpoint, "config.json")) as f:
        d = json.load(f)
    hf = types.SimpleNamespace(**d, to_dict=lambda: dict(d))
    spec = types.SimpleNamespace(num_speculative_tokens=num_spec) if num_spec else None
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_config=hf, dtype=torch.bfloat16, max_model_len=64),
        cache_config=types.SimpleNamespace(mamba_block_size=16, mamba_cache_mode=mode, mamba_page_size_padded=None),
        speculative_config=spec,
    )


@pytest.mark.parametrize("mode,num_spec", [("none", 0), ("none", 3), ("align", 0)])
def test_cache_specs_give_kda_layers_state_pools_of_one_page_size(mode, num_spec):
    """Kimi Linear's KDA layers (0 and 2) get MambaSpecs of the convolution windows [4, 96] in
    the model's dtype, the float32 state [2, 16, 16] and the int32 tag; its MLA layers keep the
    engine's spec; every spec reports one page size, an MLA page plus a KDA slot (two groups of
    two layers: one tensor holds a layer of each)."""
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec

    from kdax.integrations.vllm_tpu.engine import _with_state_specs

    config = _config(CHECKPOINT, mode, num_spec)
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=256, dtype=torch.bfloat16)
    specs, (attn, state) = _with_state_specs(config, {"layer.1": mla, "layer.3": mla}, (True, False, True, False))
    assert sorted(specs) == [f"layer.{i}" for i in range(4)]
    kda = specs["layer.0"]
    assert isinstance(kda, MambaSpec) and specs["layer.2"] == kda
    assert kda.shapes == ((4, 96), (2, 16, 16), (1,))
    assert kda.dtypes == (torch.bfloat16, torch.float32, torch.int32)
    assert kda.mamba_cache_mode == mode and kda.num_speculative_blocks == num_spec and kda.block_size == 16
    assert attn == 16 * 256 * 2 and state == 4 * 96 * 2 + 2 * 16 * 16 * 4 + 4
    assert {s.page_size_bytes for s in specs.values()} == {attn + state} == {config.cache_config.mamba_page_size_padded}
    assert isinstance(specs["layer.1"], MLAAttentionSpec) and specs["layer.1"].head_size == 256


@pytest.fixture
def axis_names(monkeypatch):
    """tpu-inference's axis names of its 7-axis mesh (``NEW_MODEL_DESIGN=1``, which MLA models need)."""
    from tpu_inference.layers.common.sharding import ShardingAxisName

    monkeypatch.setenv("NEW_MODEL_DESIGN", "1")
    ShardingAxisName.reset()
    yield ShardingAxisName
    ShardingAxisName.reset()


@pytest.mark.parametrize("attn_dp, devices", [(1, 2), (2, 4), (4, 4)])
def test_weights_split_over_the_engines_tensor_parallel_axes(model, axis_names, attn_dp, devices):
    """kdax's tensor-parallel layout on tpu-inference's 7-axis mesh, in attention groups: the attention projections by heads over ATTN_HEAD within a group (whole in groups of
    one device), the experts and the embedding's rows over MLP_TENSOR (every device), the
    vocabulary too, the latent projections and norms replicated."""
    import jax
    from jax.sharding import PartitionSpec as P

    from kdax.integrations.vllm_tpu.engine import _placements

    names = ("data", "attn_dp", "attn_dp_expert", "expert", "model", "dcp", "pcp")
    mesh = jax.sharding.AbstractMesh((1, attn_dp, 1, 1, devices // attn_dp, 1, 1), names)
    specs = {".".join(map(str, p)): s.spec for p, s in _placements(model, mesh).items()}
    head, mlp = axis_names.ATTN_HEAD, axis_names.MLP_TENSOR
    split = head if devices > attn_dp else None
    assert specs["model.layers.0.attn.q_proj.kernel"] == P(None, split)
    assert specs["model.layers.0.attn.o_proj.kernel"] == P(split, None)
    assert specs["model.layers.1.mlp.gate_up"] == P(mlp, None, None)
    assert specs["model.embeddings.embedding"] == P(mlp, None)
    assert specs["lm_head.kernel"] == P(None, mlp)
    assert not any(specs["model.layers.1.attn.kv_a_proj_with_mqa.kernel"])
