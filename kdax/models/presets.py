"""Model presets, shared by ``kdax train`` and ``kdax bench model``: ``PRESETS`` maps a name
to a function that returns its config (:class:`KDAConfig`, or a Kimi Linear, Ling or GLM-5.3 one; build
the model with :func:`kdax.models.model_class`)."""

from __future__ import annotations

from collections.abc import Callable

from kdax.models.config import KDAConfig
from kdax.models.hf_config import BailingHybridConfig, Glm5NextConfig, KimiLinearConfig


def tiny_config(**overrides) -> KDAConfig:
    """A 4-layer byte-level hybrid (hidden 128, one attention layer), 1.1M parameters.

    Args:
        **overrides: KDAConfig fields that replace the preset's.

    Returns:
        The config.
    """
    args = {
        "hidden_size": 128,
        "head_dim": 32,
        "num_heads": 4,
        "num_hidden_layers": 4,
        "vocab_size": 256,
        "attn": {"layers": [2], "num_heads": 4},
        "bos_token_id": 0,
        "eos_token_id": 0,
        "tie_word_embeddings": True,
    }
    return KDAConfig(**{**args, **overrides})


def attn8_config(**overrides) -> KDAConfig:
    """An attention-heavy 8-layer byte-level hybrid for Kascade studies: softmax attention (4 query
    heads, 2 KV heads of 32) on layers 0-2 and 4-6, KDA on layers 3 and 7; hidden 128.

    Args:
        **overrides: KDAConfig fields that replace the preset's.

    Returns:
        The config.
    """
    args = {
        "hidden_size": 128,
        "head_dim": 32,
        "num_heads": 4,
        "num_hidden_layers": 8,
        "vocab_size": 256,
        "attn": {"layers": [0, 1, 2, 4, 5, 6], "num_heads": 4, "num_kv_heads": 2},
        "bos_token_id": 0,
        "eos_token_id": 0,
        "tie_word_embeddings": True,
    }
    return KDAConfig(**{**args, **overrides})


_TINY_MLA_MOE = {
    "vocab_size": 256,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
    "pad_token_id": 0,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def kimi_tiny_config(**overrides) -> KimiLinearConfig:
    """A 4-layer byte-level Kimi Linear (hidden 128; KDA, MLA on layer 2; 8 experts, top-2 after a
    dense first layer), about 1.3M parameters.

    Args:
        **overrides: KimiLinearConfig fields that replace the preset's.

    Returns:
        The config.
    """
    args = {**_TINY_MLA_MOE, "linear_head_dim": 32, "linear_num_heads": 4}
    return KimiLinearConfig(**{**args, **overrides})


def ling_tiny_config(**overrides) -> BailingHybridConfig:
    """A 4-layer byte-level Ling hybrid (hidden 128; KDA with the safe gate, MLA with RoPE and a
    query LoRA on layer 2; 8 experts in 2 groups, top-2 after a dense first layer).

    Args:
        **overrides: BailingHybridConfig fields that replace the preset's.

    Returns:
        The config.
    """
    args = {**_TINY_MLA_MOE, "head_dim": 32, "q_lora_rank": 64, "n_group": 2, "topk_group": 1}
    args["first_k_dense_replace"] = 1
    return BailingHybridConfig(**{**args, **overrides})


def glm5_tiny_config(**overrides) -> Glm5NextConfig:
    """A 4-layer byte-level GLM-5.3-Flash (hidden 128, 2 residual streams; KDA on layers 0 and 3,
    DSA indexed attention on 1 and 2, layer 2 sharing layer 1's selection of 16 keys in pools of
    4 plus the tail; 8 experts, top-2 after a dense first layer).

    Args:
        **overrides: Glm5NextConfig fields that replace the preset's.

    Returns:
        The config.
    """
    args = {
        **{k: v for k, v in _TINY_MLA_MOE.items() if k not in ("num_local_experts", "qk_rope_head_dim")},
        "n_routed_experts": 8,
        "qk_rope_head_dim": 0,
        "q_lora_rank": 64,
        "layer_types": ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
        "indexer_types": ["full", "full", "shared", "full"],
        "index_topk": 16,
        "index_kpool": 4,
        "index_n_heads": 4,
        "index_head_dim": 32,
        "linear_head_dim": 32,
        "linear_num_heads": 4,
        "hc_mult": 2,
    }
    return Glm5NextConfig(**{**args, **overrides})


PRESETS: dict[str, Callable[[], KDAConfig | KimiLinearConfig | BailingHybridConfig | Glm5NextConfig]] = {
    "tiny": tiny_config,
    "attn8": attn8_config,
    # FLA's KDAConfig defaults (24 layers, hidden 2048, 16 heads of 128) with attention on every 4th layer
    "24x2048": lambda: KDAConfig(attn={"layers": [3, 7, 11, 15, 19, 23], "num_heads": 16}),
    "kimi-tiny": kimi_tiny_config,
    "ling-tiny": ling_tiny_config,
    "glm5-tiny": glm5_tiny_config,
}
