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

import functools
import re

import jax
import numpy as np
from flax import nnx

from kdax.models.glm5 import Glm5Model
from kdax.models.hf_config import BailingHybridConfig, Glm5NextConfig, KimiLinearConfig
from kdax.models.kda import KDAForCausalLM, Segments, _arange, _check_ids
from kdax.nn import MLA, GatedMLP, KimiDeltaAttention, MoE
from kdax.nn.dsa import IndexedMLA
from kdax.nn.moe import Buffer
from kdax.ops.common import dispatch


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
    limit = getattr(c, "swiglu_limit", None)
    if c.mlp_layer_types[layer_idx] == "dense":
        return GatedMLP(c.hidden_size, intermediate_size=c.intermediate_size, swiglu_limit=limit, rngs=rngs)
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
        swiglu_limit=limit,
        rngs=rngs,
    )


class HubCausalLM(KDAForCausalLM):
    """What the two families share: MLA on the "full_attention" layers, KDA on the others, the
    MLPs of ``mlp_layer_types``, ``rms_norm_eps`` for every RMSNorm. A family sets its MLA's
    ``output_gate`` and its KDA layers' gate options."""

    mla_output_gate = False

    def __init__(self, config, *, backend: str = "auto", rngs: nnx.Rngs):
        super().__init__(config, backend=backend, rngs=rngs)
        # the checkpoint's tensors the text model does not use (layers past num_hidden_layers: Ling's
        # and GLM-5.3's multi-token prediction; GLM-5.3's vision tower), as loaded: hub name ->
        # Buffer; save_pretrained writes them back
        self.mtp = nnx.Dict()

    @classmethod
    def architecture(cls) -> str:
        """The transformers class whose weight layout the checkpoints have (config.json's ``architectures``)."""
        return cls.__name__

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


