"""The KDA hybrids of Hugging Face checkpoints: Kimi Linear (``kimi_linear``) and the Ling hybrids
(``bailing_hybrid``), on the blocks of :class:`kdax.models.KDAForCausalLM`.

Both stack pre-norm blocks of a token mixer, :class:`kdax.nn.KimiDeltaAttention` on the
"linear_attention" layers and :class:`kdax.nn.MLA` on the "full_attention" ones, and a channel
mixer, a :class:`kdax.nn.GatedMLP` on the "dense" layers and a :class:`kdax.nn.MoE` on the
"sparse" ones. Kimi Linear's KDA layers take their forget and output gates through rank-K
projections and its MLA has no RoPE; Ling's KDA layers use one projection per gate and the
bounded safe gate, and its MLA has interleaved RoPE and a head-wise output gate.

The checkpoints keep the hub's tensor names (as transformers' ``save_pretrained`` writes them):
``q_conv1d``/``k_conv1d``/``v_conv1d`` apart, one tensor per expert and projection, Kimi's
``block_sparse_moe`` and ``f_a_proj``/``f_b_proj``, Ling's ``word_embeddings``, ``attention``,
``dense`` and ``expert_bias``. :func:`hub_entries` names each parameter's tensors, and
:func:`to_checkpoint` and :func:`from_checkpoint` convert between the two layouts
(:mod:`kdax.models.checkpoint` reads and writes them).
"""

from __future__ import annotations

import re

import numpy as np
from flax import nnx

from kdax.models.hf_config import BailingHybridConfig, KimiLinearConfig
from kdax.models.kda import KDAForCausalLM
from kdax.nn import MLA, GatedMLP, KimiDeltaAttention, MoE
from kdax.nn.moe import Buffer


def _mla(config, layer_idx: int, rngs: nnx.Rngs, *, output_gate: bool) -> MLA:
    c = config
    return MLA(
        c.hidden_size,
        c.num_attention_heads,
        kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim,
        qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
        q_lora_rank=c.q_lora_rank,
        rope_theta=c.rope_theta,
        output_gate=output_gate,
        attention_bias=c.attention_bias,
        layer_idx=layer_idx,
        rngs=rngs,
    )


def _kda(config, layer_idx: int, backend: str, rngs: nnx.Rngs, **gate) -> KimiDeltaAttention:
    c = config
    return KimiDeltaAttention(
        c.hidden_size,
        head_dim=c.linear_head_dim,
        num_heads=c.linear_num_heads,
        conv_size=c.linear_conv_kernel_dim,
        output_gate_bias=False,
        layer_idx=layer_idx,
        norm_eps=c.rms_norm_eps,
        backend=backend,
        rngs=rngs,
        **gate,
    )


def _mlp(config, layer_idx: int, rngs: nnx.Rngs):
    c = config
    if c.mlp_layer_types[layer_idx] == "dense":
        return GatedMLP(c.hidden_size, intermediate_size=c.intermediate_size, rngs=rngs)
    return MoE(
        c.hidden_size,
        c.moe_intermediate_size,
        c.num_local_experts,
        c.num_experts_per_tok,
        n_shared_experts=c.n_shared_experts,
        n_group=c.n_group,
        topk_group=c.topk_group,
        norm_topk_prob=c.norm_topk_prob,
        routed_scaling_factor=c.routed_scaling_factor,
        rngs=rngs,
    )


