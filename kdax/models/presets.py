"""Model presets, shared by ``kdax train`` and ``kdax bench model``: ``PRESETS`` maps a name
to a function that returns its :class:`KDAConfig`."""

from __future__ import annotations

from collections.abc import Callable

from kdax.models.config import KDAConfig


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


PRESETS: dict[str, Callable[[], KDAConfig]] = {
    "tiny": tiny_config,
    "attn8": attn8_config,
    # FLA's KDAConfig defaults (24 layers, hidden 2048, 16 heads of 128) with attention on every 4th layer
    "24x2048": lambda: KDAConfig(attn={"layers": [3, 7, 11, 15, 19, 23], "num_heads": 16}),
}
