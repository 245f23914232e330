"""Hybrid KDA language models: config, model, generation, checkpoints (FLA's format)."""

from kdax.models.checkpoint import from_pretrained, save_pretrained
from kdax.models.config import KDAConfig
from kdax.models.generation import generate
from kdax.models.kda import KDAForCausalLM, KDAModel, ModelCache

__all__ = ["KDAConfig", "KDAForCausalLM", "KDAModel", "ModelCache", "from_pretrained", "generate", "save_pretrained"]
