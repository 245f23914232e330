"""``KimiLinearConfig`` and ``BailingHybridConfig``: transformers' field names and defaults,
validated on construction.

Both are hybrids of KimiDeltaAttention ("linear_attention") and DeepSeek-style multi-head latent
attention ("full_attention") layers, with a dense MLP on the first layers and a group-limited
top-k mixture of experts ("sparse") on the rest. The fields are those of transformers'
``KimiLinearConfig`` and ``BailingHybridConfig`` under the canonical names of their
``attribute_map`` (``num_local_experts``, not ``num_experts``); :meth:`from_dict` also reads the
alias keys that the hub checkpoints and transformers' ``save_pretrained`` write. Pure Python: no
JAX import.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, ClassVar

LAYER_TYPES = ("full_attention", "linear_attention")
MLP_LAYER_TYPES = ("dense", "sparse")
ROPE_TYPES = ("default",)
# transformers remaps these legacy layer-type names on load (configuration_utils._LEGACY_LAYER_TYPE_REMAP).
_LEGACY_LAYER_TYPES = {"attention": "full_attention", "mamba": "linear_attention"}
# transformers' attribute_map, shared by both classes: canonical field -> config.json alias.
_ALIASES = {
    "max_position_embeddings": "model_max_length",
    "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group",
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
}


def _int(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name}: expected {what}, got {value!r}")


def _optional_int(name: str, value) -> None:
    if value is not None:
        _int(name, value)


def _bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected a bool, got {value!r}")


def _float(name: str, value, *, positive: bool = False) -> float:
    """A finite number as a float (ints too: JSON writes 6000000.0 as 6000000), so that equal
    configs hash alike."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite float, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name}: expected a positive float, got {value!r}")
    return float(value)


def _default_mlp_layer_types(num_hidden_layers: int, first_k_dense_replace: int) -> list[str]:
    return ["dense" if i < first_k_dense_replace else "sparse" for i in range(num_hidden_layers)]


