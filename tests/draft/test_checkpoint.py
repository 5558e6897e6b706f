"""Public EAGLE-3 layout: round trip, a hand-written checkpoint checked against a PyTorch
reference built from transformers' Llama modules, and the errors for heads that do not fit."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.models.llama import modeling_llama as llama

from jaxspec.draft import (
    DraftConfig,
    check_compatible,
    default_aux_layer_ids,
    draft_extend,
    fuse,
    init_draft_cache,
    load_eagle3,
    save_eagle3,
)
from jaxspec.models import ModelConfig
from jaxspec.rollout import Sampling, Spec, generate
from tests.models.hf_reference import random_tokens, rel_max_err

TOL = 1e-5
extend_jit = jax.jit(draft_extend, static_argnums=0)


def test_round_trip_is_lossless(tmp_path, head):
    dcfg, dparams = head
    save_eagle3(dcfg, dparams, tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 40
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(dcfg.aux_layer_ids)
    loaded_cfg, loaded = load_eagle3(tmp_path / "head")
    assert loaded_cfg == dcfg
    assert jax.tree.structure(loaded) == jax.tree.structure(dparams)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(dparams)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    # Saving over an existing folder replaces it; bfloat16 export reloads as the rounded weights.
    save_eagle3(dcfg, dparams, tmp_path / "head", dtype="bfloat16")
    _, half = load_eagle3(tmp_path / "head", dtype="bfloat16")
    np.testing.assert_array_equal(half["midlayer"]["q"], dparams["midlayer"]["q"].astype(jnp.bfloat16))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]  # no temp folders left behind


class TorchEagle3(nn.Module):
    """The public EAGLE-3 head written with transformers' Llama building blocks; its state_dict
    keys are the checkpoint's tensor names."""

    def __init__(self, config: transformers.LlamaConfig, draft_vocab_size: int):
        super().__init__()
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = nn.Module()
        self.midlayer.input_layernorm = llama.LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.midlayer.hidden_norm = llama.LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.midlayer.self_attn = llama.LlamaAttention(config, layer_idx=0)
        for name, heads in (
            ("q_proj", config.num_attention_heads),
            ("k_proj", config.num_key_value_heads),
            ("v_proj", config.num_key_value_heads),
        ):  # attention reads 2H features
            setattr(self.midlayer.self_attn, name, nn.Linear(2 * h, heads * config.head_dim, bias=False))
        self.midlayer.post_attention_layernorm = llama.LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.midlayer.mlp = llama.LlamaMLP(config)
        self.norm = llama.LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary = llama.LlamaRotaryEmbedding(config)

    def step(self, tokens, hidden, positions, cache, mask):
        """One pass of the layer: (logits [B, T, Vd], pre-norm output [B, T, H])."""
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(self.embed_tokens(tokens)), layer.hidden_norm(hidden)], dim=-1)
        attn, _ = layer.self_attn(
            x, position_embeddings=self.rotary(hidden, positions), attention_mask=mask, cache=cache
        )
        h = hidden + attn
        out = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.norm(out)), out


def _hand_written_head(path, seed: int):
    """Writes config.json and model.safetensors of a random TorchEagle3 by hand; returns it."""
    config = transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=500.0,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = TorchEagle3(config, draft_vocab_size=40).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(
                1.0 + 0.3 * noise
                if name.endswith("norm.weight")
                else noise
                if name == "embed_tokens.weight"
                else noise / p.shape[1] ** 0.5
            )
        kept = torch.sort(torch.randperm(61, generator=gen)[:40]).values
        model.d2t.copy_(kept - torch.arange(40))
        model.t2d[kept] = True
    path.mkdir()
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items() if "rotary" not in k}, str(path / "model.safetensors")
    )
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "model_type": "llama",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 8,
                "num_hidden_layers": 1,
                "rms_norm_eps": 1e-5,
                "rope_theta": 500.0,
                "max_position_embeddings": 128,
                "vocab_size": 61,
                "draft_vocab_size": 40,
                "torch_dtype": "float32",
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 1, 0]},
            }
        )
    )
    return model


def test_hand_written_checkpoint_matches_torch_reference(tmp_path):
    """Prefill 9 entries, then two drafting steps on the recursion, in both implementations."""
    model = _hand_written_head(tmp_path / "public", seed=0)
    dcfg, dparams = load_eagle3(tmp_path / "public")
    assert dcfg.aux_layer_ids == (1, 1, 0) and dcfg.draft_vocab_size == 40 and dcfg.rms_norm_eps == 1e-5
    np.testing.assert_array_equal(dparams["d2t"], model.d2t.numpy())
    embed = jnp.asarray(model.embed_tokens.weight.detach().numpy())  # the policy's embedding in real use

    b, t = 2, 9
    tokens = random_tokens(1, (b, t + 2), 61)
    aux = np.asarray(jax.random.normal(jax.random.key(2), (3, b, t, 32)))
    positions = np.broadcast_to(np.arange(t), (b, t))
    causal = torch.triu(torch.full((t, t), torch.finfo(torch.float32).min), diagonal=1)[None, None]
    cache = DynamicCache(config=model.midlayer.self_attn.config)
    with torch.no_grad():
        fused_ref = model.fc(torch.from_numpy(np.concatenate(list(aux), axis=-1)))
        ref_logits, ref_out = model.step(
            torch.from_numpy(tokens[:, :t].astype(np.int64)),
            fused_ref,
            torch.from_numpy(positions.astype(np.int64)),
            cache,
            causal,
        )

    dcache = init_draft_cache(dcfg, b, 16)
    fused = fuse(dcfg, dparams, jnp.asarray(aux))
    assert rel_max_err(fused, fused_ref.numpy()) < TOL
    logits, out, dcache = extend_jit(
        dcfg,
        dparams,
        embed,
        dcache,
        jnp.asarray(tokens[:, :t]),
        fused,
        jnp.asarray(positions, jnp.int32),
        jnp.zeros((b,), jnp.int32),
    )
    assert rel_max_err(logits, ref_logits.numpy()) < TOL
    for i in range(2):  # the recursion: last output and the next token at the next position
        ref_hidden, hidden = ref_out[:, -1:], out[:, -1:]
        token = tokens[:, t + i : t + i + 1]
        with torch.no_grad():
            ref_logits, ref_out = model.step(
                torch.from_numpy(token.astype(np.int64)), ref_hidden, torch.full((b, 1), t + i), cache, None
            )
        logits, out, dcache = extend_jit(
            dcfg,
            dparams,
            embed,
            dcache,
            jnp.asarray(token),
            hidden,
            jnp.full((b, 1), t + i, jnp.int32),
            jnp.full((b,), t + i, jnp.int32),
        )
        assert rel_max_err(logits, ref_logits.numpy()) < TOL, i


