"""Where a GRPO step's rollouts come from: one `RolloutSource` per run, chosen once from rollout.mode
(`jaxspec.rl.loop.rollout_source`); the step never asks which one it holds.

colocated (`ColocatedRollouts`): the step's rollouts are generated when the step asks for them, on
    the trainer mesh, from the trainer's current weights as the rollout reads them (`RolloutCast`:
    the "sync" phase); with loss.filter_groups_max_rounds > 1 further rounds of prompts until
    enough groups are informative.
async (`jaxspec.rl.async_rollouts.AsyncRollouts`): generated ahead on the rollout devices from a
    copy of the weights that `update_weights` refreshes after each update.

Both generate and grade through one `RolloutGenerator`. A source reads the run's training state
(the weights and the run's PRNG key) and counters only where the step hands them over, and adds
entries to the checkpointed state only through `initial_entries` / `checkpoint_entries`. All
randomness of step s comes from fold_in(fold_in(key, s), 0) and its prompts from the data
position, so any source repeats an uninterrupted run after a resume.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.distributed import to_host
from jaxspec.models.config import ModelConfig
from jaxspec.models.sharding import Sharding
from jaxspec.rewards.registry import Reward
from jaxspec.rl.advantages import group_advantages
from jaxspec.rl.batch import Rollouts
from jaxspec.rl.config import GRPOLossConfig, RolloutConfig, SpecConfig
from jaxspec.rl.data import PromptSet
from jaxspec.rl.evaluate import decode_responses
from jaxspec.rl.metrics import PhaseTimer, block
from jaxspec.rl.resources import make_spec
from jaxspec.rl.response_history import ResponseHistory
from jaxspec.rl.shaping import overlong_penalty, select_groups
from jaxspec.rollout import Sampling, Spec, generate
from jaxspec.rollout.speculative.stats import merge_stats
from jaxspec.run import Batcher
from jaxspec.run.placement import MeshConfig, Placement, cast_floats, rollout_policy
from jaxspec.tasks.tokenizer import ChatTokenizer


class StepRollouts(NamedTuple):
    """What a step trains on: its rollouts, the prompts they consumed from the data position and
    the generation rounds they took."""

    rollouts: Rollouts
    consumed: int
    rounds: int


class RolloutSource(Protocol):
    """The rollouts of each GRPO step. `state` is the run's training state (float32 weights on the
    trainer mesh, the run's PRNG key); step and position are the steps done and the prompts consumed
    before the step asks."""

    def initial_entries(self, state: dict) -> dict:
        """The entries this source adds to a new run's state, which tell a restore where its
        checkpointed ones go ({} for none)."""
        return {}

    def start(self, state: dict, step: int, position: int, resumed: bool) -> None:
        """Begins from `state` (restored from a checkpoint when `resumed`)."""

    def next_batch(self, state: dict, step: int, position: int, timer: PhaseTimer) -> StepRollouts:
        """The rollouts step `step` + 1 trains on; timer gets the phases they took."""
        ...

    def update_weights(self, state: dict, step: int, timer: PhaseTimer) -> dict:
        """Takes the weights of `state` after the update of step `step`; returns the step record's
        entries about it ({} for none)."""
        return {}

    def checkpoint_entries(self) -> dict:
        """The entries the checkpointed state needs to continue this source's work ({} for none)."""
        return {}

    def close(self) -> None:
        """Stops the source's work in flight."""


@dataclasses.dataclass(frozen=True)
class RolloutCast:
    """The trainer's weights as the rollout reads them: float weights cast to rollout.dtype (the
    draft's integer and boolean vocabulary maps as they are), on the trainer mesh `sharding`.

    dtype: rollout.dtype; gather: rollout.gather_weights (on a mesh, the policy copy is gathered
    over the batch axes in the cast's program, `gathered_param_shardings`, so that the decode steps
    read local weights; the check that it fits the device's free memory names the key); spec: the
    run's speculation settings; draft_cfg: the draft's config (an EAGLE-3 head's or a draft
    model's), None without a draft (its params live in the state alone).
    """

    dtype: str
    gather: bool
    sharding: Sharding | None
    spec: SpecConfig
    draft_cfg: object | None

    @property
    def rollout_sharding(self) -> Sharding | None:
        """The mesh the colocated rollouts run on: `sharding`, saying whether the weights they read
        are gathered (`Sharding.gathered_weights`, what `view` gives with rollout.gather_weights)."""
        if self.sharding is None or not self.gather:
            return self.sharding
        return dataclasses.replace(self.sharding, gathered_weights=True)

    def weights(self, state: dict, gather: bool | None = None) -> tuple:
        """(policy params, draft params or None) of `state`, cast; gather: None is rollout.gather_weights."""
        dtype = jnp.dtype(self.dtype)
        gather = self.gather if gather is None else gather
        draft = None if self.draft_cfg is None else cast_floats(state["draft_params"], dtype)
        return rollout_policy(state["params"], dtype, self.sharding, gather), draft

    def view(self, state: dict) -> tuple:
        """(policy params as the rollout reads them, the Spec of these weights or None), computed."""
        policy, draft = block(self.weights(state))
        return policy, self.spec_of(draft)

    def spec_of(self, draft) -> object | None:
        """The rollout's Spec with the draft params `draft` (None without a draft)."""
        return make_spec(self.spec, None if draft is None else (self.draft_cfg, draft))


