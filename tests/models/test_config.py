"""ModelConfig <-> Hugging Face config.json, checked against the transformers config classes."""

import dataclasses

import pytest
import transformers

from jaxspec.models import ModelConfig
from jaxspec.models.config import SUPPORTED_ARCHITECTURES
from tests.models.hf_reference import CONFIG_CLASSES, hf_config, perturbed_model

ARCHITECTURES = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}
ROPES = {
    "default": dict(rope_type="default", rope_theta=1e6),
    "linear": dict(rope_type="linear", factor=2.0, rope_theta=1e4),
    "dynamic": dict(rope_type="dynamic", factor=3.0, rope_theta=1e4),
    "yarn": dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=16, rope_theta=1e4, beta_fast=16.0, beta_slow=2.0
    ),
    "llama3": dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
        rope_theta=5e5,
    ),
}
FAMILY_OVERRIDES = {
    "qwen2": dict(tie_word_embeddings=True, eos_token_id=[3, 4]),
    "qwen3": dict(head_dim=24, num_key_value_heads=1, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "llama": dict(num_key_value_heads=4, rms_norm_eps=1e-5),
}


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("family", sorted(FAMILY_OVERRIDES))
def test_from_hf_to_hf_round_trip_through_transformers(family, rope):
    hf = hf_config(family, rope_parameters=dict(ROPES[rope]), **FAMILY_OVERRIDES[family])
    cfg = ModelConfig.from_hf(hf.to_dict())
    assert cfg.family == family
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (97, 32, 48, 2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
        getattr(hf, "head_dim", None) or 8,
    )
    assert cfg.rms_norm_eps == hf.rms_norm_eps and cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.rope_theta == ROPES[rope]["rope_theta"]
    expected_rope = {k: v for k, v in hf.rope_parameters.items() if k != "rope_theta"}
    assert cfg.rope == expected_rope
    assert (cfg.attention_bias, cfg.qk_norm) == (family == "qwen2", family == "qwen3")
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    # transformers reads our config.json back to an equivalent config.
    again = CONFIG_CLASSES[family](**cfg.to_hf())
    assert ModelConfig.from_hf(again.to_dict()) == cfg
    assert again.rope_parameters == hf.rope_parameters


def test_to_hf_writes_token_ids_and_dtype():
    cfg = ModelConfig(
        family="qwen2",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        max_position_embeddings=32,
        eos_token_id=(3, 4),
        bos_token_id=1,
        pad_token_id=0,
    )
    out = cfg.to_hf("bfloat16")
    assert out["eos_token_id"] == [3, 4] and out["bos_token_id"] == 1 and out["pad_token_id"] == 0
    assert out["torch_dtype"] == out["dtype"] == "bfloat16"
    assert out["architectures"] == ["Qwen2ForCausalLM"] and out["model_type"] == "qwen2"
    assert cfg.eos_ids == (3, 4)
    assert dataclasses.replace(cfg, eos_token_id=7).eos_ids == (7,)
    assert dataclasses.replace(cfg, eos_token_id=None).eos_ids == ()


LEGACY = {  # transformers 4.x style: top-level rope_theta, rope_scaling with "type" or "rope_type"
    "linear_type_key": (
        {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}},
        5e5,
        {"rope_type": "linear", "factor": 2.0},
    ),
    "llama3": (
        {
            "rope_theta": 5e5,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
        5e5,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "no_scaling": ({"rope_theta": 1e6, "rope_scaling": None}, 1e6, {"rope_type": "default"}),
    "nothing": ({}, 10000.0, {"rope_type": "default"}),
    "v5_parameters": (
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 1e6,
                "original_max_position_embeddings": 32768,
            }
        },
        1e6,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    ),
}


def _llama_dict(**extra):
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 131072,
        **extra,
    }


