"""Flax NNX layers for KDA models (FLA's parameter structure, so checkpoints convert)."""

from kdax.nn.attention import Attention, KascadeStep
from kdax.nn.conv import ShortConvolution
from kdax.nn.hyper import HyperConnection
from kdax.nn.kda import KDACache, KimiDeltaAttention
from kdax.nn.mla import MLA
from kdax.nn.mlp import GatedMLP
from kdax.nn.moe import MoE, TopKRouter
from kdax.nn.norm import GatedRMSNorm, RMSNorm

__all__ = [
    "Attention",
    "GatedMLP",
    "GatedRMSNorm",
    "HyperConnection",
    "KDACache",
    "KascadeStep",
    "KimiDeltaAttention",
    "MLA",
    "MoE",
    "RMSNorm",
    "ShortConvolution",
    "TopKRouter",
]