class HubCausalLM(KDAForCausalLM):
    """What the two families share: MLA on the "full_attention" layers, KDA on the others, the
    MLPs of ``mlp_layer_types``, ``rms_norm_eps`` for every RMSNorm. A family sets its MLA's
    ``output_gate`` and its KDA layers' gate options."""

    mla_output_gate = False

    def __init__(self, config, *, backend: str = "auto", rngs: nnx.Rngs):
        super().__init__(config, backend=backend, rngs=rngs)
        # the checkpoint's layers past num_hidden_layers (Ling's multi-token prediction), as loaded:
        # hub name -> Buffer; the causal forward does not use them, save_pretrained writes them back
        self.mtp = nnx.Dict()

    @staticmethod
    def kda_gates(config) -> dict:
        """The family's options of :class:`kdax.nn.KimiDeltaAttention`."""
        return {}

    @classmethod
    def layer(cls, config, layer_idx: int, *, backend: str, rngs: nnx.Rngs):
        if config.layer_types[layer_idx] == "full_attention":
            attn = _mla(config, layer_idx, rngs, output_gate=cls.mla_output_gate)
        else:
            attn = _kda(config, layer_idx, backend, rngs, **cls.kda_gates(config))
        return attn, _mlp(config, layer_idx, rngs)

    @staticmethod
    def norm_eps(config) -> float:
        return config.rms_norm_eps


class KimiLinearForCausalLM(HubCausalLM):
    """Moonshot's Kimi Linear (transformers' ``KimiLinearForCausalLM``): KDA layers with low-rank
    forget and output gates, MLA without RoPE, DeepSeek-style MoE. The interface of
    :class:`kdax.models.KDAForCausalLM` (``model(ids, attention_mask=, cu_seqlens=)``,
    ``prefill``/``decode``/``init_cache``, ``astype``, :func:`kdax.models.generate`).

    Args:
        config: a :class:`kdax.models.KimiLinearConfig`.
        backend: the KDA layers' backend.
        rngs: the parameters' random keys.
    """

    config_class = KimiLinearConfig


class BailingHybridForCausalLM(HubCausalLM):
    """inclusionAI's Ling hybrids (transformers' ``BailingHybridForCausalLM``): KDA layers with the
    bounded safe gate (``kda_safe_gate``) and one projection per gate, MLA with interleaved RoPE
    and a head-wise output gate, DeepSeek-style MoE. The interface of
    :class:`kdax.models.KDAForCausalLM`.

    Args:
        config: a :class:`kdax.models.BailingHybridConfig`.
        backend: the KDA layers' backend.
        rngs: the parameters' random keys.
    """

    config_class = BailingHybridConfig
    mla_output_gate = True

    @staticmethod
    def kda_gates(config: BailingHybridConfig) -> dict:
        return {"low_rank_gates": False, "lower_bound": config.kda_lower_bound if config.kda_safe_gate else None}


MODELS = {"kimi_linear": KimiLinearForCausalLM, "bailing_hybrid": BailingHybridForCausalLM}


def model_class(config) -> type[KDAForCausalLM]:
    """The model class of a config: :class:`kdax.models.KDAForCausalLM` for a ``KDAConfig``,
    :class:`KimiLinearForCausalLM` or :class:`BailingHybridForCausalLM` for theirs.

    Raises:
        ValueError: ``config`` is none of these.
    """
    classes = [KDAForCausalLM, *MODELS.values()]
    for cls in classes:
        if type(config) is cls.config_class:
            return cls
    names = [c.config_class.__name__ for c in classes]
    raise ValueError(f"config: expected one of {names}, got {type(config).__name__}")


