"""One synchronous GRPO step on a run's state (`GRPORun`): rollouts -> rewards -> advantages ->
policy (and draft) updates, validation and checkpoints when due; `jaxspec.rl.driver` runs the steps.

The policy that generates and the policy that trains are the same arrays: "sync" is a no-op in
float32 and a cast of the policy and the draft with rollout.dtype bfloat16 (rollout.mode async
generates on separate devices from a copy instead: `jaxspec.rl.async_rollouts`); with
rollout.gather_weights on a mesh, the policy's cast is also gathered over the batch axes (data,
fsdp), one all-gather per step instead of one per decode step, and freed before the update. All
randomness of step s comes from fold_in(key, s), and prompts from the saved data position, so a
resumed run repeats an uninterrupted one exactly. Launched as several processes (see
`jaxspec.distributed`), every process runs the same steps on the same host data over one mesh;
process 0 alone writes files.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.distributed import barrier, is_main, say, to_host
from jaxspec.models.checkpoint import load_hf, save_hf
from jaxspec.placement import Placement, cast_floats, rollout_policy
from jaxspec.rewards.registry import get_reward
from jaxspec.rl.advantages import group_advantages
from jaxspec.rl.async_rollouts import AsyncRollouts
from jaxspec.rl.batch import Rollouts, TrainingRows, minibatch_indices, pack_rows, row_width, training_rows
from jaxspec.rl.checkpointing import Checkpointer, record_config
from jaxspec.rl.compilation import compile_failed, precompile, precompile_enabled, trainer_programs
from jaxspec.rl.config import GRPOConfig
from jaxspec.rl.data import PromptSet, check_prompt_lengths, load_prompt_set, prompt_files
from jaxspec.rl.evaluate import decode_responses, validation_scores
from jaxspec.rl.loss import finite_tokens, loss_denominator, reference_sampling
from jaxspec.rl.metrics import StageTimer, block, device_memory_metrics, mean_update_metrics, rollout_step_metrics
from jaxspec.rl.online_draft import OnlineDraft, OnlineDraftState
from jaxspec.rl.resources import RunInputs, load_draft, make_spec
from jaxspec.rl.routing import disagreement_metrics, experts_to_width, records_experts
from jaxspec.rl.shaping import overlong_penalty, select_groups, trained_rollouts, truncated_rollouts
from jaxspec.rl.step import learning_rate, policy_optimizer, score_fn, update_fn
from jaxspec.rollout import Sampling, generate
from jaxspec.rollout.speculative.stats import merge_stats
from jaxspec.run import Batcher, truncate_metrics


class GRPORun:
    """One run: prompts, policy and draft, the compiled trainer functions and the training state.

    `state` is the checkpointed pytree (see `checkpointing`); step / position / updates mirror its
    counters on the host; history holds the metrics records of the steps done before this start
    (process 0; empty elsewhere).
    """

    def __init__(self, cfg: GRPOConfig, run_dir: Path, resume: bool, inputs: RunInputs):
        self.cfg, self.run_dir, self.inputs = cfg, run_dir, inputs
        self.tok = inputs.tokenizer
        r_cfg, t_cfg = cfg.rollout, cfg.train
        self.train_set, self.eval_set = self._load_prompts()
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
        self.async_rollouts = AsyncRollouts(self) if r_cfg.mode == "async" else None  # the rollout mesh
        if self.async_rollouts is not None:
            self.state.update(self.async_rollouts.template())
        self.checkpointer = Checkpointer(run_dir / "checkpoints", t_cfg.keep_checkpoints)
        restored = self.checkpointer.resume(self.state) if resume else None
        if restored is not None:
            self.state = restored
            say(f"resumed from step {int(self.state['step'])} (data position {int(self.state['position'])})")
        record_config(cfg, run_dir, int(self.state["step"]) if restored is not None else None)
        # the records up to the restored step (metrics.jsonl, process 0): records after it are dropped, and
        # a fresh start drops all (an attempt that never reached a checkpoint, its step-0 validation included)
        self.history = (
            truncate_metrics(run_dir / "metrics.jsonl", int(self.state["step"]) if restored is not None else -1)
            if is_main()
            else []
        )
        self.step, self.position, self.updates = (int(self.state[k]) for k in ("step", "position", "updates"))

        self.sampling = Sampling(
            temperature=r_cfg.temperature,
            top_p=r_cfg.top_p,
            top_k=r_cfg.top_k,
            max_new_tokens=r_cfg.max_new_tokens,
            eos_id=self.tok.eos_id,
        )
        self.eval_sampling = Sampling(
            temperature=cfg.eval.temperature,
            top_p=r_cfg.top_p,
            top_k=r_cfg.top_k,
            max_new_tokens=cfg.eval.max_new_tokens or r_cfg.max_new_tokens,
            eos_id=self.tok.eos_id,
        )
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
        # a mixture-of-experts policy's rollouts record their experts for routing replay (R3)
        self.records_experts = records_experts(cfg.loss, self.mcfg)
        self.score = score_fn(
            self.mcfg, self.sampling, t_cfg.compute_dtype, t_cfg.remat, mesh, routing_replay=cfg.loss.routing_replay
        )
        self.ref_score = score_fn(self.mcfg, reference_sampling(self.sampling), t_cfg.compute_dtype, t_cfg.remat, mesh)
        self.sampler = Batcher(len(self.train_set.token_ids), r_cfg.prompts_per_step, cfg.data.seed)  # prompt ids
        self.longest_prompt = max(len(ids) for ids in self.train_set.token_ids)  # one rollout shape for every step
        self.width = row_width(self.longest_prompt, r_cfg.max_new_tokens)
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
        if self.async_rollouts is not None:
            self.async_rollouts.start(self.state, resumed=restored is not None)

    def _load_prompts(self) -> tuple[PromptSet, PromptSet | None]:
        cfg, max_positions = self.cfg, self.inputs.model.max_position_embeddings
        if is_main():  # generates the prompt files once; the other processes read them
            prompt_files(cfg.data, self.run_dir)
        barrier("prompt files")
        train_file, eval_file = prompt_files(cfg.data, self.run_dir)
        train_set = load_prompt_set(train_file, cfg.data, self.tok)
        check_prompt_lengths(train_set, train_file, cfg.rollout.max_new_tokens, max_positions)
        if eval_file is None or not cfg.eval.every:
            return train_set, None
        eval_set = load_prompt_set(eval_file, cfg.data, self.tok)
        check_prompt_lengths(eval_set, eval_file, cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens, max_positions)
        return train_set, eval_set

    def rollout_weights(self, gather: bool | None = None):
        """(policy params, draft params or None) as the rollout reads them: the draft's float
        weights are cast to rollout.dtype with the policy's (its integer and boolean vocabulary
        maps stay as they are). gather (None: rollout.gather_weights): on a mesh, the policy copy
        is gathered over the batch axes in the cast's program (`gathered_param_shardings`: whole
        on every device, or its tensor slice), so that the decode steps read local weights; the
        check that it fits the device's free memory names rollout.gather_weights."""
        dtype = jnp.dtype(self.cfg.rollout.dtype)
        gather = self.cfg.rollout.gather_weights if gather is None else gather
        draft = None if self.draft_cfg is None else cast_floats(self.state["draft_params"], dtype)
        return rollout_policy(self.state["params"], dtype, self.placement.sharding, gather), draft

    def rollout_view(self):
        """(policy params as the rollout reads them, this step's Spec or None): the "sync" stage."""
        policy, draft = block(self.rollout_weights())
        return policy, make_spec(self.cfg.spec, None if draft is None else (self.draft_cfg, draft))

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
            sharding=self.placement.sharding,
        )

    def save(self) -> None:
        self.state.update(
            self.placement.state(
                {"step": np.int32(self.step), "position": np.int32(self.position), "updates": np.int32(self.updates)}
            )
        )
        if self.async_rollouts is not None:
            self.state.update(self.async_rollouts.checkpoint_entries())
        self.checkpointer.save(self.state)

    def _rollouts(self, ids: np.ndarray, policy, spec, key, timer: StageTimer, sharding) -> Rollouts:
        """samples_per_prompt rollouts of each prompt id and their rewards (B = len(ids) * group).
        sharding: the mesh that generates (where `policy` lives)."""
        cfg, group = self.cfg, self.cfg.rollout.samples_per_prompt
        prompts = [self.train_set.token_ids[i] for i in ids for _ in range(group)]
        records = [self.train_set.records[i] for i in ids for _ in range(group)]
        with timer.stage("generation"):
            tokens, lengths, logprobs, experts, stats = self._generate_rows(prompts, policy, spec, key, sharding)
        with timer.stage("reward"):
            grades = self.reward.grade(decode_responses(self.tok, tokens, lengths), records)
        scores = grades.scores
        rewards = scores + overlong_penalty(
            lengths, cfg.rollout.max_new_tokens, cfg.loss.overlong_buffer, cfg.loss.overlong_penalty
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

    def _generate_rows(self, prompts: list, policy, spec, key, sharding) -> tuple:
        """(tokens int32 [B, N], lengths [B], logprobs float32 [B, N], the recorded experts [B, P + N,
        L_sparse, k] or None (`RolloutOutput.experts`), stats) on the host for the prompts,
        rollout.sub_batch rows per `generate` call (all at once when null)."""
        size = self.cfg.rollout.sub_batch or len(prompts)
        parts = []
        for i, start in enumerate(range(0, len(prompts), size)):
            sub_key = key if size == len(prompts) else jax.random.fold_in(key, i)
            out = block(
                generate(
                    self.mcfg,
                    policy,
                    prompts[start : start + size],
                    sub_key,
                    sampling=self.sampling,
                    spec=spec,
                    sharding=sharding,
                    prompt_width=self.longest_prompt,
                    record_experts=self.records_experts,
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
        experts = np.concatenate([p[3] for p in parts]) if self.records_experts else None
        return tokens, lengths, logprobs, experts, merge_stats([p[4] for p in parts])

    def _generate(self, timer: StageTimer) -> tuple[Rollouts, int, int]:
        """This step's rollouts (see `_rollouts`) for prompts_per_step prompts; with
        loss.filter_groups_max_rounds > 1 (DAPO dynamic sampling) further batches of prompts are
        generated until prompts_per_step informative groups are found or the rounds run out, and
        prompts_per_step groups are kept (`select_groups`). Returns (rollouts, prompts consumed,
        generation rounds); the statistics are those of the first round, generated_tokens counts
        every round's."""
        cfg, group = self.cfg, self.cfg.rollout.samples_per_prompt
        with timer.stage("sync"):
            policy, spec = self.rollout_view()
        key = jax.random.fold_in(jax.random.fold_in(self.state["key"], self.step), 0)
        ids = self.sampler.indices(self.position)
        rounds = [self._rollouts(ids, policy, spec, key, timer, self.placement.sharding)]
        consumed = len(ids)

        def informative():
            rewards = np.concatenate([r.rewards for r in rounds])
            return group_advantages(rewards, group, cfg.loss.advantage, cfg.loss.advantage_eps)[1]

        while len(rounds) < cfg.loss.filter_groups_max_rounds and informative().sum() < cfg.rollout.prompts_per_step:
            ids = self.sampler.indices(self.position + consumed)
            rounds.append(
                self._rollouts(ids, policy, spec, jax.random.fold_in(key, len(rounds)), timer, self.placement.sharding)
            )
            consumed += len(ids)
        del policy
        if len(rounds) == 1:
            return rounds[0], consumed, 1
        groups = select_groups(informative(), cfg.rollout.prompts_per_step)
        rows = (groups[:, None] * group + np.arange(group)).reshape(-1)
        return Rollouts.concatenate(rounds).take(rows), consumed, len(rounds)

    def run_step(self) -> dict:
        """One RL step: rollouts, rewards, advantages, updates, then validation / checkpoint when due.
        Returns the step's metrics record."""
        cfg, group = self.cfg, self.cfg.rollout.samples_per_prompt
        start, timer = time.perf_counter(), StageTimer()
        if self.async_rollouts is None:
            out, consumed, rounds = self._generate(timer)
        else:
            out, consumed, rounds = self.async_rollouts.next_batch(timer)
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
            with timer.stage("logprob"):
                batch, measured = self._score(batch)
                record.update(measured)
        if not cfg.loss.routing_replay:
            batch = batch.replace(experts=None)  # measured; the update routes by itself
        finite = finite_tokens(batch.loss_mask, batch.prox_logp, batch.ref_logp, batch.behaviour_logp)
        denominator = loss_denominator(finite, cfg.loss.aggregation, cfg.loss.minibatches)
        batch = batch.replace(loss_denominator=np.full(len(advantages), denominator, np.float32))
        with timer.stage("train"):
            update_metrics = self._optimize(batch)
        if self.precompiling is not None:
            with timer.stage("precompile"):  # the device is idle: programs that failed in the background compile here
                compile_failed(self.precompiling.result())
            self.precompiling = None
        self.step += 1
        self.position += consumed
        if self.async_rollouts is not None:
            with timer.stage("sync"):
                record["sync_bytes"] = self.async_rollouts.sync()
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
            with timer.stage("eval"):
                record.update(self.evaluate())
        if self.step % cfg.train.checkpoint_every == 0 or self.step == cfg.train.steps:
            with timer.stage("checkpoint"):
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
