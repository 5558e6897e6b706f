"""A GRPO step's metrics: what its record holds, phase timers, rollout statistics (the records are
written by `jaxspec.run.MetricsLog`, with their time_unix_s, and optionally mirrored to TensorBoard).

A step record (metrics.jsonl) holds
  rollouts: reward_mean/std, accuracy (responses with reward >= 1), reward_failures (responses whose
    grading raised, overran its limit or returned a non-finite value: scored 0), groups_all_correct,
    groups_zero_variance, response_length_mean/max, truncated_frac (no eos within the budget),
    acceptance_length, acceptance_rate_per_position, decode_steps, decode_steps_per_stage,
    drafted/accepted_tokens, decode_steps_per_depth and fallback_steps (loop iterations that drafted
    0, 1, ... levels, and those of depth 0: spec.adaptive's autoregressive fallback);
  trainer: loss, pg_loss, kl, clip_low_frac, clip_high_frac, dual_clip_frac (negative-advantage
    tokens held by loss.clip_ratio_c), ratio_mean (current / proximal policy), behaviour_weight_mean /
    _max / _capped_frac (the decoupled objective's pi_prox / pi_behaviour after loss.tis_cap, its
    largest value over the step's updates and the fraction of tokens the cap truncated; 1, 1, 0
    without loss.recompute_logprobs), nonfinite_tokens
    (loss tokens dropped for a non-finite current, old, rollout or reference log-prob, per update),
    entropy, grad_norm, router_aux_loss (mixture-of-experts policies: the router's load-balancing
    loss, weighted into loss by loss.router_aux_coef), lr, updates, logprob_mismatch_max/mean
    (loss.recompute_logprobs); expert_disagreement and expert_disagreement_tokens (a
    mixture-of-experts policy with loss.recompute_logprobs: the fraction of (response token, sparse
    layer) pairs, and of response tokens, whose top-k experts in the log-prob pass differ from the
    rollout's, with or without loss.routing_replay; `jaxspec.rl.routing`);
    generation_rounds (loss.filter_groups_max_rounds), shaped_reward_mean (the rewards with
    loss.overlong_buffer's penalty; reward_mean and accuracy are the reward function's);
    draft_loss, draft_grad_norm, draft_step_loss, draft_top1_agreement (draft.online);
    rollout.mode async: staleness (steps between the weights that generated the batch and those it
    trains), rollout_version (the former's step), sync_bytes (copied onto the rollout mesh per step);
  validation: eval_accuracy, eval_reward_mean, eval_reward_failures (when due);
  wall clock: time_<phase>_s for sync, generation, reward, logprob, train (the policy update and,
    with draft.online, the draft update that shares its forward), precompile (step 1 with
    train.precompile: waiting for the trainer's background compilation, and compiling any that
    failed there), eval, checkpoint; time_step_s;
    in async mode generation and reward are the consumed batch's seconds in the rollout worker
    (overlapping the trainer), rollout_wait the trainer's wait for it and sync the weight copy;
    tokens_per_s (generated tokens per second of generation); time_unix_s (when the record was
    written, seconds since the epoch: lines up runs that share a host); compiles and time_compile_s (XLA
    compilations during the step and their seconds, included in the phases' times: a new shape,
    e.g. a new packed row count, compiles once); compiles_cached (programs read from the persistent
    compilation cache instead, their seconds also in time_compile_s).
  device memory (GPUs; absent where devices report no statistics, e.g. the CPU), in GB of the most
    loaded local device: memory_peak_gb (XLA's high-water mark since the process started: the step's
    own peak once it is the largest so far), memory_in_use_gb (held at the end of the step).
Keys starting with "time_", "tokens_per_s", "compiles" and "memory_" depend on the machine and the
process's history; everything else is a deterministic function of the config, the data and the keys.
"""

from __future__ import annotations

import contextlib
import time

import jax
import numpy as np

MACHINE_PREFIXES = ("time_", "tokens_per_s", "compiles", "memory_")
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # one per compilation or persistent-cache read
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # one per persistent-cache read
POLICY_METRICS = (
    "loss",
    "pg_loss",
    "kl",
    "clip_low_frac",
    "clip_high_frac",
    "dual_clip_frac",
    "ratio_mean",
    "behaviour_weight_mean",
    "behaviour_weight_max",
    "behaviour_weight_capped_frac",
    "nonfinite_tokens",
    "entropy",
    "grad_norm",
    "router_aux_loss",
)


def is_machine_dependent(key: str) -> bool:
    """Whether a record's key measures the machine (time, compilations, memory), not the run."""
    return key.startswith(MACHINE_PREFIXES)


