"""KimiLinearConfig and BailingHybridConfig: defaults, derived fields, config.json keys, round
trips, errors; and, where transformers is installed, agreement with transformers' classes."""

import dataclasses
import json
import re

import pytest

from kdax.models.hf_config import BailingHybridConfig, KimiLinearConfig

L, F = "linear_attention", "full_attention"


def _small_kimi(**kw):
    args = {
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "num_key_value_heads": None,
        "n_shared_experts": 2,
        "routed_scaling_factor": 1.5,
        "kv_lora_rank": 16,
        "q_lora_rank": 24,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "qk_nope_head_dim": 12,
        "n_group": 2,
        "topk_group": 1,
        "num_experts_per_tok": 3,
        "norm_topk_prob": False,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "pad_token_id": None,
        "bos_token_id": 1,
        "eos_token_id": [2, 3],
        "tie_word_embeddings": True,
        "num_local_experts": 8,
        "layer_types": [L, F, L, L, F],
        "mlp_layer_types": ["dense", "dense", "sparse", "sparse", "sparse"],
        "linear_head_dim": 16,
        "linear_num_heads": 2,
        "linear_conv_kernel_dim": 3,
    }
    return KimiLinearConfig(**{**args, **kw})


def _small_bailing(**kw):
    args = {
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 7,
        "num_attention_heads": 4,
        "num_key_value_heads": None,
        "n_shared_experts": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": 24,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "qk_nope_head_dim": 12,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 4,
        "first_k_dense_replace": 1,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "num_mtp_layers": 0,
        "num_local_experts": 16,
        "rope_theta": 10000.0,
        "head_dim": 16,
        "short_conv_kernel_size": 3,
        "layer_group_size": 3,
        "kda_lower_bound": -3.0,
        "mtp_loss_scaling_factor": 0.3,
    }
    return BailingHybridConfig(**{**args, **kw})


