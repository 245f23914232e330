"""Build the Hugging Face parity fixtures in tests/fixtures/hf (transformers 5.24.0, torch 2.13.0).

Tiny random ``kimi_linear`` (``KimiLinearForCausalLM``), ``bailing_hybrid`` (``BailingHybridForCausalLM``, Ling) and
``glm5_next`` (``Glm5NextForConditionalGeneration``, GLM-5.3-Flash, with the smallest vision tower that builds)
models, seeded and float32, run on the CPU with eager attention and transformers' own torch KDA code:

    pip install torch==2.13.0 transformers==5.24.0
    python scripts/hf_parity_fixtures.py [OUT_DIR]     # OUT_DIR defaults to tests/fixtures/hf; ~15 s on 2 CPU cores

For each name in ``CASES`` it writes ``OUT_DIR/<name>/``: what ``save_pretrained`` writes (config.json,
generation_config.json, safetensors under the checkpoints' original names, which transformers renames and fuses on
load; 5.24 also names Kimi's dense MLP ``block_sparse_moe.*``. ``ling_b`` is sharded, with an index, and has an MTP
layer past ``num_hidden_layers``, which inference ignores) and ``expected.npz`` with

- ``input_ids`` int32 [2, 70] and their ``logits`` float32 [2, 70, vocab] (70: not a multiple of the 64-token chunk);
- ``mask_input_ids``, ``attention_mask`` int32 [2, 20], row 0 left-padded by 5 tokens, and their ``mask_logits``
  (positions are 0..19 whatever the padding, as transformers' forward has them; compare unpadded positions only);
- ``prompt`` int32 [2, 9] and ``greedy`` int64 [2, 21]: 12 tokens of ``generate`` (greedy, with the cache: a chunked
  prefill, then the recurrent path), checked against argmax over full forwards without a cache; the prompt is drawn
  again until no step has its top two logits within 0.01;
- ``bf16_rel_rms``: the relative RMS error of the logits of the same checkpoint loaded by transformers in bfloat16,
  the bar for kdax's bfloat16 (the error of bfloat16 weights and activations in this model, not of either library);
- GLM only: ``indices`` int32 [full indexed layers, 2, 70, index_topk + index_kpool - 1], each "full" indexed layer's
  selected token indices (-1: empty) for ``input_ids``, and ``index_gap``, the least gap between a query's k-th and
  next selectable pool score. The inputs (and the greedy prompt) are drawn again until that gap is at least
  ``INDEX_MARGIN``: the indexer's ReLU scores tie exactly where a query's head weights are all negative, and
  torch's top-k breaks ties in no stated order.

Norm weights are scaled by 1 + 0.1 N(0, 1) and router expert biases drawn at random, so that a mapping that drops or
misplaces them shows. Each case is loaded back with ``from_pretrained`` and must reproduce its logits.
"""

import contextlib
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from transformers import (
    BailingHybridConfig,
    BailingHybridForCausalLM,
    Glm5NextConfig,
    Glm5NextForConditionalGeneration,
    KimiLinearConfig,
    KimiLinearForCausalLM,
)
from transformers.models.glm5_next import modeling_glm5_next

FAMILIES = {
    "kimi": (KimiLinearConfig, KimiLinearForCausalLM),
    "ling": (BailingHybridConfig, BailingHybridForCausalLM),
    "glm5": (Glm5NextConfig, Glm5NextForConditionalGeneration),
}
TINY = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 40,
    "moe_intermediate_size": 8,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "num_local_experts": 8,
    "initializer_range": 0.1,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