@pytest.mark.parametrize("name", sorted(LEGACY))
def test_rope_config_styles_parse_like_transformers(name):
    extra, theta, rope = LEGACY[name]
    cfg = ModelConfig.from_hf(_llama_dict(**extra))
    assert cfg.rope_theta == theta
    assert cfg.rope == rope
    hf = transformers.LlamaConfig(**_llama_dict(**extra))
    assert hf.rope_parameters["rope_theta"] == theta
    assert hf.rope_parameters["rope_type"] == rope["rope_type"]
    assert {k: v for k, v in hf.rope_parameters.items() if k in rope} == rope


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_omitted_keys_take_the_transformers_defaults(family):
    minimal = {
        "architectures": [ARCHITECTURES[family]],
        "vocab_size": 50,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    cfg = ModelConfig.from_hf(minimal)
    hf = CONFIG_CLASSES[family](**minimal)
    assert cfg.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings


def test_model_type_without_architectures():
    cfg = ModelConfig.from_hf({k: v for k, v in _llama_dict().items() if k != "architectures"})
    assert cfg.family == "llama"


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_sliding_window_is_rejected(family):
    hf = hf_config(family).to_dict()
    hf["use_sliding_window"] = True
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf(hf)


@pytest.mark.parametrize("rope_type", ["longrope", "proportional", "made_up"])
def test_unknown_rope_type_is_rejected(rope_type):
    with pytest.raises(ValueError, match=rope_type):
        ModelConfig.from_hf(_llama_dict(rope_scaling={"rope_type": rope_type, "factor": 2.0}))
    with pytest.raises(ValueError, match=rope_type):
        ModelConfig.from_hf(_llama_dict(rope_parameters={"rope_type": rope_type, "rope_theta": 1e4}))


def test_other_unsupported_settings_are_rejected():
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelConfig.from_hf(_llama_dict(mlp_bias=True))
    with pytest.raises(ValueError, match="attention_bias"):
        ModelConfig.from_hf(_llama_dict(attention_bias=True))
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_hf({k: v for k, v in _llama_dict().items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="Gemma2ForCausalLM"):
        ModelConfig.from_hf(_llama_dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2"))


def test_constructor_validation():
    base = dict(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=2,
        max_position_embeddings=32,
    )
    assert ModelConfig(family="qwen3", **base).qk_norm is True
    assert ModelConfig(family="qwen2", **base).attention_bias is True
    assert ModelConfig(family="llama", **base) == ModelConfig(
        family="llama", attention_bias=False, qk_norm=False, **base
    )
    with pytest.raises(ValueError, match="qk_norm"):
        ModelConfig(family="qwen3", qk_norm=False, **base)
    with pytest.raises(ValueError, match="attention_bias"):
        ModelConfig(family="llama", attention_bias=True, **base)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        ModelConfig(family="llama", **{**base, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="gpt2"):
        ModelConfig(family="gpt2", **base)
    with pytest.raises(ValueError, match="longrope"):
        ModelConfig(family="llama", rope_scaling=(("rope_type", "longrope"),), **base)
    hash(ModelConfig(family="llama", rope_scaling=(("factor", 2.0), ("rope_type", "linear")), **base))


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("qwen2", dict()),
        ("qwen2", dict(tie_word_embeddings=True)),
        ("qwen3", dict(head_dim=24)),
        ("qwen3", dict(tie_word_embeddings=True, num_key_value_heads=1)),
        ("llama", dict(num_hidden_layers=3)),
        ("llama", dict(tie_word_embeddings=True, num_key_value_heads=4)),
    ],
)
def test_num_params_equals_transformers(family, overrides):
    hf = hf_config(family, **overrides)
    model = perturbed_model(hf, seed=0)
    assert ModelConfig.from_hf(hf.to_dict()).num_params() == sum(p.numel() for p in model.parameters())


MOE_BASE = dict(
    family="qwen3_moe",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(num_experts=4, num_experts_per_tok=5, moe_intermediate_size=16), "num_experts_per_tok=5"),
        (dict(num_experts=4, num_experts_per_tok=0, moe_intermediate_size=16), "num_experts_per_tok=0"),
        (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=0), "moe_intermediate_size=0"),
        (
            dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, decoder_sparse_step=0),
            "decoder_sparse_step=0",
        ),
        (dict(family="qwen3", num_experts=4), "num_experts=4 needs family 'qwen3_moe'"),
    ],
)
def test_bad_moe_config_raises(fields, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**(MOE_BASE | fields))


def test_from_hf_rejects_contradicting_expert_counts():
    hf = hf_config("qwen3_moe").to_dict() | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_experts": 4,
        "num_local_experts": 8,
    }
    with pytest.raises(ValueError, match="config.json: num_experts=4 contradicts num_local_experts=8"):
        ModelConfig.from_hf(hf)