class RolloutGenerator:
    """Rollouts of prompts of `prompts` and their rewards: the generation and grading every source
    runs.

    model: the policy's config; sampling: the rollout's; prompt_width: the longest prompt (one
    rollout shape for every step); record_experts: record the experts a mixture-of-experts policy
    routes to (routing replay); rollout / loss: the config sections (samples_per_prompt, sub_batch,
    max_new_tokens; the overlong penalty).
    """

    def __init__(
        self,
        model: ModelConfig,
        sampling: Sampling,
        prompts: PromptSet,
        reward: Reward,
        tokenizer: ChatTokenizer,
        prompt_width: int,
        record_experts: bool,
        rollout: RolloutConfig,
        loss: GRPOLossConfig,
    ):
        self.model, self.sampling, self.prompts, self.reward, self.tok = model, sampling, prompts, reward, tokenizer
        self.prompt_width, self.record_experts, self.rollout, self.loss = prompt_width, record_experts, rollout, loss
        self.history: ResponseHistory | None = None  # made by the first suffix-drafting call

    def rollouts(self, ids: np.ndarray, policy, spec, key: jax.Array, timer, sharding: Sharding | None) -> Rollouts:
        """samples_per_prompt rollouts of each prompt id and their rewards (B = len(ids) * group).
        policy / spec: the weights that generate, on the mesh `sharding`; timer: a `PhaseTimer` (or
        any object with its `phase`), which gets the generation and reward seconds. A suffix
        drafter drafts from each group's other rows and the prompt's earlier responses
        (`ResponseHistory`, spec.suffix_history of them), to which these are added."""
        group = self.rollout.samples_per_prompt
        prompts = [self.prompts.token_ids[i] for i in ids for _ in range(group)]
        records = [self.prompts.records[i] for i in ids for _ in range(group)]
        with timer.phase("generation"):
            tokens, lengths, logprobs, experts, stats = self._generate_rows(ids, prompts, policy, spec, key, sharding)
        with timer.phase("reward"):
            grades = self.reward.grade(decode_responses(self.tok, tokens, lengths), records)
        scores = grades.scores
        rewards = scores + overlong_penalty(
            lengths, self.rollout.max_new_tokens, self.loss.overlong_buffer, self.loss.overlong_penalty
        )
        return Rollouts(
            prompts=prompts,
            records=records,
            tokens=tokens,
            lengths=lengths,
            logprobs=logprobs,
            scores=scores,
            rewards=rewards,
            stats=stats,
            generated_tokens=int(lengths.sum()),
            reward_failures=grades.failures,
            experts=experts,
        )

    def _generate_rows(self, ids: np.ndarray, prompts: list, policy, spec, key, sharding) -> tuple:
        """(tokens int32 [B, N], lengths [B], logprobs float32 [B, N], the recorded experts [B, P + N,
        L_sparse, k] or None (`RolloutOutput.experts`), stats) on the host for the prompts,
        rollout.sub_batch rows per `generate` call (all at once when null)."""
        size = self.rollout.sub_batch or len(prompts)
        group = self.rollout.samples_per_prompt
        parts = []
        for i, start in enumerate(range(0, len(prompts), size)):
            sub_key = key if size == len(prompts) else jax.random.fold_in(key, i)
            out = block(
                generate(
                    self.model,
                    policy,
                    prompts[start : start + size],
                    sub_key,
                    sampling=self.sampling,
                    spec=self._call_spec(spec, ids[start // group : (start + size) // group]),
                    sharding=sharding,
                    prompt_width=self.prompt_width,
                    record_experts=self.record_experts,
                    slots=self.rollout.slots,
                )
            )
            parts.append(
                (
                    to_host(out.tokens),
                    to_host(out.lengths),
                    to_host(out.logprobs).astype(np.float32),
                    None if out.experts is None else to_host(out.experts),
                    out.stats,
                )
            )
        tokens, lengths, logprobs = (np.concatenate([p[j] for p in parts]) for j in range(3))
        experts = np.concatenate([p[3] for p in parts]) if self.record_experts else None
        if self.history is not None:
            self.history.add(ids, tokens, lengths)
        return tokens, lengths, logprobs, experts, merge_stats([p[4] for p in parts])

    def _call_spec(self, spec, ids: np.ndarray):
        """`spec` for one `generate` call of the groups of prompts `ids`: a suffix drafter's groups
        (method suffix, or spec.suffix_branches) are the samples_per_prompt rows of each prompt, and
        it reads their earlier responses."""
        if spec is None or not spec.drafts_suffixes:
            return spec
        if self.history is None:
            self.history = ResponseHistory(spec.suffix_history, self.rollout.max_new_tokens)
        config = dataclasses.replace(spec.config, suffix_group_rows=self.rollout.samples_per_prompt)
        history = self.history.of(ids) if spec.suffix_history else None
        return Spec.from_config(config, history if spec.method == "suffix" else (*spec.draft[:2], history))


@dataclasses.dataclass(frozen=True)
class RolloutSetup:
    """What a run's rollout source is made from (`jaxspec.rl.loop.rollout_source` picks it).

    rollout, loss, mesh: the run's config sections; steps: train.steps; generator: the generation
    and grading; cast: the trainer's weights as the rollout reads them; sampler: the prompt ids of a
    data position; placement: the trainer mesh; draft_trains: whether the draft's weights change
    during the run (draft.online).
    """

    rollout: RolloutConfig
    loss: GRPOLossConfig
    mesh: MeshConfig
    steps: int
    generator: RolloutGenerator
    cast: RolloutCast
    sampler: Batcher
    placement: Placement
    draft_trains: bool


class ColocatedRollouts(RolloutSource):
    """rollout.mode colocated: each step's rollouts generated when it asks, on the trainer mesh,
    from its current weights (see the module doc)."""

    def __init__(
        self,
        generator: RolloutGenerator,
        cast: RolloutCast,
        sampler: Batcher,
        rollout: RolloutConfig,
        loss: GRPOLossConfig,
    ):
        self.generator, self.cast, self.sampler, self.rollout, self.loss = generator, cast, sampler, rollout, loss

    def next_batch(self, state: dict, step: int, position: int, timer: PhaseTimer) -> StepRollouts:
        """prompts_per_step prompts' rollouts; with loss.filter_groups_max_rounds > 1 (DAPO dynamic
        sampling) further batches of prompts are generated until prompts_per_step informative
        groups are found or the rounds run out, and prompts_per_step groups are kept
        (`select_groups`). The statistics are those of the first round, generated_tokens counts
        every round's."""
        group, wanted = self.rollout.samples_per_prompt, self.rollout.prompts_per_step
        with timer.phase("sync"):
            policy, spec = self.cast.view(state)
        key = jax.random.fold_in(jax.random.fold_in(state["key"], step), 0)
        ids = self.sampler.indices(position)
        rounds = [self.generator.rollouts(ids, policy, spec, key, timer, self.cast.rollout_sharding)]
        consumed = len(ids)

        def informative():
            rewards = np.concatenate([r.rewards for r in rounds])
            return group_advantages(rewards, group, self.loss.advantage, self.loss.advantage_eps)[1]

        while len(rounds) < self.loss.filter_groups_max_rounds and informative().sum() < wanted:
            ids = self.sampler.indices(position + consumed)
            round_key = jax.random.fold_in(key, len(rounds))
            rounds.append(self.generator.rollouts(ids, policy, spec, round_key, timer, self.cast.rollout_sharding))
            consumed += len(ids)
        del policy
        if len(rounds) == 1:
            return StepRollouts(rounds[0], consumed, 1)
        groups = select_groups(informative(), wanted)
        rows = (groups[:, None] * group + np.arange(group)).reshape(-1)
        return StepRollouts(Rollouts.concatenate(rounds).take(rows), consumed, len(rounds))