CASES = {
    # Checkpoint style: linear_attn_config (1-indexed layers) and first_k_dense_replace, as in Kimi's config.json.
    "kimi_a": {
        **TINY,
        "qk_rope_head_dim": 8,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.446,
        "first_k_dense_replace": 1,
        "linear_attn_config": {
            "full_attn_layers": [2, 4],
            "kda_layers": [1, 3],
            "head_dim": 16,
            "num_heads": 2,
            "short_conv_kernel_size": 4,
        },
    },
    "kimi_b": {
        **TINY,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 24,
        "num_experts_per_tok": 3,
        "n_group": 4,
        "topk_group": 2,
        "n_shared_experts": 2,
        "routed_scaling_factor": 1.7,
        "rms_norm_eps": 1e-6,
        "first_k_dense_replace": 2,
        "layer_types": ["linear_attention", "full_attention", "full_attention", "linear_attention"],
        "linear_head_dim": 32,
        "linear_num_heads": 2,
        "linear_conv_kernel_dim": 4,
    },
    "ling_a": {
        **TINY,
        "head_dim": 32,
        "qk_rope_head_dim": 16,
        "rope_theta": 10000.0,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "layer_group_size": 2,
        "kda_safe_gate": True,
        "kda_lower_bound": -5.0,
        "num_mtp_layers": 0,
    },
    "ling_b": {
        **TINY,
        "head_dim": 16,
        "qk_rope_head_dim": 8,
        "q_lora_rank": 24,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "n_shared_experts": 2,
        "routed_scaling_factor": 1.5,
        "rms_norm_eps": 1e-5,
        "first_k_dense_replace": 2,
        "layer_group_size": 3,
        "kda_safe_gate": False,
        "num_mtp_layers": 1,
    },
}
# GLM-5.3-Flash: transformers has only the multimodal class, so every case carries a vision tower (the smallest
# that builds), which the text path never runs. 16 indexer heads: with few, a token whose head weights are all
# negative scores every pool 0 (ReLU), and the k-th and next pools tie exactly.
VISION = {
    "depth": 1,
    "hidden_size": 16,
    "num_heads": 2,
    "intermediate_size": 16,
    "projection_intermediate_size": 16,
    "patch_size": 2,
    "image_size": 8,
    "temporal_patch_size": 1,
    "spatial_merge_size": 1,
}
GLM_TINY = {
    **{k: v for k, v in TINY.items() if k != "num_local_experts"},
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 0,
    "index_n_heads": 16,
    "index_head_dim": 8,
    "linear_head_dim": 8,
    "linear_num_heads": 2,
}
CASES |= {
    # Nested text_config (the multimodal layout); the default schedules: KDA at i % 4 != 3, 3 dense MLPs, every
    # indexed layer "full"; pools of 2 tokens, 2 of them a query (index_topk 4) plus the tail.
    "glm5_a": {
        "text_config": {**GLM_TINY, "num_hidden_layers": 8, "index_topk": 4, "index_kpool": 2, "hc_mult": 2},
        "vision_config": {**VISION, "out_hidden_size": 32},
    },
    # Flat (text fields at the top level); a "shared" indexed layer right after a full one, MLPs dense and sparse
    # out of order, 3 streams, pools of 4 (2 a query), other widths (torch's bf16 grouped_mm needs rows of 16 bytes),
    # another gate bound and clamp.
    "glm5_b": {
        **GLM_TINY,
        "hidden_size": 40,
        "intermediate_size": 44,
        "moe_intermediate_size": 24,
        "num_hidden_layers": 6,
        "layer_types": ["linear_attention", "indexed_attention", "indexed_attention"]
        + ["linear_attention"] * 2
        + ["indexed_attention"],
        "indexer_types": ["full", "full", "shared", "full", "full", "full"],
        "mlp_layer_types": ["dense", "sparse", "sparse", "dense", "sparse", "sparse"],
        "n_shared_experts": 2,
        "routed_scaling_factor": 1.8,
        "index_topk": 8,
        "index_kpool": 4,
        "hc_mult": 3,
        "linear_lower_bound": -3.0,
        "swiglu_limit": 0.5,
        "vision_config": {**VISION, "out_hidden_size": 40},
    },
}
SHARDED = {"ling_b": "150KB", "glm5_b": "150KB"}
T, T2, PAD, PROMPT, NEW, MARGIN = 70, 20, 5, 9, 12, 0.01
INDEX_MARGIN = 1e-4  # the least gap between the k-th and the next pool's index score (no near-ties in selections)


def family(name):
    return FAMILIES[name.split("_")[0]]


