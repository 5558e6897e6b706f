"""Greedy-decoding accuracy of a policy on held-out problems, scored by the math verifier."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models.config import ModelConfig
from jaxspec.models.params import Params
from jaxspec.models.sharding import Sharding
from jaxspec.rewards.math_verifier import arithmetic_reward
from jaxspec.rollout import Sampling, generate
from jaxspec.tasks.tokenizer import ChatTokenizer


def greedy_accuracy(
    cfg: ModelConfig,
    params: Params,
    tok: ChatTokenizer,
    problems: list[dict],
    max_new_tokens: int,
    key: jax.Array,
    batch_size: int = 256,
    sharding: Sharding | None = None,
) -> tuple[float, list[str]]:
    """(fraction of problems whose greedy response earns arithmetic_reward 1, the decoded responses).

    Problems are decoded in batches of `batch_size`; the last batch is filled up with copies of its
    first prompt so every call has the same shape (one compilation). sharding: the mesh the params
    live on (`generate(..., sharding=)`), None for one device.
    """
    if not problems:
        raise ValueError("greedy_accuracy needs at least one problem")
    sampling = Sampling(temperature=0.0, max_new_tokens=max_new_tokens, eos_id=tok.eos_id)
    prompts = [tok.encode_prompt(p["question"]) for p in problems]
    size = min(batch_size, len(prompts))
    responses: list[str] = []
    for start in range(0, len(prompts), size):
        chunk = prompts[start : start + size]
        filled = chunk + [chunk[0]] * (size - len(chunk))
        key, sub = jax.random.split(key)
        out = generate(cfg, params, filled, sub, sampling=sampling, sharding=sharding)
        tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
        responses += [tok.decode(tokens[i, : lengths[i]]) for i in range(len(chunk))]
    scores = [arithmetic_reward(r, p["answer"]) for r, p in zip(responses, problems)]
    return float(np.mean(scores)), responses


def cast_params(params: Params, dtype) -> Params:
    """Every leaf of `params` as `dtype` (e.g. bfloat16 copies of float32 master params)."""
    return jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), params)
