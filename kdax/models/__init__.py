"""Hybrid KDA language models: FLA's layout, Kimi Linear, the Ling hybrids and GLM-5.3-Flash; configs, presets,
generation, checkpoints (FLA's and the hub's formats)."""

from kdax.models.checkpoint import from_pretrained, save_pretrained
from kdax.models.config import KDAConfig
from kdax.models.generation import generate, stream
from kdax.models.hf_config import BailingHybridConfig, Glm5NextConfig, KimiLinearConfig
from kdax.models.hybrids import BailingHybridForCausalLM, Glm5NextForCausalLM, KimiLinearForCausalLM, model_class
from kdax.models.kda import KDAForCausalLM, KDAModel, ModelCache
from kdax.models.presets import PRESETS, glm5_tiny_config, kimi_tiny_config, ling_tiny_config, tiny_config
from kdax.models.sharding import shard

__all__ = [
    "PRESETS",
    "BailingHybridConfig",
    "BailingHybridForCausalLM",
    "Glm5NextConfig",
    "Glm5NextForCausalLM",
    "KDAConfig",
    "KDAForCausalLM",
    "KDAModel",
    "KimiLinearConfig",
    "KimiLinearForCausalLM",
    "ModelCache",
    "from_pretrained",
    "model_class",
    "generate",
    "glm5_tiny_config",
    "kimi_tiny_config",
    "ling_tiny_config",
    "save_pretrained",
    "shard",
    "stream",
    "tiny_config",
]