def build(name):
    """The seeded random float32 model of a case, in eval mode, with eager attention."""
    config_cls, model_cls = family(name)
    torch.manual_seed(zlib.crc32(name.encode()))
    model = model_cls(config_cls(**CASES[name], attn_implementation="eager")).float().eval()
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if type(module).__name__.endswith(("RMSNorm", "RMSNormGated", "LayerNorm")) and hasattr(module, "weight"):
                module.weight.mul_(1 + 0.1 * torch.randn_like(module.weight))
                if getattr(module, "bias", None) is not None:
                    module.bias.add_(0.1 * torch.randn_like(module.bias))
            elif module_name.endswith("mlp.gate"):
                module.e_score_correction_bias.copy_(0.1 * torch.randn_like(module.e_score_correction_bias))
            elif type(module).__name__.endswith("HyperConnection"):  # away from base 0, scale 1
                module.base.add_(0.3 * torch.randn_like(module.base))
                module.scale.mul_(1 + 0.3 * torch.randn_like(module.scale))
    return model


def text_config(model):
    return model.config.get_text_config()


@contextlib.contextmanager
def indexer_calls():
    """Record each indexer's (pool scores [B, S, P] float32, pools selected) as its top-k sees them, and its output
    token indices [B, S, width] int32, in call order."""
    calls, inside = [], []
    topk, forward = torch.Tensor.topk, modeling_glm5_next.Glm5NextTextIndexer.forward

    def recording_topk(self, k, *args, **kwargs):
        if inside:
            calls.append({"scores": self.detach().clone(), "k": k})
        return topk(self, k, *args, **kwargs)

    def recording_forward(self, *args, **kwargs):
        inside.append(True)
        try:
            out = forward(self, *args, **kwargs)
        finally:
            inside.pop()
        calls[-1]["indices"] = out.detach().clone()
        return out

    torch.Tensor.topk, modeling_glm5_next.Glm5NextTextIndexer.forward = recording_topk, recording_forward
    try:
        yield calls
    finally:
        torch.Tensor.topk, modeling_glm5_next.Glm5NextTextIndexer.forward = topk, forward


def least_index_gap(calls):
    """The least gap between the k-th and the (k+1)-th selectable pool's score over every query of the calls (inf
    where no query has more than k selectable pools)."""
    gap = np.inf
    for call in calls:
        scores, k = call["scores"], call["k"]
        valid = scores > torch.finfo(torch.float32).min
        ranked = torch.sort(torch.where(valid, scores, -torch.inf), -1, descending=True).values
        more = valid.sum(-1) > k
        if more.any():
            gap = min(gap, float((ranked[..., k - 1] - ranked[..., k])[more].min()))
    return gap


@torch.no_grad()
def reference(model, input_ids, attention_mask=None):
    """Float32 logits [B, T, vocab] of one forward without a cache."""
    mask = None if attention_mask is None else torch.as_tensor(attention_mask, dtype=torch.long)
    out = model(torch.as_tensor(input_ids, dtype=torch.long), attention_mask=mask, use_cache=False)
    return out.logits.float().numpy()


@torch.no_grad()
def greedy(model, input_ids, n):
    """Prompt and n greedy tokens [B, T + n] from ``generate`` with the cache; no end-of-sequence stop."""
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n,
        use_cache=True,
        eos_token_id=None,
        pad_token_id=text_config(model).pad_token_id,
    )
    assert out.shape == (ids.shape[0], ids.shape[1] + n), out.shape
    return out.numpy().astype(np.int64)


