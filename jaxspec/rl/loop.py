"""One synchronous GRPO step on a run's state (`GRPORun`): rollouts -> rewards -> advantages ->
policy (and draft) updates, validation and checkpoints when due; `jaxspec.rl.driver` runs the steps.

The step's rollouts come from the run's one `RolloutSource` (`jaxspec.rl.rollout_source`), chosen
from rollout.mode by `rollout_source` when the run starts: colocated generates from the trainer's
own weights ("sync" is a no-op in float32 and a cast of the policy and the draft with rollout.dtype
bfloat16; with rollout.gather_weights on a mesh, the policy's cast is also gathered over the batch
axes (data, fsdp), one all-gather per step instead of one per decode step, and freed before the
update); async generates on separate devices from a copy (`jaxspec.rl.async_rollouts`). All
randomness of step s comes from fold_in(key, s), and prompts from the saved data position, so a
resumed run repeats an uninterrupted one exactly. Launched as several processes (see
`jaxspec.distributed`), every process runs the same steps on the same host data over one mesh;
process 0 alone writes files.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.distributed import say, to_host
from jaxspec.models.checkpoint import load_hf, save_hf
from jaxspec.rewards.registry import get_reward
from jaxspec.rl.advantages import group_advantages
from jaxspec.rl.async_rollouts import AsyncRollouts
from jaxspec.rl.batch import TrainingRows, minibatch_indices, pack_rows, row_width, training_rows
from jaxspec.rl.checkpointing import Checkpointer, record_config
from jaxspec.rl.compilation import compile_failed, precompile, precompile_enabled, trainer_programs
from jaxspec.rl.config import GRPOConfig
from jaxspec.rl.data import run_prompts
from jaxspec.rl.evaluate import validation_scores
from jaxspec.rl.loss import finite_tokens, loss_denominator, reference_sampling
from jaxspec.rl.metrics import PhaseTimer, block, device_memory_metrics, mean_update_metrics, rollout_step_metrics
from jaxspec.rl.online_draft import OnlineDraft, OnlineDraftState
from jaxspec.rl.resources import RunInputs, load_draft
from jaxspec.rl.rollout_source import (
    ColocatedRollouts,
    RolloutCast,
    RolloutGenerator,
    RolloutSetup,
    RolloutSource,
)
from jaxspec.rl.routing import disagreement_metrics, experts_to_width, records_experts
from jaxspec.rl.shaping import trained_rollouts, truncated_rollouts
from jaxspec.rl.step import learning_rate, policy_optimizer, score_fn, update_fn
from jaxspec.rollout import Sampling
from jaxspec.run import Batcher
from jaxspec.run.placement import Placement


def rollout_source(setup: RolloutSetup) -> RolloutSource:
    """The run's rollout source for rollout.mode: the one place the mode is read at run time."""
    if setup.rollout.mode == "async":
        return AsyncRollouts(
            setup.generator,
            setup.cast,
            setup.sampler,
            setup.rollout,
            setup.mesh,
            setup.steps,
            setup.placement,
            setup.draft_trains,
        )
    return ColocatedRollouts(setup.generator, setup.cast, setup.sampler, setup.rollout, setup.loss)


