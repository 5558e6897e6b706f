"""Qwen3-MoE HF folders: save_hf -> transformers, per-expert and fused expert tensors, a missing expert."""

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from jaxspec.models import ModelConfig, forward, load_hf, save_hf
from tests.models.hf_reference import hf_config, hf_logits, random_params, random_tokens, rel_max_err

FP32_TOL = 1e-5  # relative to max |logit|
SEQ = 20


def test_save_hf_round_trip_loads_in_transformers(tmp_path):
    cfg = ModelConfig.from_hf(
        hf_config(
            "qwen3_moe",
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=2,
            mlp_only_layers=[1],
            num_hidden_layers=4,
            norm_topk_prob=True,
        ).to_dict()
        | {"architectures": ["Qwen3MoeForCausalLM"]}
    )
    params = random_params(cfg, jax.random.key(3))
    save_hf(cfg, params, tmp_path / "ckpt")
    names = set(load_file(tmp_path / "ckpt" / "model.safetensors"))
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in names and "model.layers.3.mlp.gate.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names and "model.layers.1.mlp.gate.weight" not in names
    loaded_cfg, loaded = load_hf(tmp_path / "ckpt")
    assert loaded_cfg == cfg
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert model.config.num_experts == 8 and model.config.mlp_only_layers == [1]
    tokens = random_tokens(4, (2, SEQ), cfg.vocab_size)
    assert rel_max_err(forward(cfg, params, tokens), hf_logits(model, tokens)) < FP32_TOL


def test_load_hf_reads_fused_expert_tensors(tmp_path):
    """Folders holding each layer's experts as one gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    cfg = ModelConfig.from_hf(hf_config("qwen3_moe").to_dict() | {"architectures": ["Qwen3MoeForCausalLM"]})
    params = random_params(cfg, jax.random.key(5))
    save_hf(cfg, params, tmp_path / "split")
    tensors = load_file(tmp_path / "split" / "model.safetensors")
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}.mlp.experts."
        per = {
            p: np.stack([tensors.pop(f"{pre}{j}.{p}.weight") for j in range(4)])
            for p in ("gate_proj", "up_proj", "down_proj")
        }
        tensors[pre + "gate_up_proj"] = np.concatenate([per["gate_proj"], per["up_proj"]], axis=1)
        tensors[pre + "down_proj"] = per["down_proj"]
    (tmp_path / "fused").mkdir()
    save_file(tensors, tmp_path / "fused" / "model.safetensors")
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "split" / "config.json").read_text())
    _, loaded = load_hf(tmp_path / "fused")
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tensors["model.layers.1.mlp.experts.down_proj"] = tensors["model.layers.1.mlp.experts.down_proj"][:3]
    save_file(tensors, tmp_path / "fused" / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts.down_proj has shape \(3, 32, 16\)"):
        load_hf(tmp_path / "fused")


def test_load_hf_rejects_missing_expert(tmp_path):
    cfg = ModelConfig.from_hf(hf_config("qwen3_moe").to_dict() | {"architectures": ["Qwen3MoeForCausalLM"]})
    save_hf(cfg, random_params(cfg, jax.random.key(6)), tmp_path / "ckpt")
    tensors = load_file(tmp_path / "ckpt" / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, tmp_path / "ckpt" / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.0.mlp.experts.3.up_proj.weight'\]"):
        load_hf(tmp_path / "ckpt")