def save(model, name, path):
    """save_pretrained. Ling checkpoints keep their MTP layers at model.layers.{num_hidden_layers + i}, which
    transformers skips; its code tells no more, so the MTP layer added here is a guess: the last decoder layer's norms
    and MoE (router, experts) with DeepSeek's enorm, hnorm and eh_proj."""
    state = model.state_dict()
    n, h = text_config(model).num_hidden_layers, text_config(model).hidden_size
    for i in range(getattr(model.config, "num_mtp_layers", 0)):
        last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n + i}."
        state |= {mtp + k[len(last) :]: v.clone() for k, v in state.items() if k.startswith(last) and "attn" not in k}
        state |= {mtp + "enorm.weight": torch.ones(h), mtp + "hnorm.weight": torch.ones(h)}
        state[mtp + "eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h)
    model.save_pretrained(path, state_dict=state, max_shard_size=SHARDED.get(name, "50GB"))


def main(out_dir="tests/fixtures/hf"):
    for name in CASES:
        start = time.time()
        model, path = build(name), Path(out_dir) / name
        text = text_config(model)
        vocab, rng = text.vocab_size, np.random.default_rng(zlib.crc32(name.encode()))
        extra = {}
        for _ in range(50):  # GLM: input ids whose indexers see no near-tie at their k-th pool
            ids = rng.integers(3, vocab, (2, T), dtype=np.int32)
            with indexer_calls() as calls:
                logits = reference(model, ids)
            if least_index_gap(calls) >= INDEX_MARGIN:
                break
        else:
            raise RuntimeError(f"{name}: no input without an indexer near-tie")
        if calls:  # per full indexed layer, in order: [layers, 2, T, index_topk + index_kpool - 1]
            extra["indices"] = np.stack([c["indices"].numpy() for c in calls]).astype(np.int32)
            extra["index_gap"] = np.float32(least_index_gap(calls))
        mask_ids = rng.integers(3, vocab, (2, T2), dtype=np.int32)
        mask = np.ones((2, T2), np.int32)
        mask_ids[0, :PAD], mask[0, :PAD] = text.pad_token_id, 0
        mask_logits = reference(model, mask_ids, mask)
        for _ in range(50):  # a prompt whose greedy steps have no near-tie: top-2 logit gap >= MARGIN
            prompt = rng.integers(3, vocab, (2, PROMPT), dtype=np.int32)
            tokens = greedy(model, prompt, NEW)
            with indexer_calls() as calls:
                steps = reference(model, tokens[:, :-1])[:, PROMPT - 1 :]  # full forwards without a cache
            assert (steps.argmax(-1) == tokens[:, PROMPT:]).all(), f"{name}: generate is not greedy"
            top2 = np.sort(steps, -1)[..., -2:]
            if (top2[..., 1] - top2[..., 0]).min() >= MARGIN and least_index_gap(calls) >= INDEX_MARGIN:
                break
        else:
            raise RuntimeError(f"{name}: no prompt without a near-tie")
        # The left-padded row's real positions match the same tokens run unpadded (rope is relative; KDA zeroes pads).
        pad_error = np.abs(mask_logits[0, PAD:] - reference(model, mask_ids[:1, PAD:])[0]).max()
        assert pad_error < 1e-4 and np.allclose(mask_logits[1:], reference(model, mask_ids[1:]), atol=1e-5), pad_error

        save(model, name, path)
        np.savez(
            path / "expected.npz",
            input_ids=ids,
            logits=logits,
            mask_input_ids=mask_ids,
            attention_mask=mask,
            mask_logits=mask_logits,
            prompt=prompt,
            greedy=tokens,
            **extra,
        )
        loaded = family(name)[1].from_pretrained(path, attn_implementation="eager").eval()
        assert np.abs(reference(loaded, ids) - logits).max() < 1e-5, f"{name}: from_pretrained changes the logits"
        bf16 = family(name)[1].from_pretrained(path, attn_implementation="eager", dtype=torch.bfloat16).eval()
        bf16_error = np.linalg.norm(reference(bf16, ids) - logits) / np.linalg.norm(logits)
        with np.load(path / "expected.npz") as saved:
            np.savez(path / "expected.npz", **saved, bf16_rel_rms=np.float32(bf16_error))

        for file in sorted(path.glob("*.safetensors")):
            with safe_open(file, "np") as f:
                for key in f.keys():
                    print(f"  {file.name} {key} {list(f.get_slice(key).get_shape())}")
        size = sum(f.stat().st_size for f in path.iterdir()) / 1024
        print(f"{name}: {size:.0f} KB, {time.time() - start:.1f} s, left padding changes logits by {pad_error:.1e}")


if __name__ == "__main__":
    main(*sys.argv[1:])