class GRPORun:
    """One run: prompts, policy and draft, the compiled trainer functions and the training state.

    `state` is the checkpointed pytree (see `checkpointing`); step / position / updates mirror its
    counters on the host; resumed: whether it was restored from a checkpoint; rollouts: where the
    steps' rollouts come from (`make_rollouts` of the run's `RolloutSetup`: `rollout_source`, or a
    stand-in).
    """

    def __init__(
        self,
        cfg: GRPOConfig,
        run_dir: Path,
        resume: bool,
        inputs: RunInputs,
        make_rollouts: Callable[[RolloutSetup], RolloutSource] = rollout_source,
    ):
        self.cfg, self.run_dir, self.inputs = cfg, run_dir, inputs
        self.tok = inputs.tokenizer
        r_cfg, t_cfg = cfg.rollout, cfg.train
        self.train_set, self.eval_set = run_prompts(cfg, run_dir, self.tok, inputs.model.max_position_embeddings)
        self.reward = get_reward(cfg.reward)

        self.placement = Placement(cfg.mesh)
        self.mcfg, params = load_hf(inputs.policy_dir, "float32", sharding=self.placement.sharding)
        if self.placement.sharding is not None:
            mesh = self.placement.sharding.mesh
            say(
                f"policy, optimizer state and rollouts on the mesh {dict(mesh.shape)} "
                f"(embed sharded as {params['embed'].sharding.spec})"
            )
        run_key, draft_key = jax.random.split(jax.random.PRNGKey(t_cfg.seed))
        draft = load_draft(cfg.spec, inputs.draft_dir, self.mcfg, draft_key)
        # the draft's config; its params live in the state alone (an 8B policy's head is 1.6 GB)
        self.draft_cfg = None if draft is None else draft[0]
        self.online = OnlineDraft(dcfg=self.draft_cfg, train=cfg.draft) if cfg.draft.online else None
        state = {
            "params": params,
            "opt_state": policy_optimizer(cfg.optim).init(params),
            "step": jnp.int32(0),
            "position": jnp.int32(0),
            "updates": jnp.int32(0),
            "key": run_key,
        }
        if draft is not None:
            state["draft_params"] = draft[1]
        if self.online is not None:
            state["draft_opt_state"] = OnlineDraftState.init(self.online, draft[1]).opt_state
        del draft
        if cfg.loss.kl_beta > 0:
            state["ref_params"] = jax.tree.map(jnp.copy, params)
        # Committed to the devices like restored checkpoints are, so a resumed run in the same process
        # hits the compilation caches of a fresh one.
        self.state = self.placement.state(state)

        self.sampling = Sampling(
            temperature=r_cfg.temperature,
            top_p=r_cfg.top_p,
            top_k=r_cfg.top_k,
            max_new_tokens=r_cfg.max_new_tokens,
            eos_id=self.tok.eos_id,
            coupled=r_cfg.coupled,
        )
        self.eval_sampling = Sampling(
            temperature=cfg.eval.temperature,
            top_p=r_cfg.top_p,
            top_k=r_cfg.top_k,
            max_new_tokens=cfg.eval.max_new_tokens or r_cfg.max_new_tokens,
            eos_id=self.tok.eos_id,
        )
        # a mixture-of-experts policy's rollouts record their experts for routing replay (R3)
        self.records_experts = records_experts(cfg.loss, self.mcfg)
        self.longest_prompt = max(len(ids) for ids in self.train_set.token_ids)  # one rollout shape for every step
        self.width = row_width(self.longest_prompt, r_cfg.max_new_tokens)
        self.cast = RolloutCast(r_cfg.dtype, r_cfg.gather_weights, self.placement.sharding, cfg.spec, self.draft_cfg)
        generator = RolloutGenerator(
            self.mcfg,
            self.sampling,
            self.train_set,
            self.reward,
            self.tok,
            prompt_width=self.longest_prompt,
            record_experts=self.records_experts,
            rollout=r_cfg,
            loss=cfg.loss,
        )
        self.rollouts = make_rollouts(
            RolloutSetup(
                rollout=r_cfg,
                loss=cfg.loss,
                mesh=cfg.mesh,
                steps=t_cfg.steps,
                generator=generator,
                cast=self.cast,
                sampler=Batcher(len(self.train_set.token_ids), r_cfg.prompts_per_step, cfg.data.seed),
                placement=self.placement,
                draft_trains=self.online is not None,
            )
        )
        self.state.update(self.rollouts.initial_entries(self.state))
        self.checkpointer = Checkpointer(run_dir / "checkpoints", t_cfg.keep_checkpoints)
        restored = self.checkpointer.resume(self.state) if resume else None
        self.resumed = restored is not None
        if restored is not None:
            self.state = restored
            say(f"resumed from step {int(self.state['step'])} (data position {int(self.state['position'])})")
        record_config(cfg, run_dir, int(self.state["step"]) if restored is not None else None)
        self.step, self.position, self.updates = (int(self.state[k]) for k in ("step", "position", "updates"))

        mesh = self.placement.sharding
        self.update = update_fn(
            self.mcfg, self.sampling, cfg.loss, cfg.optim, t_cfg.compute_dtype, t_cfg.remat, self.online, mesh
        )
        # The update of minibatches that do not train the head: all of them without an online head,
        # those it skips with draft.train_every > 1; None when it trains on every minibatch.
        self.policy_update = self.update if self.online is None else None
        if self.online is not None and self.online.skips_updates:
            self.policy_update = update_fn(
                self.mcfg, self.sampling, cfg.loss, cfg.optim, t_cfg.compute_dtype, t_cfg.remat, None, mesh
            )
        self.score = score_fn(
            self.mcfg, self.sampling, t_cfg.compute_dtype, t_cfg.remat, mesh, routing_replay=cfg.loss.routing_replay
        )
        self.ref_score = score_fn(self.mcfg, reference_sampling(self.sampling), t_cfg.compute_dtype, t_cfg.remat, mesh)
        self.precompiling = None
        if precompile_enabled(t_cfg.precompile):
            shortest = min(map(len, self.train_set.token_ids)) + 1  # every rollout emits at least one token
            programs = trainer_programs(
                cfg,
                self.state,
                self.placement,
                self.width,
                shortest,
                score=self.score,
                ref_score=self.ref_score,
                update=self.update,
                policy_update=self.policy_update,
                online=self.online is not None,
                model=self.mcfg if self.records_experts else None,
            )
            self.precompiling = precompile(programs, t_cfg.precompile_threads)
        self.rollouts.start(self.state, self.step, self.position, resumed=self.resumed)
        self.state.update(self.rollouts.checkpoint_entries())

    def rollout_view(self):
        """(policy params as the rollout reads them, this step's Spec or None): the "sync" phase
        (`RolloutCast.view`)."""
        return self.cast.view(self.state)

    def evaluate(self) -> dict:
        """Validation scores of the current policy on the held-out prompts."""
        policy, spec = self.rollout_view()
        key = jax.random.fold_in(jax.random.fold_in(self.state["key"], self.step), 1)
        return validation_scores(
            self.mcfg,
            policy,
            self.tok,
            self.eval_set,
            self.reward,
            self.eval_sampling,
            key,
            self.cfg.eval.batch_size,
            spec=spec,
            sharding=self.cast.rollout_sharding,
        )

    def save(self) -> None:
        self.state.update(
            self.placement.state(
                {"step": np.int32(self.step), "position": np.int32(self.position), "updates": np.int32(self.updates)}
            )
        )
        self.state.update(self.rollouts.checkpoint_entries())
        self.checkpointer.save(self.state)

    def run_step(self) -> dict:
        """One RL step: rollouts, rewards, advantages, updates, then validation / checkpoint when due.
        Returns the step's metrics record."""
        cfg, group = self.cfg, self.cfg.rollout.samples_per_prompt
        start, timer = time.perf_counter(), PhaseTimer()
        out, consumed, rounds = self.rollouts.next_batch(self.state, self.step, self.position, timer)
        self.state.update(self.rollouts.checkpoint_entries())  # keeps no rollout copy alive that no batch needs
        tokens, lengths, rewards = out.tokens, out.lengths, out.rewards
        advantages, informative = group_advantages(rewards, group, cfg.loss.advantage, cfg.loss.advantage_eps)
        rows = training_rows(out.prompts, tokens, lengths, self.tok.pad_id, self.width)
        if out.experts is not None:
            rows = rows.replace(experts=experts_to_width(out.experts, self.width))
        truncated = truncated_rollouts(tokens, lengths, cfg.rollout.max_new_tokens, self.tok.eos_id)
        keep = trained_rollouts(informative, truncated, group, cfg.loss)
        batch = rows.replace(
            advantages=advantages,
            prox_logp=out.logprobs,
            loss_mask=rows.resp_mask & keep[:, None],
            seq_resp_mask=None if self.online is None else rows.seq_resp_mask,
        )

        record = {"step": self.step + 1, "data_position": self.position + consumed, "generation_rounds": rounds}
        if out.rollout_version is not None:
            record.update(staleness=out.staleness, rollout_version=out.rollout_version)
        if cfg.loss.recompute_logprobs or cfg.loss.kl_beta > 0:
            with timer.phase("logprob"):
                batch, measured = self._score(batch)
                record.update(measured)
        if not cfg.loss.routing_replay:
            batch = batch.replace(experts=None)  # measured; the update routes by itself
        finite = finite_tokens(batch.loss_mask, batch.prox_logp, batch.ref_logp, batch.behaviour_logp)
        denominator = loss_denominator(finite, cfg.loss.aggregation, cfg.loss.minibatches)
        batch = batch.replace(loss_denominator=np.full(len(advantages), denominator, np.float32))
        with timer.phase("train"):
            update_metrics = self._optimize(batch)
        if self.precompiling is not None:
            with timer.phase("precompile"):  # the device is idle: programs that failed in the background compile here
                compile_failed(self.precompiling.result())
            self.precompiling = None
        self.step += 1
        self.position += consumed
        record.update(self.rollouts.update_weights(self.state, self.step, timer))
        record.update(
            rollout_step_metrics(out.scores, informative, lengths, truncated, out.stats, group),
            reward_failures=out.reward_failures,
        )
        if cfg.loss.overlong_buffer:
            record["shaped_reward_mean"] = float(rewards.mean())
        record.update(
            updates=self.updates,
            lr=float(learning_rate(cfg.optim)(max(self.updates - 1, 0))),
            **mean_update_metrics(update_metrics),
        )
        if self.eval_set is not None and (self.step % cfg.eval.every == 0 or self.step == cfg.train.steps):
            with timer.phase("eval"):
                record.update(self.evaluate())
        if self.step % cfg.train.checkpoint_every == 0 or self.step == cfg.train.steps:
            with timer.phase("checkpoint"):
                self.save()
        record.update(
            timer.record(),
            time_step_s=round(time.perf_counter() - start, 6),
            tokens_per_s=round(out.generated_tokens / max(timer.seconds["generation"], 1e-9), 3),
            **device_memory_metrics(),
        )
        return record

    def _score(self, batch: TrainingRows) -> tuple[TrainingRows, dict]:
        """The batch with the proximal log-probs recomputed by the trainer (the rollout's kept as
        the behaviour policy's, unless loss.tis_cap 0 drops them) and the reference log-probs, as
        configured; and the measured rollout/trainer mismatch (with recorded experts, also the
        trainer's disagreement with them, `jaxspec.rl.routing`)."""
        rows = self.placement.rows(pack_rows(batch.response_rows(), self.placement.row_shards))
        args = (rows.tokens, rows.segment_ids, rows.resp_index, rows.resp_tokens)
        measured = {}
        if self.cfg.loss.recompute_logprobs:
            if rows.experts is None:
                recomputed = to_host(block(self.score(self.state["params"], *args)))
            else:
                recomputed, differing = map(to_host, block(self.score(self.state["params"], *args, rows.experts)))
                measured.update(disagreement_metrics(differing, batch.resp_mask, len(self.mcfg.sparse_layers)))
            compared = finite_tokens(batch.resp_mask, recomputed, batch.prox_logp)
            diff = np.abs(recomputed - batch.prox_logp)[compared]
            measured.update(
                logprob_mismatch_max=float(diff.max(initial=0.0)),
                logprob_mismatch_mean=float(diff.mean()) if diff.size else 0.0,
            )
            batch = batch.replace(
                prox_logp=recomputed, behaviour_logp=batch.prox_logp if self.cfg.loss.weighs_behaviour else None
            )
        if self.cfg.loss.kl_beta > 0:
            batch = batch.replace(ref_logp=to_host(block(self.ref_score(self.state["ref_params"], *args))))
        return batch, measured

    def _optimize(self, batch: TrainingRows) -> list[dict]:
        """ppo_epochs passes of minibatch updates over the batch; per-update metrics (host)."""
        if self.online is None and not batch.loss_mask.any():
            return []  # every group filtered out and no draft to train
        cfg, state = self.cfg, self.state
        head = OnlineDraftState.from_checkpoint(state) if self.online is not None else None
        metrics, in_flight = [], None  # the last update's metrics, fetched once the next one is dispatched
        num_rows = batch.tokens.shape[0]
        for epoch in range(cfg.loss.ppo_epochs):
            rng = np.random.default_rng([cfg.train.seed, self.step, epoch])
            for i, rows in enumerate(minibatch_indices(num_rows, cfg.loss.minibatches, rng)):
                minibatch = batch.take(rows)
                trains_draft = self.online is not None and self.online.trains_on(epoch * cfg.loss.minibatches + i)
                has_tokens = bool(minibatch.loss_mask.any())
                if not trains_draft:
                    if not has_tokens:
                        continue
                    minibatch = minibatch.replace(seq_resp_mask=None)
                update = self.update if trains_draft else self.policy_update
                packed = self.placement.rows(pack_rows(minibatch, self.placement.row_shards))
                # The host packs this minibatch while the device runs the last update, and dispatches
                # it only when that update is done: one update's gradients (as large as the policy's
                # float32 params) live at a time.
                if in_flight is not None:
                    metrics.append(jax.tree.map(to_host, block((state["params"], in_flight))[1]))
                weights, buffers, d_opt = head.update_args() if trains_draft else (None, None, None)
                before = (state["params"], state["opt_state"], weights, d_opt)
                *after, m = update(
                    state["params"], state["opt_state"], weights, buffers, d_opt, packed, policy_steps=has_tokens
                )
                state["params"], state["opt_state"], weights, d_opt = self.placement.pin(tuple(after), before)
                del after  # a leaf that pin moved: the copy alone lives on
                if trains_draft:
                    head = head.with_update(weights, d_opt)
                in_flight = m
        if in_flight is not None:
            metrics.append(jax.tree.map(to_host, in_flight))
        self.updates += sum(int(m["tokens"] > 0) for m in metrics)
        if head is not None:
            state.update(head.checkpoint_entries())
        block(state["params"])
        return metrics

    def export(self) -> None:
        """Writes the trained policy (and the adapted head) into the run directory."""
        save_hf(self.mcfg, self.state["params"], self.run_dir / "policy", tokenizer_file=self.inputs.tokenizer_file)
        say(f"trained policy written to {self.run_dir / 'policy'}")
        if self.online is not None:
            from jaxspec.draft import save_eagle3

            save_eagle3(self.draft_cfg, self.state["draft_params"], self.run_dir / "draft")
            say(f"adapted EAGLE-3 draft written to {self.run_dir / 'draft'}")
