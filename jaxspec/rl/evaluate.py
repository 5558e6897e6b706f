"""Validation accuracy of the policy on held-out prompts (greedy or sampled decoding)."""

from __future__ import annotations

import jax
import numpy as np

from jaxspec.distributed import to_host
from jaxspec.models.config import ModelConfig
from jaxspec.models.params import Params
from jaxspec.rewards.registry import Reward
from jaxspec.rl.data import PromptSet
from jaxspec.rollout import Sampling, generate
from jaxspec.tasks.tokenizer import ChatTokenizer


def decode_responses(tok: ChatTokenizer, tokens: np.ndarray, lengths: np.ndarray) -> list[str]:
    """Text of each row's emitted tokens (eos and special tokens removed)."""
    return [tok.decode(tokens[i, : lengths[i]]) for i in range(tokens.shape[0])]


def validation_scores(
    cfg: ModelConfig,
    params: Params,
    tok: ChatTokenizer,
    prompts: PromptSet,
    reward: Reward,
    sampling: Sampling,
    key: jax.Array,
    batch_size: int,
    spec=None,
    sharding=None,
) -> dict[str, float]:
    """{"eval_accuracy": fraction of prompts whose response earns reward >= 1, "eval_reward_mean",
    "eval_reward_failures": responses whose grading failed (scored 0)}.

    Prompts are decoded in batches of `batch_size`; the last batch is filled up with copies of its
    first prompt and padded to the longest prompt's bucket, so every call has the same shape (one
    compilation). sharding: the policy's mesh (`jaxspec.models.Sharding`) or None.
    """
    size = min(batch_size, len(prompts))
    longest = max(len(ids) for ids in prompts.token_ids)  # every batch in one prompt-length bucket
    texts: list[str] = []
    for start in range(0, len(prompts), size):
        chunk = prompts.token_ids[start : start + size]
        key, sub = jax.random.split(key)
        out = generate(
            cfg,
            params,
            chunk + [chunk[0]] * (size - len(chunk)),
            sub,
            sampling=sampling,
            spec=spec,
            sharding=sharding,
            prompt_width=longest,
        )
        texts += decode_responses(tok, to_host(out.tokens), to_host(out.lengths))[: len(chunk)]
    grades = reward.grade(texts, prompts.records)
    return {
        "eval_accuracy": float(np.mean(grades.scores >= 1.0)),
        "eval_reward_mean": float(np.mean(grades.scores)),
        "eval_reward_failures": grades.failures,
    }