# kdax path (dots) -> hub name, in order; then "kernel" -> "weight", transposed.
_COMMON = [
    (r"^model\.layers\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^model\.layers\.(\d+)\.mlp_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"\.layers\.(\d+)\.attn\.", r".layers.\1.self_attn."),
]
_RULES = {
    "kimi_linear": [
        (r"^model\.embeddings\.embedding$", "model.embed_tokens.weight"),
        *_COMMON,
        (r"\.([fg])_proj\.layers\.0\.", r".\1_a_proj."),
        (r"\.([fg])_proj\.layers\.1\.", r".\1_b_proj."),
        (r"\.mlp\.(gate\.|shared_experts\.)", r".block_sparse_moe.\1"),
    ],
    "bailing_hybrid": [
        (r"^model\.embeddings\.embedding$", "model.word_embeddings.weight"),
        *_COMMON,
        (r"\.self_attn\.", ".attention."),
        (r"\.attention\.o_proj\.", ".attention.dense."),
        (r"\.gate\.e_score_correction_bias$", ".gate.expert_bias"),
    ],
}
# each expert's tensors: (projection names of gate, up, down), under the MoE's hub prefix
_EXPERTS = {
    "kimi_linear": (("w1", "w3", "w2"), "block_sparse_moe"),
    "bailing_hybrid": (("gate_proj", "up_proj", "down_proj"), "mlp"),
}


def _hub_name(model_type: str, path: tuple) -> tuple[str, bool]:
    """(hub name, whether transposed) of a parameter path (not the experts')."""
    name = ".".join(map(str, path))
    for pattern, repl in _RULES[model_type]:
        name = re.sub(pattern, repl, name)
    if name.endswith(".kernel"):
        return name[: -len("kernel")] + "weight", True
    return name, False


def _a_log_shape(model_type: str, heads: int) -> tuple[int, ...]:
    return (1, 1, heads, 1) if model_type == "kimi_linear" else (heads,)


def hub_entries(model: HubCausalLM):
    """(path, value, hub names, kind) of every parameter and buffer; kind says how the kdax array
    and the hub tensors relate (:func:`to_checkpoint`)."""
    model_type = model.config.to_dict()["model_type"]
    (gate, up, down), prefix = _EXPERTS[model_type]
    for path, value in nnx.to_flat_state(nnx.state(model, nnx.Any(nnx.Param, Buffer))):
        leaf = path[-1]
        if path[0] == "mtp":
            yield path, value, [path[1]], "same"
            continue
        if leaf in ("gate_up", "down") and len(path) == 5:  # MoE experts: [E, H, 2I] and [E, I, H]
            projs = (gate, up) if leaf == "gate_up" else (down,)
            base = f"model.layers.{path[2]}.{prefix}.experts"
            yield path, value, [f"{base}.{e}.{p}.weight" for e in range(value.shape[0]) for p in projs], "experts"
            continue
        name, transpose = _hub_name(model_type, path)
        kind = "transposed" if transpose else "A_log" if leaf == "A_log" else "same"
        yield path, value, [name], (kind, _a_log_shape(model_type, value.shape[0])) if kind == "A_log" else kind


def to_checkpoint(kind, a: np.ndarray, names: list[str]) -> dict[str, np.ndarray]:
    """The checkpoint tensors of the kdax array ``a`` by ``kind``: "same"; "transposed" (kernels
    to torch's [out, in]); "experts" (split per expert and projection); ("A_log", shape)."""
    if kind == "experts":  # [E, H, n * I] -> per expert, per projection [I, H] (or [E, I, H] -> [H, I])
        n = len(names) // a.shape[0]
        return dict(zip(names, [np.ascontiguousarray(p.T) for e in a for p in np.split(e, n, axis=-1)]))
    if kind == "transposed":
        return {names[0]: np.ascontiguousarray(a.T)}
    return {names[0]: a.reshape(kind[1]) if kind != "same" else a}


def from_checkpoint(kind, tensors: dict[str, np.ndarray], names: list[str], shape: tuple) -> np.ndarray:
    """The kdax array of ``shape`` from its checkpoint tensors (the inverse of :func:`to_checkpoint`)."""
    if kind == "experts":
        n = len(names) // shape[0]
        return np.stack(
            [np.concatenate([tensors[m].T for m in names[e * n : (e + 1) * n]], -1) for e in range(shape[0])]
        )
    a = tensors[names[0]]
    return a.T if kind == "transposed" else a.reshape(-1) if kind != "same" else a


def canonical_name(name: str) -> str:
    """A checkpoint tensor's name as :func:`hub_entries` gives it: transformers 5.24 writes Kimi
    Linear's dense MLPs under ``block_sparse_moe``, the hub under ``mlp``."""
    return re.sub(r"\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.", r".mlp.\1.", name)


def layer_of(name: str) -> int:
    """The decoder layer a checkpoint tensor belongs to (-1: none)."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else -1