class Glm5NextForCausalLM(HubCausalLM):
    """Z.ai's GLM-5.3-Flash text model (transformers' ``Glm5NextForConditionalGeneration`` without
    its vision tower): KDA layers with the bounded gate, NoPE MLA layers with DSA indexed
    attention (:class:`kdax.nn.dsa.IndexedMLA`), hyper-connections over ``hc_mult`` residual
    streams, dense MLPs and experts with a SwiGLU clamp. The interface of
    :class:`kdax.models.KDAForCausalLM` without packed sequences or a Kascade schedule (the
    indexed layers select their own keys); :meth:`selections` gives the indexers' choices.
    Checkpoints keep the vision tower's tensors as loaded (``mtp``) and write them back.

    Args:
        config: a :class:`kdax.models.Glm5NextConfig`.
        backend: the KDA layers' backend.
        rngs: the parameters' random keys.
    """

    config_class = Glm5NextConfig
    model_class = Glm5Model

    @classmethod
    def architecture(cls) -> str:
        return "Glm5NextForConditionalGeneration"

    @classmethod
    def layer(cls, config: Glm5NextConfig, layer_idx: int, *, backend: str, rngs: nnx.Rngs):
        c = config
        if c.layer_types[layer_idx] == "indexed_attention":
            attn = IndexedMLA(
                c.hidden_size,
                c.num_attention_heads,
                kv_lora_rank=c.kv_lora_rank,
                qk_nope_head_dim=c.qk_nope_head_dim,
                v_head_dim=c.v_head_dim,
                q_lora_rank=c.q_lora_rank,
                index_heads=c.index_n_heads,
                index_head_dim=c.index_head_dim,
                index_topk=c.index_topk,
                index_kpool=c.index_kpool,
                index_tail=c.index_kpool_always_select_tail,
                shared=c.indexer_types[layer_idx] == "shared",
                attention_bias=c.attention_bias,
                layer_idx=layer_idx,
                norm_eps=c.rms_norm_eps,
                rngs=rngs,
            )
        else:
            bound = c.linear_lower_bound
            attn = _kda(c, layer_idx, backend, rngs, lower_bound=bound, safe_gate=bound is not None)
        return attn, _mlp(c, layer_idx, rngs)

    def __call__(self, input_ids, *, attention_mask=None, cu_seqlens=None, kascade=None, pixel_values=None):
        """Logits of every position, as :meth:`kdax.models.KDAForCausalLM.__call__`.

        Raises:
            ValueError: as there, and ``cu_seqlens`` or ``kascade`` given (the indexed layers
                take rows, and select their own keys), or ``pixel_values`` (kdax runs the text model).
        """
        if pixel_values is not None:
            raise ValueError(
                "pixel_values: expected None; kdax runs GLM-5.3-Flash's text model (the vision tower's tensors are "
                "kept as loaded for save_pretrained, not run): pass text token ids"
            )
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens: expected None (GLM-5.3's indexed layers take rows; pass attention_mask)")
        return super().__call__(input_ids, attention_mask=attention_mask, kascade=kascade)

    def _check_kascade(self, kascade) -> None:
        if kascade is not None:
            raise ValueError("kascade: expected None (GLM-5.3's indexed layers select their own keys)")

    def selections(self, input_ids) -> dict[int, jax.Array]:
        """The keys each query of ``input_ids`` [B, T] attends in each "full" indexed layer.

        Returns:
            {layer: indices [B, T, index_topk + index_kpool - 1] int32}: the selected pools' keys
            ascending (-1 in unfilled slots), then the tail's (:func:`kdax.index_select`).
        """
        _check_ids(input_ids, self.config.vocab_size)
        graphdef, state = nnx.split(self)
        return _selections(graphdef, state, input_ids, dispatch.context())


@functools.partial(jax.jit, static_argnums=(0, 3))
def _selections(graphdef, state, input_ids, ctx):
    """:meth:`Glm5NextForCausalLM.selections`, compiled once per shape and dispatch context."""
    with dispatch.restored(ctx):
        B, T = input_ids.shape
        return nnx.merge(graphdef, state).model(input_ids, Segments(None, _arange(B, T), None), selections=True)[2]


MODELS = {
    "kimi_linear": KimiLinearForCausalLM,
    "bailing_hybrid": BailingHybridForCausalLM,
    "glm5_next": Glm5NextForCausalLM,
}


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
    "glm5_next": [
        (r"^model\.embeddings\.embedding$", "model.embed_tokens.weight"),
        *_COMMON,
        (r"\.([fg])_proj\.layers\.0\.", r".\1_a_proj."),
        (r"\.([fg])_proj\.layers\.1\.", r".\1_b_proj."),
        (r"\.(attn|ffn)_hc\.", r".hc_\1_"),
        (r"\.k_norm\.scale$", ".k_norm.weight"),
        (r"^model\.", "model.language_model."),
    ],
    "bailing_hybrid": [
        (r"^model\.embeddings\.embedding$", "model.word_embeddings.weight"),
        *_COMMON,
        (r"\.self_attn\.", ".attention."),
        (r"\.attention\.o_proj\.", ".attention.dense."),
        (r"\.gate\.e_score_correction_bias$", ".gate.expert_bias"),
    ],
}
# each expert's tensors: (projection names of gate, up, down), under the MoE's hub prefix of layer {}
_EXPERTS = {
    "kimi_linear": (("w1", "w3", "w2"), "model.layers.{}.block_sparse_moe"),
    "bailing_hybrid": (("gate_proj", "up_proj", "down_proj"), "model.layers.{}.mlp"),
    "glm5_next": (("gate_proj", "up_proj", "down_proj"), "model.language_model.layers.{}.mlp"),
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
            base = prefix.format(path[2]) + ".experts"
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
    m = re.match(r"model\.(?:language_model\.)?layers\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def set_aside(name: str, num_layers: int) -> bool:
    """Whether a checkpoint tensor is one the text model does not use and keeps as loaded: a layer
    past ``num_layers`` (multi-token prediction) or GLM-5.3's vision tower."""
    return layer_of(name) >= num_layers or name.startswith("model.visual.")
