"""Reference Hugging Face models built locally (no hub) and helpers to compare logits with them.

Every parameter of a reference model is redrawn (norm weights around 1, biases and matrices with
unit-scale activations) so that no norm is the identity, no bias is zero and attention is far
from uniform: a wrong transpose, a missing bias or a misplaced norm shows up in the logits.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from jaxspec.models import init_params

CONFIG_CLASSES = {
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "llama": transformers.LlamaConfig,
    "qwen3_moe": transformers.Qwen3MoeConfig,
}


def hf_config(family: str, **overrides) -> transformers.PretrainedConfig:
    """A tiny config of `family` (hidden 32, 4 heads / 2 KV heads, 2 layers, vocab 97; qwen3_moe: 4
    experts of width 16, 2 per token)."""
    kwargs = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    if family == "qwen3_moe":  # 4 experts of width 16, 2 per token
        kwargs = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16) | kwargs
    if "head_dim" not in overrides and family in ("qwen3", "qwen3_moe", "llama"):  # Qwen3 defaults to 128
        kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    return CONFIG_CLASSES[family](**kwargs)


def perturbed_model(config: transformers.PretrainedConfig, seed: int) -> transformers.PreTrainedModel:
    """fp32 eager-attention model of `config` with every parameter redrawn from a seeded generator."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.5 * noise)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(noise)
            else:  # [(experts,) out, in] projection: unit-scale outputs for unit-scale inputs
                p.copy_(noise / math.sqrt(p.shape[-1]))
    return model.float().eval()


def saved_checkpoint(tmp_path_factory, name: str, family: str, overrides: dict, seed: int):
    """(name, `perturbed_model` of the family's config with `overrides`, the folder transformers
    saved it to): the parametrised checkpoint fixture of the parity tests."""
    model = perturbed_model(hf_config(family, **overrides), seed=seed)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return name, model, path


def _torch_ints(x) -> torch.Tensor:
    return torch.from_numpy(np.array(x, dtype=np.int64))  # a writable copy


def hf_logits(model, tokens, attention_mask=None, position_ids=None) -> np.ndarray:
    """float32 logits [B, T, V] of the torch model for int tokens [B, T]."""
    with torch.no_grad():
        out = model(
            input_ids=_torch_ints(tokens),
            attention_mask=None if attention_mask is None else _torch_ints(attention_mask),
            position_ids=None if position_ids is None else _torch_ints(position_ids),
        )
    return out.logits.float().numpy()


def hf_hidden_states(model, tokens) -> tuple[np.ndarray, ...]:
    """HF `output_hidden_states`: embeddings, then the output of each layer (the last one normed)."""
    with torch.no_grad():
        out = model(input_ids=_torch_ints(tokens), output_hidden_states=True)
    return tuple(h.float().numpy() for h in out.hidden_states)


def rel_max_err(actual, reference) -> float:
    """max |actual - reference| / max |reference| over all elements, in float64."""
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    reference = np.asarray(reference, np.float64)
    return float(np.max(np.abs(actual - reference)) / np.max(np.abs(reference)))


def random_tokens(seed: int, shape: tuple[int, ...], vocab_size: int) -> np.ndarray:
    """int32 tokens in [0, vocab_size); drawn at one fixed size so every shape shares one compile."""
    pool = jax.random.randint(jax.random.key(seed), (_POOL,), 0, vocab_size, jnp.int32)
    return np.asarray(pool)[: math.prod(shape)].reshape(shape)


_POOL = 4096


def random_params(cfg, key: jax.Array):
    """jaxspec params for `cfg` drawn at the scales `perturbed_model` uses (float32)."""
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    sizes = [leaf.size for _, leaf in leaves]
    noise = np.split(np.asarray(jax.random.normal(key, (sum(sizes),), jnp.float32)), np.cumsum(sizes)[:-1])
    out = []
    for (path, leaf), flat in zip(leaves, noise):
        name, x = path[-1].key, flat.reshape(leaf.shape)
        if name.endswith("norm"):
            x = 1.0 + 0.3 * x
        elif name.endswith("bias"):
            x = 0.5 * x
        elif name == "o":  # [Nq, D, H]: fan-in Nq * D
            x = x / math.sqrt(leaf.shape[0] * leaf.shape[1])
        elif name.startswith("experts_"):  # [E, in, out]
            x = x / math.sqrt(leaf.shape[1])
        elif name != "embed":  # [in, ...]
            x = x / math.sqrt(leaf.shape[0])
        out.append(jnp.asarray(x, jnp.float32))
    return jax.tree_util.tree_unflatten(treedef, out)