@dataclasses.dataclass
class MLAMoEConfig:
    """The fields, checks and conversions the MLA + MoE hybrids share (Kimi Linear, Bailing, GLM-5.3):
    each family's config is a dataclass that gives the first fields below its defaults and adds its
    own. Names are transformers'; ``to_dict``/``from_dict`` round-trip them, aliases included.

    Attributes:
        vocab_size: the tokens.
        hidden_size: the model width.
        intermediate_size: the dense MLP's hidden size.
        moe_intermediate_size: each expert's hidden size (the shared experts': this times
            ``n_shared_experts``).
        num_hidden_layers: the decoder layers.
        num_attention_heads: the MLA heads.
        num_key_value_heads: the MLA key/value heads, equal to ``num_attention_heads`` (None:
            ``num_attention_heads``).
        routed_scaling_factor: the routed experts' output scale.
        q_lora_rank: None (a full query projection) or the MLA compressed query width.
        qk_rope_head_dim: the MLA per-head width of the shared (rotary slot) key part.
        v_head_dim: the MLA value head dim.
        qk_nope_head_dim: the MLA per-head width of the query/key part from kv_b_proj.
        n_group: the expert groups of the router (alias ``num_expert_group``).
        topk_group: the groups each token routes into.
        max_position_embeddings: the trained context (alias ``model_max_length``).
        rms_norm_eps: the RMSNorms' epsilon.
        pad_token_id: None or a token id.
        bos_token_id: None or a token id.
        eos_token_id: None, a token id or a list of token ids.
        n_shared_experts: the always-on shared experts (alias ``num_shared_experts``).
        output_router_logits: transformers returns the router logits, unused.
        kv_lora_rank: the MLA compressed key/value width.
        num_experts_per_tok: the routed experts per token (alias ``num_experts_per_token``).
        norm_topk_prob: renormalise the top-k router weights (alias ``moe_renormalize``).
        hidden_act: the MLPs' activation, "silu" only.
        initializer_range: the standard deviation of the initial weights.
        use_cache: transformers' field, unused.
        tie_word_embeddings: the output head reuses the embeddings.
        attention_bias: a bias on the MLA q_a/kv_a and output projections.
        attention_dropout: transformers' attention dropout, unused.
        mlp_layer_types: per layer "dense" or "sparse" (None: the family's default).
        layer_types: per layer, the family's softmax-attention type or "linear_attention" (KDA)
            (None: the family's default).
    """

    MODEL_TYPE: ClassVar[str] = ""
    ALIASES: ClassVar[dict[str, str]] = _ALIASES
    LAYER_TYPES: ClassVar[tuple[str, ...]] = LAYER_TYPES  # (softmax attention, KDA)
    LEGACY_LAYER_TYPES: ClassVar[dict[str, str]] = _LEGACY_LAYER_TYPES
    MIN_ROPE_HEAD_DIM: ClassVar[int] = 1
    # fields its hub config.json writes under their alias (what readers without transformers'
    # attribute_map, such as vLLM's own config classes, expect)
    HUB_ALIASED: ClassVar[tuple[str, ...]] = ()

    # the family gives these their defaults
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None
    routed_scaling_factor: float
    q_lora_rank: int | None
    qk_rope_head_dim: int
    v_head_dim: int
    qk_nope_head_dim: int
    n_group: int
    topk_group: int
    max_position_embeddings: int
    rms_norm_eps: float
    pad_token_id: int | None
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    # the same in every family
    n_shared_experts: int = 1
    output_router_logits: bool = False
    kv_lora_rank: int = 512
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    use_cache: bool = True
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_dropout: float = 0.0
    mlp_layer_types: list[str] | None = None
    layer_types: list[str] | None = None

    @property
    def qk_head_dim(self) -> int:
        """The MLA query/key head dim, ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def _validate_common(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "moe_intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "n_shared_experts",
            "kv_lora_rank",
            "v_head_dim",
            "qk_nope_head_dim",
            "n_group",
            "topk_group",
            "num_experts_per_tok",
            "max_position_embeddings",
            "num_local_experts",
        ):
            _int(name, getattr(self, name))
        _int("qk_rope_head_dim", self.qk_rope_head_dim, minimum=self.MIN_ROPE_HEAD_DIM)
        for name in ("q_lora_rank", "pretraining_tp"):
            _optional_int(name, getattr(self, name, None))
        for name in ("output_router_logits", "norm_topk_prob", "use_cache", "tie_word_embeddings", "attention_bias"):
            _bool(name, getattr(self, name))

        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        _int("num_key_value_heads", self.num_key_value_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads: expected a divisor of num_attention_heads={self.num_attention_heads}, "
                f"got {self.num_key_value_heads}"
            )
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(
                f"num_key_value_heads: expected num_attention_heads={self.num_attention_heads}, got "
                f"{self.num_key_value_heads}: transformers' MLA expands kv_b_proj to num_attention_heads key/value "
                "heads, so its repeat_kv by num_attention_heads // num_key_value_heads would mismatch the query heads"
            )

        if self.num_local_experts % self.n_group:
            raise ValueError(
                f"n_group: expected a divisor of num_local_experts={self.num_local_experts}, got {self.n_group}"
            )
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group: expected 1 <= topk_group <= n_group={self.n_group}, got {self.topk_group}")
        routable = self.topk_group * (self.num_local_experts // self.n_group)
        if self.num_experts_per_tok > routable:
            raise ValueError(
                f"num_experts_per_tok: expected at most topk_group * (num_local_experts // n_group) = {routable} "
                f"(the experts in the chosen groups), got {self.num_experts_per_tok}"
            )

        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: expected 'silu', got {self.hidden_act!r}")
        self.routed_scaling_factor = _float("routed_scaling_factor", self.routed_scaling_factor, positive=True)
        self.rms_norm_eps = _float("rms_norm_eps", self.rms_norm_eps, positive=True)
        self.initializer_range = _float("initializer_range", self.initializer_range)
        if self.initializer_range < 0:
            raise ValueError(f"initializer_range: expected a float >= 0, got {self.initializer_range!r}")
        self.attention_dropout = _float("attention_dropout", self.attention_dropout)
        if not 0 <= self.attention_dropout < 1:
            raise ValueError(f"attention_dropout: expected a float in [0, 1), got {self.attention_dropout!r}")

        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if name == "eos_token_id" and isinstance(value, (list, tuple)):  # several end tokens
                value = list(value)
                setattr(self, name, value)
                if not value:
                    raise ValueError(f"{name}: expected None, a token id or a non-empty list of token ids, got []")
            ids = value if name == "eos_token_id" and isinstance(value, list) else [] if value is None else [value]
            for i in ids:
                if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size:
                    raise ValueError(f"{name}: expected None or token ids in [0, {self.vocab_size}), got {value!r}")

        for name, allowed in (("layer_types", self.LAYER_TYPES), ("mlp_layer_types", MLP_LAYER_TYPES)):
            types = getattr(self, name)
            if not isinstance(types, (list, tuple)):
                raise ValueError(f"{name}: expected a list of {allowed}, got {types!r}")
            if name == "layer_types":
                types = [self.LEGACY_LAYER_TYPES.get(t, t) for t in types]
            types = list(types)
            setattr(self, name, types)
            bad = [t for t in types if t not in allowed]
            if bad:
                raise ValueError(f"{name}: expected entries in {allowed}, got {bad[0]!r}")
            if len(types) != self.num_hidden_layers:
                raise ValueError(
                    f"{name}: expected num_hidden_layers={self.num_hidden_layers} entries, got {len(types)}"
                )

    def _check_linear_head_dim(self, name: str, value) -> None:
        _int(name, value)
        if value > 256:  # chunk_kda's key head dim
            raise ValueError(f"{name}: expected at most 256 (the largest key head dim of the KDA ops), got {value}")

    def __hash__(self):  # a static attribute of the model's graph, so jit needs it hashable
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    def to_dict(self) -> dict[str, Any]:
        """The config as a JSON-ready dict.

        Returns:
            Every field under its canonical transformers name, plus ``model_type``; transformers'
            config class (``AutoConfig.for_model(**d)``) builds the same config from it.
        """
        return {"model_type": self.MODEL_TYPE, **dataclasses.asdict(self)}

    def config_json(self) -> dict[str, Any]:
        """:meth:`to_dict` under the names the family's hub config.json uses (``HUB_ALIASED``
        fields as their aliases)."""
        return {self.ALIASES[k] if k in self.HUB_ALIASED else k: v for k, v in self.to_dict().items()}

    @classmethod
    def _prepare(cls, d: dict[str, Any]) -> dict[str, Any]:
        """Turn the keys transformers handles in its ``__post_init__`` into fields (in place)."""
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        """Build a config from a dict such as a hub config.json or transformers' ``to_dict()``.

        Args:
            d: field name -> value. The ``attribute_map`` aliases (``num_experts``,
                ``num_experts_per_token``, ``num_shared_experts``, ``moe_renormalize``,
                ``num_expert_group``, ``model_max_length``, and for Bailing
                ``num_nextn_predict_layers``) are read as their fields and, as in transformers, win
                over the canonical key when both are given. Keys that are not fields
                (architectures, dtype, torch_dtype, transformers_version, auto_map,
                quantization_config, ...) are ignored.

        Returns:
            The config.

        Raises:
            ValueError: ``model_type`` is given and is not this class's; any error of the
                constructor.
        """
        if d.get("model_type", cls.MODEL_TYPE) != cls.MODEL_TYPE:
            raise ValueError(f"model_type: expected {cls.MODEL_TYPE!r}, got {d['model_type']!r}")
        d = dict(d)
        for field, alias in cls.ALIASES.items():
            if alias in d:
                d[field] = d.pop(alias)
        d = cls._prepare(d)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclasses.dataclass
class KimiLinearConfig(MLAMoEConfig):
    """Kimi Linear (moonshotai/Kimi-Linear-48B-A3B): KDA layers and NoPE MLA layers, with a dense
    MLP on the first layer and a mixture of experts on the rest.

    Fields, names and defaults are transformers' ``KimiLinearConfig``'s. The MLA layers use no
    positional encoding, so :attr:`rope_theta` is None. :meth:`from_dict` reads the checkpoint's
    ``linear_attn_config`` dict (``head_dim``, ``num_heads``, ``short_conv_kernel_size``,
    ``full_attn_layers`` and ``kda_layers``, 1-indexed) and ``first_k_dense_replace`` (default 1),
    which transformers takes as extra keyword arguments rather than fields.
    ``output_router_logits``, ``pretraining_tp``, ``use_cache``, ``attention_dropout`` and
    ``max_position_embeddings`` are kept for round trips.

    Attributes (beyond :class:`MLAMoEConfig`'s MLA, MoE and token fields):
        num_local_experts: the routed experts (alias ``num_experts``).
        pretraining_tp: transformers' field, unused.
        mlp_layer_types: None means "dense" on the first layer.
        layer_types: "full_attention" (MLA) or "linear_attention" (KDA) per layer (None: MLA on
            the 0-indexed layers 4, 8, 12, ...).
        linear_head_dim: the KDA head dim, at most 256.
        linear_num_heads: the KDA heads.
        linear_conv_kernel_dim: the KDA short convolutions' kernel size.

    Raises:
        ValueError: naming the field that is wrong: a size, head count, rank or expert count
            not a positive int; ``num_key_value_heads`` not equal to ``num_attention_heads``;
            ``n_group`` not dividing ``num_local_experts``; ``topk_group`` > ``n_group``;
            ``num_experts_per_tok`` > topk_group * (num_local_experts // n_group);
            ``hidden_act`` not "silu"; a token id outside [0, vocab_size); ``layer_types`` /
            ``mlp_layer_types`` entries not in ("full_attention", "linear_attention") /
            ("dense", "sparse") or not num_hidden_layers of them; ``linear_head_dim`` > 256;
            ``rms_norm_eps`` or ``routed_scaling_factor`` not positive; a bool field not a bool.
    """

    MODEL_TYPE: ClassVar[str] = "kimi_linear"
    HUB_ALIASED: ClassVar[tuple[str, ...]] = tuple(_ALIASES)  # moonshotai's config.json: num_experts, ...

    vocab_size: int = 163840
    hidden_size: int = 2304
    intermediate_size: int = 9216
    moe_intermediate_size: int = 1024
    num_hidden_layers: int = 27
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    routed_scaling_factor: float = 2.446
    q_lora_rank: int | None = None
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 1
    topk_group: int = 1
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-5
    pad_token_id: int | None = 163839
    bos_token_id: int | None = 163584
    eos_token_id: int | list[int] | None = 163586
    pretraining_tp: int | None = 1
    num_local_experts: int = 256
    linear_head_dim: int = 128
    linear_num_heads: int = 32
    linear_conv_kernel_dim: int = 4

    def __post_init__(self):
        _int("num_hidden_layers", self.num_hidden_layers)
        if self.layer_types is None:
            self.layer_types = [
                "full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(self.num_hidden_layers)
            ]
        if self.mlp_layer_types is None:
            self.mlp_layer_types = _default_mlp_layer_types(self.num_hidden_layers, 1)
        self._validate_common()
        self._check_linear_head_dim("linear_head_dim", self.linear_head_dim)
        _int("linear_num_heads", self.linear_num_heads)
        _int("linear_conv_kernel_dim", self.linear_conv_kernel_dim)

    def __hash__(self):
        return MLAMoEConfig.__hash__(self)

    @property
    def rope_theta(self) -> None:
        """None: Kimi Linear's MLA layers use no positional encoding (NoPE)."""
        return None

    @classmethod
    def _prepare(cls, d: dict[str, Any]) -> dict[str, Any]:
        # transformers: linear_attn_config's head_dim/num_heads/short_conv_kernel_size override the
        # linear_* fields; its 1-indexed layer lists give layer_types unless layer_types is given.
        lac = d.get("linear_attn_config")
        lac = {} if lac is None else lac
        if not isinstance(lac, dict):
            raise ValueError(f"linear_attn_config: expected None or a dict, got {lac!r}")
        for key, field in (
            ("head_dim", "linear_head_dim"),
            ("num_heads", "linear_num_heads"),
            ("short_conv_kernel_size", "linear_conv_kernel_dim"),
        ):
            if key in lac:
                d[field] = lac[key]
        num_layers = d.get("num_hidden_layers", cls.num_hidden_layers)
        _int("num_hidden_layers", num_layers)
        if d.get("layer_types") is None and "full_attn_layers" in lac and "kda_layers" in lac:
            types: list[str | None] = [None] * num_layers
            for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
                layers = lac[key]
                if not isinstance(layers, (list, tuple)):
                    raise ValueError(f"linear_attn_config.{key}: expected a list of 1-indexed layers, got {layers!r}")
                for layer in layers:
                    if isinstance(layer, bool) or not isinstance(layer, int) or not 1 <= layer <= num_layers:
                        raise ValueError(
                            f"linear_attn_config.{key}: expected 1-indexed layers in [1, {num_layers}], got {layer!r}"
                        )
                    if types[layer - 1] is not None:
                        raise ValueError(f"linear_attn_config.{key}: layer {layer} is listed twice")
                    types[layer - 1] = kind
            missing = [i + 1 for i, t in enumerate(types) if t is None]
            if missing:
                raise ValueError(
                    f"linear_attn_config: layers {missing} (1-indexed) are in neither full_attn_layers nor kda_layers"
                )
            d["layer_types"] = types
        if d.get("mlp_layer_types") is None:
            first_k_dense_replace = d.get("first_k_dense_replace", 1)
            _int("first_k_dense_replace", first_k_dense_replace, minimum=0)
            d["mlp_layer_types"] = _default_mlp_layer_types(num_layers, first_k_dense_replace)
        return d


@dataclasses.dataclass
class BailingHybridConfig(MLAMoEConfig):
    """Bailing hybrid (inclusionAI Ling): KDA layers with a bounded forget gate and RoPE MLA layers
    (the last layer of every ``layer_group_size``), with dense MLPs on the first
    ``first_k_dense_replace`` layers, a mixture of experts on the rest, and ``num_mtp_layers``
    multi-token-prediction layers stored after the decoder.

    Fields, names and defaults are transformers' ``BailingHybridConfig``'s (a ``DeepseekV3Config``
    in its modular source, without ``rope_interleave``). ``head_dim`` is the KDA head dim, as in the
    checkpoints' config.json: transformers copies it to ``linear_head_dim`` and then overwrites its
    own ``head_dim`` with ``qk_rope_head_dim`` (the MLA rotary width), so a dict written by
    transformers carries ``head_dim`` = qk_rope_head_dim and the KDA head dim under
    ``linear_head_dim``, which :meth:`from_dict` reads back into ``head_dim``. The KDA heads are
    ``num_attention_heads`` and the KDA kernel size ``short_conv_kernel_size``
    (:attr:`linear_num_heads`, :attr:`linear_conv_kernel_dim`). ``output_router_logits``,
    ``pretraining_tp``, ``use_cache``, ``attention_dropout`` and ``mtp_loss_scaling_factor`` are
    kept for round trips.

    Attributes (beyond :class:`MLAMoEConfig`'s MLA, MoE and token fields):
        num_hidden_layers: the decoder layers (the MTP layers not counted).
        num_attention_heads: the MLA heads, and the KDA heads.
        qk_rope_head_dim: the MLA per-head rotary width (transformers' ``head_dim`` after init).
        max_position_embeddings: transformers' rotary cache starts at this length.
        first_k_dense_replace: the leading layers with a dense MLP (gives ``mlp_layer_types``
            when that is None).
        pretraining_tp: transformers' field, unused.
        rope_parameters: the MLA RoPE, {"rope_type": "default", "rope_theta": ...} only (None:
            built from ``rope_theta``; a missing "rope_theta" is filled from ``rope_theta``).
        num_mtp_layers: the multi-token-prediction layers after the decoder (alias
            ``num_nextn_predict_layers``).
        num_local_experts: the routed experts (alias ``num_experts``).
        rope_theta: the MLA RoPE base, the one in ``rope_parameters`` when that has one.
        head_dim: the KDA head dim (transformers' ``linear_head_dim``), at most 256.
        short_conv_kernel_size: the KDA short convolutions' kernel size.
        layer_group_size: MLA on the last layer of every group of this many (gives
            ``layer_types`` when that is None).
        kda_safe_gate: the KDA forget gate is bounded below by ``kda_lower_bound``.
        kda_lower_bound: the (negative) lower bound of the KDA log forget gate.
        mtp_loss_scaling_factor: the weight of the MTP loss in pretraining, unused.

    Raises:
        ValueError: naming the field that is wrong: everything :class:`KimiLinearConfig` checks
            (``head_dim`` for its ``linear_head_dim``), and ``first_k_dense_replace`` or
            ``num_mtp_layers`` not an int >= 0; ``layer_group_size`` or
            ``short_conv_kernel_size`` not a positive int; ``kda_lower_bound`` not negative with
            ``kda_safe_gate``; ``rope_parameters`` not a flat dict of rope_type "default" with at
            most "rope_type"/"type" and "rope_theta"; ``rope_theta`` not positive.
    """

    MODEL_TYPE: ClassVar[str] = "bailing_hybrid"
    ALIASES: ClassVar[dict[str, str]] = {**_ALIASES, "num_mtp_layers": "num_nextn_predict_layers"}

    vocab_size: int = 157184
    hidden_size: int = 2560
    intermediate_size: int = 6144
    moe_intermediate_size: int = 768
    num_hidden_layers: int = 42
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    routed_scaling_factor: float = 2.5
    q_lora_rank: int | None = None
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    first_k_dense_replace: int = 2
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-6
    pad_token_id: int | None = 156892
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 156895
    pretraining_tp: int | None = 1
    rope_parameters: dict | None = None
    num_mtp_layers: int = 1
    num_local_experts: int = 512
    rope_theta: float = 6_000_000.0
    head_dim: int = 128
    short_conv_kernel_size: int = 4
    layer_group_size: int = 6
    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0
    mtp_loss_scaling_factor: float = 0.0

    def __post_init__(self):
        for name in ("num_hidden_layers", "layer_group_size", "short_conv_kernel_size"):
            _int(name, getattr(self, name))
        for name in ("first_k_dense_replace", "num_mtp_layers"):
            _int(name, getattr(self, name), minimum=0)
        if self.layer_types is None:
            self.layer_types = [
                "full_attention" if (i + 1) % self.layer_group_size == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)
            ]
        if self.mlp_layer_types is None:
            self.mlp_layer_types = _default_mlp_layer_types(self.num_hidden_layers, self.first_k_dense_replace)
        self._validate_common()
        self._check_linear_head_dim("head_dim", self.head_dim)
        _bool("kda_safe_gate", self.kda_safe_gate)
        self.kda_lower_bound = _float("kda_lower_bound", self.kda_lower_bound)
        if self.kda_safe_gate and self.kda_lower_bound >= 0:
            raise ValueError(
                f"kda_lower_bound: expected a negative float when kda_safe_gate=True, got {self.kda_lower_bound!r}"
            )
        self.mtp_loss_scaling_factor = _float("mtp_loss_scaling_factor", self.mtp_loss_scaling_factor)
        self._parse_rope()

    def _parse_rope(self) -> None:
        rope = self.rope_parameters
        if rope is None:
            rope = {"rope_type": "default"}  # its rope_theta comes from the field below
        if not isinstance(rope, dict):
            raise ValueError(f"rope_parameters: expected None or a dict, got {rope!r}")
        rope = dict(rope)
        rope.setdefault("rope_type", rope.get("type", "default"))  # "type": transformers' legacy key
        if rope["rope_type"] not in ROPE_TYPES or rope.get("type", rope["rope_type"]) != rope["rope_type"]:
            raise ValueError(
                f"rope_parameters: rope_type {rope['rope_type']!r} is not supported; supported rope types: {ROPE_TYPES}"
            )
        unknown = set(rope) - {"rope_type", "type", "rope_theta"}
        if unknown:
            raise ValueError(
                f"rope_parameters: unsupported keys {sorted(unknown)}; rope_type 'default' takes 'rope_theta' only"
            )
        if "rope_theta" in rope:
            rope["rope_theta"] = _float("rope_parameters.rope_theta", rope["rope_theta"], positive=True)
        else:
            rope["rope_theta"] = _float("rope_theta", self.rope_theta, positive=True)
        self.rope_parameters = rope
        self.rope_theta = rope["rope_theta"]  # the one transformers' rotary embedding reads

    def __hash__(self):
        return MLAMoEConfig.__hash__(self)

    @property
    def linear_head_dim(self) -> int:
        """The KDA head dim, ``head_dim``."""
        return self.head_dim

    @property
    def linear_num_heads(self) -> int:
        """The KDA heads, ``num_attention_heads``."""
        return self.num_attention_heads

    @property
    def linear_conv_kernel_dim(self) -> int:
        """The KDA short convolutions' kernel size, ``short_conv_kernel_size``."""
        return self.short_conv_kernel_size

    @classmethod
    def _prepare(cls, d: dict[str, Any]) -> dict[str, Any]:
        if d.get("rope_scaling"):  # transformers' legacy key, which wins over rope_parameters
            d["rope_parameters"] = d["rope_scaling"]
        # A dict from transformers' to_dict: head_dim is qk_rope_head_dim there, the KDA head dim
        # is linear_head_dim; transformers' linear_* keys win over what they derive from.
        if "linear_head_dim" in d:
            d["head_dim"] = d["linear_head_dim"]
        if "linear_conv_kernel_dim" in d:
            d["short_conv_kernel_size"] = d["linear_conv_kernel_dim"]
        heads = d.get("num_attention_heads", cls.num_attention_heads)
        if d.get("linear_num_heads", heads) != heads:
            raise ValueError(
                f"linear_num_heads: expected num_attention_heads={heads} (the KDA and MLA head counts are one "
                f"field here), got {d['linear_num_heads']!r}"
            )
        return d


@dataclasses.dataclass
class Glm5NextConfig(MLAMoEConfig):
    """GLM-5.3-Flash (transformers' ``glm5_next``): KDA layers with the bounded gate and NoPE MLA
    layers with a DSA indexer ("indexed_attention"), hyper-connections of ``hc_mult`` residual
    streams around every sublayer, dense MLPs and a mixture of experts with a SwiGLU clamp.

    The text fields, names and defaults are transformers' ``Glm5NextTextConfig``'s.
    :meth:`from_dict` reads a multimodal config.json (``model_type`` "glm5_next", the text fields
    under ``text_config``), a flat one (the text fields at the top level) or a text config
    ("glm5_next_text"); ``layer_types`` spelled "full_attention", "deepseek_sparse_attention" or
    "attention" mean "indexed_attention", "mamba" means "linear_attention"; ``indexer_types``
    comes from ``index_topk_pattern`` or ``index_topk_freq``/``index_skip_topk_offset`` when not
    given, and ``linear_attn_config``'s ``head_dim``, ``num_heads``, ``short_conv_kernel_size``
    and ``gate_lower_bound`` override the ``linear_*`` fields, as in transformers. The vision
    tower's config and the multimodal token ids are kept for round trips (kdax runs the text
    model); :meth:`to_dict` writes the multimodal form transformers' ``Glm5NextConfig`` reads.

    Attributes (beyond :class:`MLAMoEConfig`'s MLA, MoE and token fields):
        n_routed_experts: the routed experts (:attr:`num_local_experts`).
        layer_types: per layer "indexed_attention" (MLA with the DSA indexer) or
            "linear_attention" (KDA) (None: MLA on the 0-indexed layers 3, 7, 11, ...).
        mlp_layer_types: per layer "dense" or "sparse" (None: dense on the first three).
        indexer_types: per layer "full" (the layer runs its indexer) or "shared" (an indexed
            layer reuses the selection of the "full" indexed layer right before it).
        index_topk: the keys each query selects, a multiple of ``index_kpool``.
        index_head_dim, index_n_heads: the indexer's query heads and their dim.
        index_kpool: the keys a pooled index key summarises (the selection's unit).
        index_kpool_always_select_tail: each query also attends its own incomplete pool.
        swiglu_limit: the MLPs' and experts' clamp (:func:`kdax.nn.mlp.swiglu`), None for none.
        linear_head_dim, linear_num_heads, linear_conv_kernel_dim: the KDA layers' head dim (at
            most 256), heads and short-convolution size.
        linear_lower_bound: the KDA gate's lower bound (negative), or None for the softplus gate.
        hc_mult: the residual streams; hc_eps, hc_sinkhorn_iters: the hyper-connections' epsilon
            and Sinkhorn iterations (:class:`kdax.nn.HyperConnection`).
        router_aux_loss_coef: the load-balancing loss weight in training, unused.
        vision_config: the vision tower's config as read (None: none given).
        image_token_id, video_token_id, image_start_token_id, image_end_token_id,
            video_start_token_id, video_end_token_id: the multimodal config's token ids.

    Raises:
        ValueError: naming the field that is wrong: everything :class:`KimiLinearConfig` checks
            (``qk_rope_head_dim`` must be 0: transformers' GLM-5.3 MLA has no RoPE), and
            ``q_lora_rank`` None; ``indexer_types`` entries not "full"/"shared", not one per
            layer, or a "shared" indexed layer not right after a "full" indexed layer whose next
            entry is "shared"; ``index_topk`` not a positive multiple of ``index_kpool``; an
            indexer or hyper-connection size not a positive int; ``linear_lower_bound`` not None
            or negative; ``hc_eps`` not positive.
    """

    MODEL_TYPE: ClassVar[str] = "glm5_next"
    TEXT_MODEL_TYPE: ClassVar[str] = "glm5_next_text"
    ALIASES: ClassVar[dict[str, str]] = {"n_routed_experts": "num_local_experts"}
    LAYER_TYPES: ClassVar[tuple[str, ...]] = ("indexed_attention", "linear_attention")
    LEGACY_LAYER_TYPES: ClassVar[dict[str, str]] = {
        "full_attention": "indexed_attention",
        "deepseek_sparse_attention": "indexed_attention",
        "attention": "indexed_attention",
        "mamba": "linear_attention",
    }
    MIN_ROPE_HEAD_DIM: ClassVar[int] = 0
    MULTIMODAL: ClassVar[tuple[str, ...]] = (
        "vision_config",
        "image_token_id",
        "video_token_id",
        "image_start_token_id",
        "image_end_token_id",
        "video_start_token_id",
        "video_end_token_id",
    )

    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 64
    n_routed_experts: int = 288
    routed_scaling_factor: float = 2.5
    n_group: int = 1
    topk_group: int = 1
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 256
    v_head_dim: int = 256
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-5
    pad_token_id: int | None = 154820
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    indexer_types: list[str] | None = None
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    swiglu_limit: float | None = 10.0
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    router_aux_loss_coef: float = 0.001
    vision_config: dict | None = None
    image_token_id: int = 154854
    video_token_id: int = 154855
    image_start_token_id: int = 154830
    image_end_token_id: int = 154831
    video_start_token_id: int = 154832
    video_end_token_id: int = 154833

    def __post_init__(self):
        L = self.num_hidden_layers
        _int("num_hidden_layers", L)
        if self.layer_types is None:
            self.layer_types = ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(L)]
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense" if i < 3 else "sparse" for i in range(L)]
        if self.indexer_types is None:
            self.indexer_types = ["full"] * L
        if self.q_lora_rank is None:
            raise ValueError("q_lora_rank: expected a positive int (GLM-5.3's MLA has a low-rank query), got None")
        self._validate_common()
        if self.qk_rope_head_dim != 0:
            raise ValueError(f"qk_rope_head_dim: expected 0 (GLM-5.3's MLA has no RoPE), got {self.qk_rope_head_dim}")
        self._check_linear_head_dim("linear_head_dim", self.linear_head_dim)
        for name in (
            "linear_num_heads",
            "linear_conv_kernel_dim",
            "index_topk",
            "index_head_dim",
            "index_n_heads",
            "index_kpool",
            "hc_mult",
            "hc_sinkhorn_iters",
        ):
            _int(name, getattr(self, name))
        if self.index_topk % self.index_kpool:
            raise ValueError(
                f"index_topk: expected a multiple of index_kpool={self.index_kpool}, got {self.index_topk}"
            )
        _bool("index_kpool_always_select_tail", self.index_kpool_always_select_tail)
        if self.linear_lower_bound is not None:
            self.linear_lower_bound = _float("linear_lower_bound", self.linear_lower_bound)
            if self.linear_lower_bound >= 0:
                raise ValueError(
                    f"linear_lower_bound: expected None or a negative float, got {self.linear_lower_bound}"
                )
        if self.swiglu_limit is not None:
            self.swiglu_limit = _float("swiglu_limit", self.swiglu_limit, positive=True)
        self.hc_eps = _float("hc_eps", self.hc_eps, positive=True)
        self.router_aux_loss_coef = _float("router_aux_loss_coef", self.router_aux_loss_coef)
        self._check_indexer_types()

    def _check_indexer_types(self) -> None:
        types = self.indexer_types
        if not isinstance(types, (list, tuple)) or len(types) != self.num_hidden_layers:
            raise ValueError(
                f"indexer_types: expected num_hidden_layers={self.num_hidden_layers} entries, got {types!r}"
            )
        self.indexer_types = list(types)
        bad = [t for t in types if t not in ("full", "shared")]
        if bad:
            raise ValueError(f"indexer_types: expected entries in ('full', 'shared'), got {bad[0]!r}")
        for i in range(self.num_hidden_layers):
            if self.layer_types[i] == "indexed_attention" and types[i] == "shared":
                ok = i > 0 and self.layer_types[i - 1] == "indexed_attention" and types[i - 1] == "full"
                if not ok:
                    raise ValueError(
                        f"indexer_types: layer {i} is 'shared', so layer {i - 1} must be a 'full' indexed_attention "
                        "layer (a shared layer reuses the selection of the layer right before it, as in transformers)"
                    )

    def __hash__(self):
        return MLAMoEConfig.__hash__(self)

    @property
    def num_local_experts(self) -> int:
        """The routed experts, ``n_routed_experts``."""
        return self.n_routed_experts

    @property
    def rope_theta(self) -> None:
        """None: GLM-5.3's MLA layers use no positional encoding."""
        return None

    def index_width(self) -> int:
        """The keys a query's selection lists: ``index_topk`` plus the tail's ``index_kpool - 1``."""
        return self.index_topk + (self.index_kpool - 1 if self.index_kpool_always_select_tail else 0)

    def to_dict(self) -> dict[str, Any]:
        """The multimodal config.json transformers' ``Glm5NextConfig`` reads: the text fields under
        ``text_config``, the vision config and token ids at the top level."""
        d = dataclasses.asdict(self)
        top = {k: d.pop(k) for k in self.MULTIMODAL}
        if top["vision_config"] is None:
            del top["vision_config"]
        text = {"model_type": self.TEXT_MODEL_TYPE, **d}
        return {
            "model_type": self.MODEL_TYPE,
            "text_config": text,
            "tie_word_embeddings": self.tie_word_embeddings,
            **top,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        """Build a config from a config.json or transformers' ``to_dict()`` (multimodal, flat or text).

        Raises:
            ValueError: ``model_type`` is neither "glm5_next" nor "glm5_next_text"; any error of
                the constructor.
        """
        model_type = d.get("model_type", cls.MODEL_TYPE)
        if model_type not in (cls.MODEL_TYPE, cls.TEXT_MODEL_TYPE):
            raise ValueError(f"model_type: expected {cls.MODEL_TYPE!r} or {cls.TEXT_MODEL_TYPE!r}, got {model_type!r}")
        text = d.get("text_config")
        if text is not None and not isinstance(text, dict):
            raise ValueError(f"text_config: expected None or a dict, got {text!r}")
        merged = {**(text if text is not None else d)}
        for k in cls.MULTIMODAL:
            if k in d:
                merged[k] = d[k]
        merged["model_type"] = cls.MODEL_TYPE
        return super().from_dict(merged)

    @classmethod
    def _prepare(cls, d: dict[str, Any]) -> dict[str, Any]:
        L = d.get("num_hidden_layers", cls.num_hidden_layers)
        _int("num_hidden_layers", L)
        lac = d.get("linear_attn_config")
        if lac is not None:
            if not isinstance(lac, dict):
                raise ValueError(f"linear_attn_config: expected None or a dict, got {lac!r}")
            for key, field in (
                ("head_dim", "linear_head_dim"),
                ("num_heads", "linear_num_heads"),
                ("short_conv_kernel_size", "linear_conv_kernel_dim"),
                ("gate_lower_bound", "linear_lower_bound"),
            ):
                if key in lac:
                    d[field] = lac[key]
            if lac.get("safe_gate", True) and d.get("linear_lower_bound", cls.linear_lower_bound) is None:
                d["linear_lower_bound"] = -5.0
        if d.get("indexer_types") is None:
            pattern = d.get("index_topk_pattern")
            if isinstance(pattern, str):
                if set(pattern) - {"F", "S"}:
                    raise ValueError(f"index_topk_pattern: expected a string of 'F' and 'S', got {pattern!r}")
                d["indexer_types"] = [{"F": "full", "S": "shared"}[c] for c in pattern]
            elif pattern is not None:
                d["indexer_types"] = list(pattern)
            else:
                freq = max(d.get("index_topk_freq", 1), 1)
                offset = d.get("index_skip_topk_offset", 2)
                d["indexer_types"] = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(L)]
        return d


__all__ = ["BailingHybridConfig", "Glm5NextConfig", "KimiLinearConfig"]
