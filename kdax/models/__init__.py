"""Hybrid KDA language models: config, presets, model, generation, checkpoints (FLA's format)."""

from kdax.models.checkpoint import from_pretrained, save_pretrained
from kdax.models.config import KDAConfig
from kdax.models.generation import generate
from kdax.models.kda import KDAForCausalLM, KDAModel, ModelCache
from kdax.models.presets import PRESETS, tiny_config
from kdax.models.sharding import shard

__all__ = [
    "PRESETS",
    "KDAConfig",
    "KDAForCausalLM",
    "KDAModel",
    "ModelCache",
    "from_pretrained",
    "generate",
    "save_pretrained",
    "shard",
    "tiny_config",
]
