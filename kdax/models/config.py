"""``KDAConfig``: FLA's field names and defaults, validated on construction."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from kdax.nn.kda import MODES

ATTN_KEYS = ("layers", "num_heads", "num_kv_heads", "qkv_bias", "window_size", "rope_theta")


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


@dataclasses.dataclass
class KDAConfig:
    """A Kimi-Linear-style hybrid: ``num_hidden_layers`` pre-norm blocks, each a token mixer
    (KimiDeltaAttention, or softmax attention on the layers listed in ``attn``) and a GatedMLP.

    Fields, names and defaults are FLA's ``KDAConfig``'s, checked on construction. The
    ``fuse_*`` and ``use_l2warp`` fields select PyTorch kernels in FLA; they are kept for
    checkpoint round trips and have no effect here, nor have ``max_position_embeddings``,
    ``use_cache`` and the ``*_token_id`` fields (:func:`kdax.models.generate` takes its own
    ``eos_token_id``).

    Attributes:
        attn_mode: the KDA layers' ``mode``, "chunk" or "fused_recurrent".
        hidden_size: the model width.
        expand_v: the KDA value head dim over ``head_dim``.
        use_short_conv: short convolutions on the KDA layers' q, k and v.
        allow_neg_eigval: KDA's beta is 2 * sigmoid instead of sigmoid
            (:func:`kdax.beta_activation`).
        safe_gate: FLA's bounded gate (needs ``lower_bound``).
        lower_bound: None, or the negative bound of the KDA gate.
        conv_size: the short convolutions' kernel size.
        head_dim: the KDA query/key head dim K, at most 256.
        num_heads: the KDA query/key heads.
        num_v_heads: the KDA value heads, a multiple of ``num_heads`` (None: ``num_heads``).
        max_position_embeddings: FLA's field, passed to the attention layers, which store it.
        hidden_ratio: the MLP's ratio when ``intermediate_size`` is None.
        intermediate_size: the MLP's hidden size (None: derived from ``hidden_ratio``).
        hidden_act: the MLP's activation, "swish" only.
        num_hidden_layers: the blocks.
        norm_eps: the RMSNorms' epsilon.
        attn: None, or a dict {layers, num_heads, num_kv_heads, qkv_bias, window_size,
            rope_theta} (or a list of such dicts) placing softmax-attention layers; on
            construction the optional keys get their defaults (num_kv_heads: num_heads,
            qkv_bias: False, window_size: None, rope_theta: 10000.0).
        use_cache: FLA's field, unused.
        pad_token_id: None or a token id, unused.
        bos_token_id: a token id, unused.
        eos_token_id: a token id, unused.
        tie_word_embeddings: the output head reuses the embeddings.
        initializer_range: the standard deviation of the initial linear, convolution and
            embedding weights.
        fuse_norm: FLA's field, no effect.
        fuse_swiglu: FLA's field, no effect.
        fuse_cross_entropy: FLA's field, no effect.
        use_l2warp: FLA's field, no effect.
        vocab_size: the tokens.
        attnres_block_size: None only (attention residuals are not supported).

    Raises:
        ValueError: naming the field (``attn.<key>`` inside ``attn``) that is wrong:
            ``hidden_size``, ``head_dim``, ``num_heads``, ``conv_size``, ``num_hidden_layers``,
            ``vocab_size``, ``num_v_heads``, ``intermediate_size`` or (without it)
            ``hidden_ratio`` not a positive int; ``head_dim`` > 256; ``attn_mode`` not in
            ("chunk", "fused_recurrent"); ``num_v_heads`` not a multiple of ``num_heads``;
            head_dim * ``expand_v`` not a positive int; ``lower_bound`` not None or negative,
            or None with ``safe_gate``; ``hidden_act`` not "swish"; ``norm_eps`` not positive;
            ``attnres_block_size`` not None; a token id outside [0, vocab_size); ``attn`` not
            None, a dict or a list of dicts with "layers" and "num_heads", or with unknown
            keys; ``attn.layers`` indices out of [0, num_hidden_layers) or repeated;
            ``attn.num_heads`` not a positive int dividing hidden_size into an even head dim;
            ``attn.num_kv_heads`` not a positive int dividing ``attn.num_heads``;
            ``attn.window_size`` not None or a positive int; ``attn.rope_theta`` not a positive
            finite float.
    """

    attn_mode: str = "chunk"
    hidden_size: int = 2048
    expand_v: float = 1.0
    use_short_conv: bool = True
    allow_neg_eigval: bool = False
    safe_gate: bool = False
    lower_bound: float | None = None
    conv_size: int = 4
    head_dim: int = 128
    num_heads: int = 16
    num_v_heads: int | None = None
    max_position_embeddings: int = 2048
    hidden_ratio: int | None = 4
    intermediate_size: int | None = None
    hidden_act: str = "swish"
    num_hidden_layers: int = 24
    norm_eps: float = 1e-6
    attn: dict | list | None = None
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int = 1
    eos_token_id: int = 2
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    fuse_norm: bool = True
    fuse_swiglu: bool = True
    fuse_cross_entropy: bool = True
    use_l2warp: bool = False
    vocab_size: int = 32000
    attnres_block_size: int | None = None

    def __post_init__(self):
        for name in ("hidden_size", "head_dim", "num_heads", "conv_size", "num_hidden_layers", "vocab_size"):
            _positive_int(name, getattr(self, name))
        if self.head_dim > 256:  # chunk_kda's key head dim (KDA's q and k heads are head_dim wide)
            raise ValueError(
                f"head_dim: expected at most 256 (the largest key head dim of the KDA ops), got {self.head_dim}"
            )
        if self.attn_mode not in MODES:
            raise ValueError(f"attn_mode: expected one of {MODES}, got {self.attn_mode!r}")
        if self.num_v_heads is not None:
            _positive_int("num_v_heads", self.num_v_heads)
            if self.num_v_heads % self.num_heads:
                raise ValueError(
                    f"num_v_heads: expected a multiple of num_heads={self.num_heads}, got {self.num_v_heads}"
                )
        v = self.head_dim * self.expand_v
        if not (v >= 1 and math.isclose(v, round(v), rel_tol=1e-5)):
            raise ValueError(f"expand_v: expected head_dim * expand_v to be a positive int, got {v}")
        if self.lower_bound is not None and not (isinstance(self.lower_bound, (int, float)) and self.lower_bound < 0):
            raise ValueError(f"lower_bound: expected None or a negative float, got {self.lower_bound!r}")
        if self.safe_gate and self.lower_bound is None:
            raise ValueError("lower_bound: required (e.g. -5.0) when safe_gate=True")
        if self.hidden_act != "swish":
            raise ValueError(f"hidden_act: expected 'swish', got {self.hidden_act!r}")
        if self.intermediate_size is not None:
            _positive_int("intermediate_size", self.intermediate_size)
        elif self.hidden_ratio is not None:
            _positive_int("hidden_ratio", self.hidden_ratio)
        if not (isinstance(self.norm_eps, (int, float)) and self.norm_eps > 0):
            raise ValueError(f"norm_eps: expected a positive float, got {self.norm_eps!r}")
        if self.attnres_block_size is not None:
            raise ValueError(
                f"attnres_block_size: expected None (attention residuals are not supported), "
                f"got {self.attnres_block_size!r}"
            )
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value < self.vocab_size):
                raise ValueError(f"{name}: expected None or a token id in [0, {self.vocab_size}), got {value!r}")
        self.attn = self._parse_attn(self.attn)

    def _parse_attn(self, attn):
        """Fill the attention spec's defaults; return the same form (dict or list)."""
        if attn is None:
            return None
        if not isinstance(attn, (dict, list, tuple)):
            raise ValueError(f"attn: expected None, a dict or a list of dicts, got {type(attn).__name__}")
        specs, seen = [], set()
        for spec in [attn] if isinstance(attn, dict) else attn:
            if not isinstance(spec, dict) or "layers" not in spec or "num_heads" not in spec:
                raise ValueError(f"attn: expected dicts with at least 'layers' and 'num_heads', got {spec!r}")
            unknown = set(spec) - set(ATTN_KEYS)
            if unknown:
                raise ValueError(f"attn: unknown keys {sorted(unknown)}; expected keys from {ATTN_KEYS}")
            spec = dict(spec)
            layers = spec["layers"]
            if not isinstance(layers, (list, tuple)):
                raise ValueError(f"attn.layers: expected a list of layer indices, got {layers!r}")
            for i in layers:
                if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_hidden_layers:
                    raise ValueError(f"attn.layers: expected indices in [0, {self.num_hidden_layers}), got {i!r}")
                if i in seen:
                    raise ValueError(f"attn.layers: layer {i} is assigned twice")
                seen.add(i)
            spec["layers"] = list(layers)
            spec["num_kv_heads"] = spec.get("num_kv_heads") or spec["num_heads"]
            for name in ("num_heads", "num_kv_heads"):
                _positive_int(f"attn.{name}", spec[name])
            if self.hidden_size % spec["num_heads"] or (self.hidden_size // spec["num_heads"]) % 2:
                raise ValueError(
                    f"attn.num_heads: expected a divisor of hidden_size={self.hidden_size} "
                    f"giving an even head dim, got {spec['num_heads']}"
                )
            if spec["num_heads"] % spec["num_kv_heads"]:
                raise ValueError(
                    f"attn.num_kv_heads: expected a divisor of num_heads={spec['num_heads']}, "
                    f"got {spec['num_kv_heads']}"
                )
            spec.setdefault("qkv_bias", False)
            if spec.setdefault("window_size", None) is not None:
                _positive_int("attn.window_size", spec["window_size"])
            theta = spec.setdefault("rope_theta", 10000.0)
            if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
                raise ValueError(f"attn.rope_theta: expected a positive finite float, got {theta!r}")
            specs.append(spec)
        return specs[0] if isinstance(attn, dict) else specs

    def __hash__(self):  # a static attribute of the model's graph, so jit needs it hashable
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    def attention_spec(self, layer_idx: int) -> dict | None:
        """The softmax-attention settings of a layer.

        Args:
            layer_idx: the layer's index.

        Returns:
            The ``attn`` dict that lists ``layer_idx`` (defaults filled in), or None for a KDA
            layer.
        """
        specs = [] if self.attn is None else [self.attn] if isinstance(self.attn, dict) else self.attn
        return next((s for s in specs if layer_idx in s["layers"]), None)

    def to_dict(self) -> dict[str, Any]:
        """The config as a JSON-ready dict.

        Returns:
            Every field under FLA's config.json key, plus ``model_type: "kda"``.
        """
        return {"model_type": "kda", **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KDAConfig:
        """Build a config from a dict such as an FLA/HF config.json.

        Args:
            d: field name -> value; keys that are not fields (model_type, architectures,
                torch_dtype, ...) are ignored.

        Returns:
            The :class:`KDAConfig`.

        Raises:
            ValueError: ``model_type`` is given and is not "kda"; any error of the
                constructor.
        """
        if d.get("model_type", "kda") != "kda":
            raise ValueError(f"model_type: expected 'kda', got {d['model_type']!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
