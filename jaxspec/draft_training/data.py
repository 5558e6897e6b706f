"""Training data for the head: prompts, and the policy's own sampled responses to them.

A batch is B prompts and the policy's responses from `jaxspec.rollout.generate`, laid out as
fixed-width rows prompt || response || padding of width max_prompt_len + max_new_tokens, so the
training step compiles once. Steps are served in groups of `batches_per_call`: one generate call
samples the group's G * B prompts (drawn from a generator seeded by the group number, so a step
number alone fixes its rows and sampling key) and step s takes rows (s % G) * B onwards; with
`generation.slots` the call streams them through that many decode slots.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxspec.draft_training.config import GenerationConfig, PromptData
from jaxspec.models.config import ModelConfig
from jaxspec.models.params import Params
from jaxspec.models.sharding import Sharding
from jaxspec.rollout import Sampling, generate
from jaxspec.tasks.generator import generate_problems
from jaxspec.tasks.loader import load_prompts
from jaxspec.tasks.tokenizer import ChatTokenizer


def prompt_pool(data: PromptData, tok: ChatTokenizer) -> list[list[int]]:
    """Token ids of every usable prompt (chat-formatted, at most data.max_prompt_len tokens)."""
    if data.prompts_file is not None:
        questions = [r["prompt"] for r in load_prompts(data.prompts_file, data.prompt_field, data.answer_field)]
    else:
        problems = generate_problems(data.num_prompts, data.seed, data.levels, data.kinds, tally=data.tally)
        questions = [p["question"] for p in problems]
    pool = [ids for ids in (tok.encode_prompt(q) for q in questions) if len(ids) <= data.max_prompt_len]
    if not pool:
        raise ValueError(f"every prompt is longer than max_prompt_len={data.max_prompt_len} tokens; raise it")
    return pool


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """Right-padded prompt || response rows of width W = max_prompt_len + max_new_tokens.

    tokens: int32 [B, W] (pad id past `lengths`); loss_mask: bool [B, W], on at response tokens
    (the eos included); attn_mask: bool [B, W], on at prompt and response tokens.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    attn_mask: np.ndarray

    @property
    def response_tokens(self) -> int:
        return int(self.loss_mask.sum())


class RolloutBatches:
    """Batches of policy rollouts addressed by step number (deterministic given the seed).
    sharding: the mesh the policy is sharded over; the rollouts' rows are split over its batch axes."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: Params,
        tok: ChatTokenizer,
        pool: list[list[int]],
        generation: GenerationConfig,
        max_prompt_len: int,
        batch_size: int,
        seed: int,
        sharding: Sharding | None = None,
    ):
        self.cfg, self.params, self.tok, self.pool, self.sharding = cfg, params, tok, pool, sharding
        self.sampling = Sampling(
            temperature=generation.temperature,
            top_p=generation.top_p,
            top_k=generation.top_k,
            max_new_tokens=generation.max_new_tokens,
            eos_id=tok.eos_id,
        )
        self.width = max_prompt_len + generation.max_new_tokens
        self.batch_size, self.seed, self.per_call = batch_size, seed, generation.batches_per_call
        self.slots = generation.slots
        self._group: tuple[int, dict[str, np.ndarray]] | None = None  # the last group generated

    def batch(self, step: int) -> RolloutBatch:
        group, index = divmod(step, self.per_call)
        if self._group is None or self._group[0] != group:
            self._group = (group, self._generate(group))
        rows = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return RolloutBatch(**{name: value[rows] for name, value in self._group[1].items()})

    def _generate(self, group: int) -> dict[str, np.ndarray]:
        """Rows of the `per_call` batches of one group: tokens, loss_mask, attn_mask [G * B, W]."""
        num_rows = self.per_call * self.batch_size
        rng = np.random.default_rng([self.seed, group])
        rows = rng.choice(len(self.pool), num_rows, replace=len(self.pool) < num_rows)
        prompts = [self.pool[i] for i in rows]
        key = jax.random.fold_in(jax.random.key(self.seed), group)
        out = generate(
            self.cfg, self.params, prompts, key, sampling=self.sampling, sharding=self.sharding, slots=self.slots
        )
        responses, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
        tokens = np.full((num_rows, self.width), self.tok.pad_id, np.int32)
        loss_mask = np.zeros((num_rows, self.width), bool)
        attn_mask = np.zeros((num_rows, self.width), bool)
        for b, (prompt, n) in enumerate(zip(prompts, lengths)):
            p = len(prompt)
            tokens[b, :p] = prompt
            tokens[b, p : p + n] = responses[b, :n]
            loss_mask[b, p : p + n] = True
            attn_mask[b, : p + n] = True
        return {"tokens": tokens, "loss_mask": loss_mask, "attn_mask": attn_mask}


def count_tokens(batches: list[RolloutBatch], vocab_size: int) -> np.ndarray:
    """int64 [V]: occurrences of each token in the batches' prompts and responses."""
    counts = np.zeros(vocab_size, np.int64)
    for batch in batches:
        np.add.at(counts, batch.tokens[batch.attn_mask], 1)
    return counts
