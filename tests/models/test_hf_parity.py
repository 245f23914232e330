"""Kimi Linear, the Ling hybrids and GLM-5.3-Flash against transformers: tiny random models that
transformers built and saved (tests/fixtures/hf, made by scripts/hf_parity_fixtures.py with
transformers 5.24.0), their float32 logits on T = 70 tokens (not a multiple of the chunk), on a
left-padded batch, and their greedy continuations; GLM's indexers' selections; kdax's
save_pretrained writes the same tensors back."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from kdax.bench.measure import rel_rms
from kdax.models import (
    BailingHybridForCausalLM,
    Glm5NextForCausalLM,
    KimiLinearForCausalLM,
    from_pretrained,
    generate,
    save_pretrained,
)

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
CASES = ["kimi_a", "kimi_b", "ling_a", "ling_b", "glm5_a", "glm5_b"]
FAMILIES = {"kimi": KimiLinearForCausalLM, "ling": BailingHybridForCausalLM, "glm5": Glm5NextForCausalLM}
PARITY = 1e-4  # rel. RMS of the logits against transformers' float32 (the issue's bar)


def _expected(case):
    return np.load(os.path.join(FIXTURES, case, "expected.npz"))


def _tensors(directory):
    out = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, f)))
    return out


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case):
    model = from_pretrained(os.path.join(FIXTURES, case), backend="xla")
    assert isinstance(model, FAMILIES[case.split("_")[0]])
    e = _expected(case)
    assert rel_rms(model(jnp.asarray(e["input_ids"])), e["logits"]) <= PARITY
    mask = e["attention_mask"].astype(bool)  # row 0 left-padded: compare the tokens' positions
    got = model(jnp.asarray(e["mask_input_ids"]), attention_mask=jnp.asarray(e["attention_mask"]))
    assert rel_rms(np.asarray(got)[mask], e["mask_logits"][mask]) <= PARITY


@pytest.mark.parametrize(
    "case",
    ["kimi_a", "ling_a", "glm5_b", *(pytest.param(c, marks=pytest.mark.slow) for c in ("kimi_b", "ling_b", "glm5_a"))],
)
def test_greedy_continuation_equals_transformers(case):
    """Prefill, then decoding through the MLA latent cache and the KDA states, token for token."""
    model = from_pretrained(os.path.join(FIXTURES, case), backend="xla")
    e = _expected(case)
    n = e["greedy"].shape[1] - e["prompt"].shape[1]
    np.testing.assert_array_equal(generate(model, jnp.asarray(e["prompt"]), n), e["greedy"])


@pytest.mark.parametrize("case", ["glm5_a", pytest.param("glm5_b", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "backend", ["xla", *(pytest.param(b, marks=pytest.mark.slow) for b in ("naive", "pallas_tpu"))]
)
def test_indexers_select_what_transformers_selects(case, backend):
    """Each full indexed layer's keys per query, as sets (transformers lists them by score), equal
    transformers' on T = 70 tokens, well past index_topk: pools, the tail, -1 padding; the
    fixtures' inputs keep every query's k-th and next pool scores index_gap apart (no near-ties)."""
    import kdax

    model = from_pretrained(os.path.join(FIXTURES, case), backend="xla")
    e = _expected(case)
    assert float(e["index_gap"]) >= 1e-4
    with kdax.use_backend(backend):
        got = model.selections(jnp.asarray(e["input_ids"]))
    assert len(got) == len(e["indices"])
    for (layer, indices), want in zip(sorted(got.items()), e["indices"]):
        assert indices.shape == want.shape
        np.testing.assert_array_equal(np.sort(indices, -1), np.sort(want, -1), err_msg=f"layer {layer}")


@pytest.mark.slow  # 45 s: the kernel interpreted (tests/ops/kascade/test_dsa.py runs it in CI on small shapes)
def test_indexed_attention_on_the_tpu_kernel_gives_transformers_logits():
    """GLM-5.3's indexed layers with kdax.use_backend("pallas_tpu"): the attention over the selected
    latents on the TPU kernel (kascade_indexed_attend, Pallas interpreter), the logits within the bar."""
    import kdax

    model = from_pretrained(os.path.join(FIXTURES, "glm5_b"), backend="xla")
    e = _expected("glm5_b")
    with kdax.use_backend("pallas_tpu"):
        assert rel_rms(model(jnp.asarray(e["input_ids"])), e["logits"]) <= PARITY


@pytest.mark.parametrize("case", ["kimi_a", "ling_b", "glm5_b", pytest.param("glm5_a", marks=pytest.mark.slow)])
def test_save_pretrained_writes_the_hub_tensors(case, tmp_path):
    """The same names, shapes and values as the checkpoint (ling_b's MTP layer and GLM-5.3's
    vision tower too, kept as loaded in model.mtp), and a config that reads back to the same config."""
    src = os.path.join(FIXTURES, case)
    model = from_pretrained(src, backend="xla")
    save_pretrained(model, str(tmp_path))
    ours, theirs = _tensors(tmp_path), _tensors(src)
    assert len(model.mtp) == {"ling_b": 34, "glm5_a": 25, "glm5_b": 25}.get(case, 0)
    if case.startswith("kimi"):  # transformers writes the dense MLPs under block_sparse_moe; the hub under mlp
        theirs = {k.replace("block_sparse_moe.gate_proj", "mlp.gate_proj"): v for k, v in theirs.items()}
        theirs = {k.replace("block_sparse_moe.up_proj", "mlp.up_proj"): v for k, v in theirs.items()}
        theirs = {k.replace("block_sparse_moe.down_proj", "mlp.down_proj"): v for k, v in theirs.items()}
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
    with open(os.path.join(tmp_path, "config.json")) as f:
        assert type(model.config).from_dict(json.load(f)) == model.config
    e = _expected(case)
    again = from_pretrained(str(tmp_path), backend="xla")
    np.testing.assert_array_equal(again(jnp.asarray(e["input_ids"])), model(jnp.asarray(e["input_ids"])))


@pytest.mark.parametrize(
    "case",
    ["kimi_b", *(pytest.param(c, marks=pytest.mark.slow) for c in ("ling_b", "glm5_b", "kimi_a", "ling_a", "glm5_a"))],
)
def test_bfloat16_loads_and_generates(case):
    """astype(bf16): the logits as near float32's as transformers' own bf16 (2.8-5.4% on these
    4-layer models: bf16 weights and activations, not either library), generation runs."""
    model = from_pretrained(os.path.join(FIXTURES, case), backend="xla", dtype=jnp.bfloat16)
    e = _expected(case)
    assert rel_rms(model(jnp.asarray(e["input_ids"])), e["logits"]) <= 1.25 * float(e["bf16_rel_rms"])
    out = generate(model, jnp.asarray(e["prompt"]), 4)
    assert out.shape == (2, e["prompt"].shape[1] + 4)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_live_transformers_round_trip(case, tmp_path):
    """transformers (installed) builds a fresh random model of each case's config; kdax loads what
    it saves to its logits, and transformers loads what kdax saves to the same logits."""
    pytest.importorskip("transformers")
    import importlib.util

    import torch

    path = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "hf_parity_fixtures.py")
    spec = importlib.util.spec_from_file_location("hf_parity_fixtures", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    torch_model = script.build(case)
    with torch.no_grad():  # fresh values: the seeded case's weights moved by seeded noise
        torch.manual_seed(7)
        for p in torch_model.parameters():
            p.mul_(1 + 0.2 * torch.randn_like(p))
    ids = np.random.default_rng(3).integers(3, torch_model.config.vocab_size, (2, 45), dtype=np.int32)
    want = script.reference(torch_model, ids)
    torch_model.save_pretrained(tmp_path / "hf")
    model = from_pretrained(str(tmp_path / "hf"), backend="xla")
    assert rel_rms(model(jnp.asarray(ids)), want) <= PARITY
    save_pretrained(model, str(tmp_path / "kdax"))
    back = script.family(case)[1].from_pretrained(tmp_path / "kdax", attn_implementation="eager").eval()
    assert rel_rms(script.reference(back, ids), want) <= 1e-6