class PhaseTimer:
    """Accumulates wall-clock seconds per named phase of a step (block on device results inside a phase), and
    counts the XLA compilations (and persistent-cache reads) that happen until `record`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.compiles, self.cache_hits, self.compile_seconds = 0, 0, 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        jax.monitoring.register_event_listener(self._on_cache_hit)

    def _on_event(self, event: str, duration_secs: float, **kwargs) -> None:
        if event == _COMPILE_EVENT:
            self.compiles += 1
            self.compile_seconds += duration_secs

    def _on_cache_hit(self, event: str, **kwargs) -> None:
        if event == _CACHE_HIT_EVENT:
            self.cache_hits += 1

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def record(self) -> dict[str, float]:
        """{"time_<phase>_s": seconds, "compiles": n, "compiles_cached": n, "time_compile_s": seconds};
        stops counting."""
        jax.monitoring.unregister_event_duration_listener(self._on_event)
        jax.monitoring.unregister_event_listener(self._on_cache_hit)
        return {
            **{f"time_{name}_s": round(value, 6) for name, value in self.seconds.items()},
            "compiles": self.compiles - self.cache_hits,
            "compiles_cached": self.cache_hits,
            "time_compile_s": round(self.compile_seconds, 6),
        }


def device_memory_metrics() -> dict[str, float]:
    """{"memory_peak_gb", "memory_in_use_gb"}: the most loaded local device's XLA statistics, in GB;
    {} where the devices report none (the CPU)."""
    stats = [d.memory_stats() for d in jax.local_devices()]
    if not all(stats):
        return {}
    return {
        "memory_peak_gb": round(max(s.get("peak_bytes_in_use", 0) for s in stats) / 1e9, 3),
        "memory_in_use_gb": round(max(s.get("bytes_in_use", 0) for s in stats) / 1e9, 3),
    }


def block(tree):
    """Waits for every array in `tree` (so a phase's time includes its device work)."""
    return jax.block_until_ready(tree)


def rollout_stats(stats: dict) -> dict:
    """JSON-safe speculative-decoding statistics of a `RolloutOutput.stats` dict.

    acceptance_rate_per_position: a list with null where no step tested that depth.
    decode_steps_per_stage: loop iterations at each of the loop's batch sizes (`stage_rows`).
    drafted_tokens / accepted_tokens, decode_steps_per_depth / fallback_steps: present for
    speculative rollouts.
    """
    out = {
        "acceptance_length": float(stats.get("acceptance_length", 1.0)),
        "decode_steps": int(stats.get("steps", 0)),
        "decode_steps_per_stage": [int(n) for n in stats.get("stage_steps", ())],
    }
    per_position = np.asarray(stats.get("acceptance_rate_per_position", ()), np.float64).reshape(-1)
    out["acceptance_rate_per_position"] = [round(float(x), 6) if np.isfinite(x) else None for x in per_position]
    for key in ("drafted_tokens", "accepted_tokens", "fallback_steps"):
        if key in stats:
            out[key] = int(stats[key])
    if "depth_steps" in stats:
        out["decode_steps_per_depth"] = [int(n) for n in stats["depth_steps"]]
    return out


def mean_update_metrics(updates: list[dict]) -> dict:
    """Host means of the per-update metrics (maxima for keys ending in "_max"); the policy part over
    updates that had policy tokens."""
    out: dict = {}
    active = [m for m in updates if float(m["tokens"]) > 0]
    for key in POLICY_METRICS:
        if active and key in active[0]:  # router_aux_loss: mixture-of-experts policies only
            reduce = np.max if key.endswith("_max") else np.mean
            out[key] = float(reduce([float(m[key]) for m in active]))
    draft = [m for m in updates if "draft_loss" in m]
    if draft:
        out["draft_loss"] = float(np.mean([float(m["draft_loss"]) for m in draft]))
        out["draft_grad_norm"] = float(np.mean([float(m["draft_grad_norm"]) for m in draft]))
        for key in ("draft_step_loss", "draft_top1_agreement"):
            out[key] = np.mean([np.asarray(m[key]) for m in draft], axis=0).round(6).tolist()
    return out


def rollout_step_metrics(
    rewards: np.ndarray, informative: np.ndarray, lengths: np.ndarray, truncated: np.ndarray, stats: dict, group: int
) -> dict:
    """The rollout part of a step record: rewards float [B], informative bool [B / group] (groups
    with unequal rewards), lengths int [B], truncated bool [B], the rollout's `stats`."""
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "accuracy": float(np.mean(rewards >= 1.0)),
        "groups_all_correct": float(np.mean(rewards.reshape(-1, group).min(axis=1) >= 1.0)),
        "groups_zero_variance": float(np.mean(~informative)),
        "response_length_mean": float(lengths.mean()),
        "response_length_max": int(lengths.max()),
        "truncated_frac": float(np.mean(truncated)),
        **rollout_stats(stats),
    }
