"""kdax: Kimi Delta Attention and Kascade sparse attention for JAX."""

from kdax.ops.common.dispatch import explain_backend, use_backend
from kdax.ops.common.lowering import lower
from kdax.ops.common.validation import LayoutWarning, debug_checks
from kdax.ops.kascade.api import (
    index_select,
    indexed_attention,
    kascade_anchor,
    kascade_anchor_decode,
    kascade_reuse,
    kascade_reuse_decode,
)
from kdax.ops.kascade.schedule import KascadeSchedule
from kdax.ops.kda.api import chunk_kda, fused_recurrent_kda
from kdax.ops.kda.context_parallel import ContextParallel
from kdax.ops.kda.gate import beta_activation, kda_gate, l2norm
from kdax.ops.kda.reference import naive_chunk_kda, naive_recurrent_kda
from kdax.ops.mla.api import paged_latent_attention

__version__ = "0.7.0"

__all__ = [
    "ContextParallel",
    "KascadeSchedule",
    "LayoutWarning",
    "beta_activation",
    "chunk_kda",
    "debug_checks",
    "explain_backend",
    "fused_recurrent_kda",
    "index_select",
    "indexed_attention",
    "kascade_anchor",
    "kascade_anchor_decode",
    "kascade_reuse",
    "kascade_reuse_decode",
    "kda_gate",
    "l2norm",
    "lower",
    "naive_chunk_kda",
    "naive_recurrent_kda",
    "paged_latent_attention",
    "use_backend",
]