def test_heads_that_do_not_fit_the_policy_are_rejected(tmp_path, policy, head):
    cfg, _ = policy
    dcfg, dparams = head
    save_eagle3(dcfg, dparams, tmp_path / "head")
    load_eagle3(tmp_path / "head", policy=cfg)
    wider = ModelConfig(**{**cfg.__dict__, "hidden_size": 48})
    with pytest.raises(ValueError, match="hidden_size.*48"):
        load_eagle3(tmp_path / "head", policy=wider)
    with pytest.raises(ValueError, match="vocab_size"):
        check_compatible(ModelConfig(**{**cfg.__dict__, "vocab_size": 64}), dcfg)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        check_compatible(ModelConfig(**{**cfg.__dict__, "num_layers": 1}), dcfg)


def test_malformed_checkpoints_raise_clear_errors(tmp_path, head):
    dcfg, dparams = head
    with pytest.raises(FileNotFoundError, match="missing"):
        load_eagle3(tmp_path / "missing")
    bad = {**dparams, "lm_head": dparams["lm_head"][:, :39]}
    small_cfg = DraftConfig(**{**dcfg.__dict__, "draft_vocab_size": 39})
    save_eagle3(
        small_cfg,
        {**bad, "d2t": dparams["d2t"][:39], "t2d": dparams["t2d"].at[np.flatnonzero(dparams["t2d"])[-1]].set(False)},
        tmp_path / "head",
    )
    config_file = tmp_path / "head" / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "draft_vocab_size": 40}))
    with pytest.raises(ValueError, match=r"lm_head.weight has shape \(39, 32\), expected \(40, 32\)"):
        load_eagle3(tmp_path / "head")
    config_file.write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="EAGLE-3"):
        load_eagle3(tmp_path / "head")
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        save_eagle3(dcfg, {**dparams, "t2d": ~dparams["t2d"]}, tmp_path / "other")


def _without_layer_ids(folder):
    """Drops eagle_aux_hidden_state_layer_ids from a saved head's config.json, as published heads do."""
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    del config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    config_file.write_text(json.dumps(config))


def test_head_without_layer_ids_takes_the_policy_defaults_at_first_use(tmp_path, policy, head):
    cfg, params = policy
    dcfg, dparams = head  # for_policy: the default layers (1, L/2 - 1, L - 4) of the 4-layer policy
    assert dcfg.aux_layer_ids == default_aux_layer_ids(cfg.num_layers) == (1, 1, 0)
    save_eagle3(dcfg, dparams, tmp_path / "head")
    _without_layer_ids(tmp_path / "head")

    unresolved, loaded = load_eagle3(tmp_path / "head")  # no policy: resolved later
    assert unresolved.aux_layer_ids is None
    assert load_eagle3(tmp_path / "head", policy=cfg)[0] == dcfg
    assert unresolved.for_layers_of(cfg) == dcfg
    # Saved again it still names no layers, so it keeps following its policy.
    save_eagle3(unresolved, loaded, tmp_path / "again")
    assert "eagle_aux_hidden_state_layer_ids" not in json.loads((tmp_path / "again" / "config.json").read_text())
    assert load_eagle3(tmp_path / "again")[0] == unresolved

    # The rollout resolves them from the policy it drafts for: the same draws as the explicit head.
    prompts = [[1, 5, 9, 4], [2, 7]]
    sampling = Sampling(temperature=1.0, max_new_tokens=8)
    outs = [
        generate(
            cfg,
            params,
            prompts,
            jax.random.key(0),
            sampling,
            spec=Spec(method="eagle3", draft=draft, num_draft_tokens=2),
        )
        for draft in ((unresolved, loaded), (dcfg, dparams))
    ]
    np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
    np.testing.assert_array_equal(outs[0].logprobs, outs[1].logprobs)
    assert outs[0].stats["acceptance_length"] == outs[1].stats["acceptance_length"]


def test_head_without_layer_ids_and_no_policy_says_so(tmp_path, head):
    dcfg, dparams = head
    save_eagle3(dcfg, dparams, tmp_path / "head")
    _without_layer_ids(tmp_path / "head")
    unresolved, loaded = load_eagle3(tmp_path / "head")
    aux = jnp.zeros((3, 1, 2, dcfg.hidden_size))
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids.*for_layers_of"):
        fuse(unresolved, loaded, aux)