CONFIGS = {
    "kimi_default": KimiLinearConfig,
    "kimi_small": _small_kimi,
    "bailing_default": BailingHybridConfig,
    "bailing_small": _small_bailing,
    "bailing_rope_parameters": lambda: _small_bailing(rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
    "bailing_no_safe_gate": lambda: _small_bailing(kda_safe_gate=False, kda_lower_bound=0.0, layer_types=[F] * 7),
}

# A config.json as the Kimi Linear checkpoint writes it (keys of its remote code).
KIMI_HUB = {
    "architectures": ["KimiLinearForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig"},
    "model_type": "kimi_linear",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.56.0",
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "num_experts": 64,
    "num_experts_per_token": 4,
    "num_shared_experts": 1,
    "num_expert_group": 1,
    "topk_group": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446,
    "first_k_dense_replace": 2,
    "model_max_length": 1048576,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "num_nextn_predict_layers": 0,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "pad_token_id": 163839,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "linear_attn_config": {
        "head_dim": 64,
        "num_heads": 16,
        "short_conv_kernel_size": 3,
        "full_attn_layers": [4, 8],
        "kda_layers": [1, 2, 3, 5, 6, 7],
    },
}

BAILING_HUB = {
    "architectures": ["BailingHybridForCausalLM"],
    "model_type": "bailing_hybrid",
    "dtype": "bfloat16",
    "transformers_version": "5.3.0",
    "quantization_config": {"quant_method": "fp8"},
    "vocab_size": 157184,
    "hidden_size": 2560,
    "num_hidden_layers": 12,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "num_expert_group": 8,
    "topk_group": 4,
    "moe_renormalize": True,
    "first_k_dense_replace": 1,
    "model_max_length": 131072,
    "num_nextn_predict_layers": 1,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "head_dim": 128,
    "layer_group_size": 4,
    "kda_safe_gate": True,
    "kda_lower_bound": -5.0,  # transformers (strict) rejects an int here; kdax takes either
    "eos_token_id": [156892, 156895],
}


def test_defaults_and_derived_fields():
    k = KimiLinearConfig()
    assert [i for i, t in enumerate(k.layer_types) if t == F] == [4, 8, 12, 16, 20, 24]
    assert len(k.layer_types) == 27 and k.mlp_layer_types == ["dense"] + ["sparse"] * 26
    assert (k.qk_head_dim, k.rope_theta, k.linear_head_dim, k.linear_num_heads) == (192, None, 128, 32)
    assert (k.num_local_experts, k.n_group, k.topk_group, k.num_experts_per_tok) == (256, 1, 1, 8)
    b = BailingHybridConfig()
    assert [i for i, t in enumerate(b.layer_types) if t == F] == [5, 11, 17, 23, 29, 35, 41]
    assert b.mlp_layer_types == ["dense"] * 2 + ["sparse"] * 40
    assert b.rope_parameters == {"rope_type": "default", "rope_theta": 6e6} and b.rope_theta == 6e6
    assert (b.qk_head_dim, b.linear_head_dim, b.linear_num_heads, b.linear_conv_kernel_dim) == (192, 128, 32, 4)
    assert (b.kda_safe_gate, b.kda_lower_bound, b.num_mtp_layers) == (True, -5.0, 1)
    assert _small_kimi().num_key_value_heads == 4 and _small_bailing().num_key_value_heads == 4


@pytest.mark.parametrize("name", CONFIGS)
def test_round_trip(name):
    cfg = CONFIGS[name]()
    d = cfg.to_dict()
    assert d["model_type"] == type(cfg).MODEL_TYPE
    back = type(cfg).from_dict(json.loads(json.dumps(d)))
    assert back == cfg and hash(back) == hash(cfg) and back.to_dict() == d


def test_equal_configs_hash_alike():
    a, b = BailingHybridConfig(rope_theta=6_000_000, kda_lower_bound=-5), BailingHybridConfig()
    assert a == b and hash(a) == hash(b) and isinstance(a.rope_theta, float)
    assert {KimiLinearConfig(): 1}[KimiLinearConfig()] == 1
    assert KimiLinearConfig(layer_types=tuple(KimiLinearConfig().layer_types)) == KimiLinearConfig()


ALIASES = [
    (cls, alias, field, value)
    for cls, extra in (
        (KimiLinearConfig, []),
        (BailingHybridConfig, [("num_nextn_predict_layers", "num_mtp_layers", 3)]),
    )
    for alias, field, value in [
        ("num_experts", "num_local_experts", 64),
        ("num_experts_per_token", "num_experts_per_tok", 2),
        ("num_shared_experts", "n_shared_experts", 2),
        ("moe_renormalize", "norm_topk_prob", False),
        ("num_expert_group", "n_group", 4),
        ("model_max_length", "max_position_embeddings", 8192),
        *extra,
    ]
]


@pytest.mark.parametrize("cls, alias, field, value", ALIASES)
def test_alias_keys(cls, alias, field, value):
    cfg = cls.from_dict({"model_type": cls.MODEL_TYPE, alias: value})
    assert getattr(cfg, field) == value
    # as in transformers, the alias is set after the fields, so it wins over the canonical key
    assert getattr(cls.from_dict({field: getattr(cls(), field), alias: value}), field) == value
    assert alias not in cfg.to_dict() and cfg.to_dict()[field] == value


def test_kimi_hub_dict():
    cfg = KimiLinearConfig.from_dict(KIMI_HUB)
    assert cfg.layer_types == [L, L, L, F, L, L, L, F]  # full_attn_layers [4, 8], 1-indexed
    assert cfg.mlp_layer_types == ["dense", "dense"] + ["sparse"] * 6  # first_k_dense_replace 2
    assert (cfg.linear_head_dim, cfg.linear_num_heads, cfg.linear_conv_kernel_dim) == (64, 16, 3)
    assert (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.max_position_embeddings) == (64, 4, 1048576)
    assert cfg.eos_token_id == 163585 and cfg.rope_theta is None
    assert "linear_attn_config" not in cfg.to_dict() and KimiLinearConfig.from_dict(cfg.to_dict()) == cfg


def test_kimi_linear_attn_config_precedence():
    lac = {"head_dim": 64, "full_attn_layers": [1], "kda_layers": [2, 3]}
    base = {"num_hidden_layers": 3, "linear_head_dim": 32}
    # linear_attn_config's head_dim wins over the field; its layer lists give layer_types ...
    cfg = KimiLinearConfig.from_dict({**base, "linear_attn_config": lac})
    assert cfg.linear_head_dim == 64 and cfg.layer_types == [F, L, L]
    assert cfg.mlp_layer_types == ["dense", "sparse", "sparse"]  # first_k_dense_replace defaults to 1
    # ... unless layer_types is given
    cfg = KimiLinearConfig.from_dict({**base, "linear_attn_config": lac, "layer_types": [L, L, F]})
    assert cfg.layer_types == [L, L, F]
    # one list alone, or none: the default rule
    cfg = KimiLinearConfig.from_dict({"num_hidden_layers": 6, "linear_attn_config": {"full_attn_layers": [1]}})
    assert cfg.layer_types == [L, L, L, L, F, L] and cfg.linear_head_dim == 128
    assert KimiLinearConfig.from_dict({"num_hidden_layers": 3, "linear_attn_config": None}).linear_num_heads == 32
    # mlp_layer_types given wins over first_k_dense_replace
    mlp = ["sparse", "dense", "sparse"]
    cfg = KimiLinearConfig.from_dict({"num_hidden_layers": 3, "first_k_dense_replace": 0, "mlp_layer_types": mlp})
    assert cfg.mlp_layer_types == mlp
    assert KimiLinearConfig.from_dict({"num_hidden_layers": 2, "first_k_dense_replace": 0}).mlp_layer_types == [
        "sparse",
        "sparse",
    ]


def test_bailing_hub_dict():
    cfg = BailingHybridConfig.from_dict(BAILING_HUB)
    assert cfg.layer_types == ([L] * 3 + [F]) * 3 and cfg.mlp_layer_types == ["dense"] + ["sparse"] * 11
    assert cfg.rope_theta == 1e6 and cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    assert (cfg.num_local_experts, cfg.num_mtp_layers, cfg.max_position_embeddings) == (256, 1, 131072)
    assert cfg.eos_token_id == [156892, 156895] and cfg.head_dim == cfg.linear_head_dim == 128
    assert BailingHybridConfig.from_dict(cfg.to_dict()) == cfg


def test_bailing_rope():
    # rope_parameters' rope_theta is the one used; a missing one comes from rope_theta
    cfg = BailingHybridConfig(rope_theta=1e4, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert cfg.rope_theta == 5e5
    cfg = BailingHybridConfig(rope_theta=1e4, rope_parameters={"rope_type": "default"})
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1e4} and cfg.rope_theta == 1e4
    assert BailingHybridConfig(rope_parameters={"type": "default"}).rope_parameters["rope_type"] == "default"
    # from_dict: rope_theta from rope_parameters, and the legacy rope_scaling key
    assert (
        BailingHybridConfig.from_dict({"rope_parameters": {"rope_type": "default", "rope_theta": 2e5}}).rope_theta
        == 2e5
    )
    assert BailingHybridConfig.from_dict({"rope_scaling": {"type": "default", "rope_theta": 3e5}}).rope_theta == 3e5
    with pytest.raises(ValueError, match=r"^rope_parameters: .*'yarn'.*supported rope types: \('default',\)"):
        BailingHybridConfig.from_dict({"rope_scaling": {"type": "yarn", "factor": 4.0}, "rope_theta": 1e4})


def test_bailing_transformers_dict():
    # transformers' to_dict: head_dim overwritten with qk_rope_head_dim, the KDA head dim in linear_head_dim
    d = {**_small_bailing().to_dict(), "head_dim": 4, "linear_head_dim": 16, "linear_num_heads": 4}
    d |= {"linear_conv_kernel_dim": 3, "qk_head_dim": 16}
    assert BailingHybridConfig.from_dict(d) == _small_bailing()


def test_legacy_layer_type_names():
    cfg = KimiLinearConfig(num_hidden_layers=3, layer_types=["mamba", "attention", "linear_attention"])
    assert cfg.layer_types == [L, F, L]


def test_unknown_keys_ignored_and_model_type():
    extra = {"architectures": ["X"], "torch_dtype": "bfloat16", "dtype": "float32", "auto_map": {}, "foo": 1}
    assert KimiLinearConfig.from_dict(extra) == KimiLinearConfig()
    assert BailingHybridConfig.from_dict({**extra, "quantization_config": {}}) == BailingHybridConfig()
    with pytest.raises(ValueError, match=r"^model_type: expected 'kimi_linear'"):
        KimiLinearConfig.from_dict({"model_type": "bailing_hybrid"})
    with pytest.raises(ValueError, match=r"^model_type: expected 'bailing_hybrid'"):
        BailingHybridConfig.from_dict({"model_type": "kimi_linear"})


K, B = KimiLinearConfig, BailingHybridConfig
ERRORS = [
    (K, {"vocab_size": 0}, "vocab_size"),
    (K, {"hidden_size": -1}, "hidden_size"),
    (B, {"intermediate_size": 2.0}, "intermediate_size"),
    (K, {"moe_intermediate_size": None}, "moe_intermediate_size"),
    (K, {"num_hidden_layers": 0}, "num_hidden_layers"),
    (B, {"num_hidden_layers": 0}, "num_hidden_layers"),
    (K, {"num_attention_heads": 0}, "num_attention_heads"),
    (K, {"n_shared_experts": 0}, "n_shared_experts"),
    (K, {"kv_lora_rank": 1.5}, "kv_lora_rank"),
    (B, {"q_lora_rank": 0}, "q_lora_rank"),
    (K, {"qk_rope_head_dim": 0}, "qk_rope_head_dim"),
    (K, {"qk_nope_head_dim": 0}, "qk_nope_head_dim"),
    (B, {"v_head_dim": None}, "v_head_dim"),
    (K, {"num_local_experts": True}, "num_local_experts"),
    (K, {"max_position_embeddings": 0}, "max_position_embeddings"),
    (K, {"pretraining_tp": 0}, "pretraining_tp"),
    (K, {"num_key_value_heads": 3}, "num_key_value_heads"),
    (B, {"num_key_value_heads": 8}, "num_key_value_heads"),
    (K, {"n_group": 3}, "n_group"),
    (B, {"n_group": 0}, "n_group"),
    (K, {"topk_group": 2}, "topk_group"),
    (B, {"topk_group": 0}, "topk_group"),
    (B, {"topk_group": 9}, "topk_group"),
    (K, {"num_experts_per_tok": 257}, "num_experts_per_tok"),
    (B, {"num_experts_per_tok": 4 * 64 + 1}, "num_experts_per_tok"),
    (K, {"layer_types": [L] * 26}, "layer_types"),
    (K, {"layer_types": ["sliding_attention"] * 27}, "layer_types"),
    (B, {"layer_types": "linear_attention"}, "layer_types"),
    (K, {"mlp_layer_types": ["moe"] * 27}, "mlp_layer_types"),
    (B, {"mlp_layer_types": ["dense"] * 41}, "mlp_layer_types"),
    (K, {"hidden_act": "gelu"}, "hidden_act"),
    (B, {"hidden_act": "swish"}, "hidden_act"),
    (K, {"linear_head_dim": 512}, "linear_head_dim"),
    (K, {"linear_num_heads": 0}, "linear_num_heads"),
    (K, {"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim"),
    (B, {"head_dim": 384}, "head_dim"),
    (K, {"pad_token_id": 163840}, "pad_token_id"),
    (K, {"bos_token_id": True}, "bos_token_id"),
    (K, {"eos_token_id": [1, -1]}, "eos_token_id"),
    (B, {"eos_token_id": []}, "eos_token_id"),
    (B, {"pad_token_id": "0"}, "pad_token_id"),
    (K, {"pad_token_id": [0]}, "pad_token_id"),
    (K, {"rms_norm_eps": 0}, "rms_norm_eps"),
    (K, {"routed_scaling_factor": "2"}, "routed_scaling_factor"),
    (K, {"initializer_range": -0.1}, "initializer_range"),
    (K, {"attention_dropout": 1.0}, "attention_dropout"),
    (K, {"tie_word_embeddings": 1}, "tie_word_embeddings"),
    (B, {"kda_safe_gate": None}, "kda_safe_gate"),
    (B, {"kda_lower_bound": 0.0}, "kda_lower_bound"),
    (B, {"kda_lower_bound": float("nan")}, "kda_lower_bound"),
    (B, {"layer_group_size": 0}, "layer_group_size"),
    (B, {"short_conv_kernel_size": 0}, "short_conv_kernel_size"),
    (B, {"first_k_dense_replace": -1}, "first_k_dense_replace"),
    (B, {"num_mtp_layers": -1}, "num_mtp_layers"),
    (B, {"mtp_loss_scaling_factor": float("inf")}, "mtp_loss_scaling_factor"),
    (B, {"rope_theta": 0}, "rope_theta"),
    (B, {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters"),
    (B, {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "rope_parameters"),
    (B, {"rope_parameters": {"type": "default", "rope_type": "yarn"}}, "rope_parameters"),
    (B, {"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "rope_parameters"),
    (B, {"rope_parameters": "default"}, "rope_parameters"),
    (B, {"rope_parameters": {"rope_theta": -1.0}}, "rope_parameters.rope_theta"),
]


@pytest.mark.parametrize(
    "cls, kwargs, field", ERRORS, ids=[f"{c.__name__}-{'-'.join(kw)}-{i}" for i, (c, kw, _) in enumerate(ERRORS)]
)
def test_errors(cls, kwargs, field):
    with pytest.raises(ValueError, match=rf"^{re.escape(field)}: "):
        cls(**kwargs)


def test_mla_kv_heads_message():
    with pytest.raises(ValueError, match=r"repeat_kv"):
        KimiLinearConfig(num_key_value_heads=16)


_FULL_RANGE = list(range(1, 9))
DICT_ERRORS = [
    (K, {"linear_attn_config": [4]}, "linear_attn_config"),
    (
        K,
        {"num_hidden_layers": 3, "linear_attn_config": {"full_attn_layers": [0], "kda_layers": [1, 2]}},
        "linear_attn_config.full_attn_layers",
    ),
    (
        K,
        {"num_hidden_layers": 3, "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2]}},
        "linear_attn_config.full_attn_layers",
    ),
    (
        K,
        {"num_hidden_layers": 3, "linear_attn_config": {"full_attn_layers": 3, "kda_layers": [1, 2]}},
        "linear_attn_config.full_attn_layers",
    ),
    (
        K,
        {"num_hidden_layers": 3, "linear_attn_config": {"full_attn_layers": [3], "kda_layers": [1, 3]}},
        "linear_attn_config.kda_layers",
    ),
    (
        K,
        {"num_hidden_layers": 3, "linear_attn_config": {"full_attn_layers": [3], "kda_layers": [1]}},
        "linear_attn_config",
    ),
    (K, {"first_k_dense_replace": -1}, "first_k_dense_replace"),
    (K, {"linear_attn_config": {"head_dim": 512}}, "linear_head_dim"),
    (B, {"linear_num_heads": 8}, "linear_num_heads"),
    (B, {"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_parameters"),
]


@pytest.mark.parametrize("cls, d, field", DICT_ERRORS)
def test_from_dict_errors(cls, d, field):
    with pytest.raises(ValueError, match=rf"^{re.escape(field)}: "):
        cls.from_dict(d)


# ---- agreement with transformers (skipped where it is not installed) ----


def _hf_fields(hf_cls):
    from transformers import PreTrainedConfig

    base = {f.name for f in dataclasses.fields(PreTrainedConfig)}
    return {f.name for f in dataclasses.fields(hf_cls)} - base


def _assert_matches(cfg, hf):
    """Every kdax field and property equals the transformers config's attribute."""
    for f in dataclasses.fields(cfg):
        if isinstance(cfg, BailingHybridConfig) and f.name == "head_dim":
            # transformers moves head_dim to linear_head_dim, then sets head_dim = qk_rope_head_dim
            assert hf.linear_head_dim == cfg.head_dim and hf.head_dim == cfg.qk_rope_head_dim
            continue
        assert getattr(hf, f.name) == getattr(cfg, f.name), f.name
    for name in ("qk_head_dim", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim"):
        assert getattr(hf, name) == getattr(cfg, name), name


@pytest.mark.parametrize("cls", [KimiLinearConfig, BailingHybridConfig])
def test_defaults_match_transformers(cls):
    transformers = pytest.importorskip("transformers")
    hf_cls = getattr(transformers, cls.__name__)
    assert {f.name for f in dataclasses.fields(cls)} == _hf_fields(hf_cls)
    assert cls.MODEL_TYPE == hf_cls.model_type
    assert {**cls.ALIASES} == hf_cls.attribute_map
    _assert_matches(cls(), hf_cls())


@pytest.mark.parametrize("name", CONFIGS)
def test_to_dict_loads_in_transformers(name):
    transformers = pytest.importorskip("transformers")
    cfg = CONFIGS[name]()
    hf = transformers.AutoConfig.for_model(**cfg.to_dict())
    assert type(hf).__name__ == type(cfg).__name__
    _assert_matches(cfg, hf)
    # and back from what transformers' save_pretrained writes (alias keys, overwritten head_dim, ...)
    saved = json.loads(hf.to_json_string(use_diff=False))
    assert type(cfg).from_dict(saved) == cfg
    assert type(cfg).from_dict(json.loads(hf.to_json_string())) == cfg


@pytest.mark.parametrize("cls, d", [(KimiLinearConfig, KIMI_HUB), (BailingHybridConfig, BAILING_HUB)])
def test_hub_dict_matches_transformers(cls, d):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoConfig.for_model(**json.loads(json.dumps(d)))
    cfg = cls.from_dict(d)
    _assert_matches(cfg, hf)
    assert cls.from_dict(hf.to_dict()) == cfg


def test_kimi_linear_attn_config_matches_transformers():
    transformers = pytest.importorskip("transformers")
    for d in (
        {
            "num_hidden_layers": 3,
            "linear_head_dim": 32,
            "linear_attn_config": {"head_dim": 64, "full_attn_layers": [1], "kda_layers": [2, 3]},
        },
        {
            "num_hidden_layers": 3,
            "linear_attn_config": {"full_attn_layers": [1], "kda_layers": [2, 3]},
            "layer_types": [L, L, F],
        },
        {"num_hidden_layers": 6, "linear_attn_config": {"full_attn_layers": [1]}, "first_k_dense_replace": 3},
    ):
        _assert_matches(KimiLinearConfig.from_dict(d), transformers.KimiLinearConfig(**d))


def test_bailing_rope_parameters_theta_matches_transformers():
    transformers = pytest.importorskip("transformers")
    d = {"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    hf, cfg = transformers.BailingHybridConfig(**d), BailingHybridConfig.from_dict(d)
    # transformers keeps its rope_theta field as given; its rotary embedding reads rope_parameters
    assert hf.rope_parameters == cfg.rope_parameters and cfg.rope_theta == hf.rope_parameters["rope_theta"] == 5e5
