"""Asynchronous GRPO (rollout.mode async): rollouts on their own devices, overlapping the update.

The last mesh.rollout_devices devices form the rollout mesh (data = N: the rollout copy of the
policy and of the draft replicated on each, the rollout rows and KV caches split over them); the
trainer mesh (`jaxspec.placement.Placement`) is built from the devices before them. After each
update, `sync` casts the trainer's float32 weights to rollout.dtype on the trainer mesh and copies
them onto the rollout mesh with `jax.device_put` (device to device, no host round trip): that copy
is the weights "version" of the step (version s = the weights after s steps).

One worker thread runs the rollouts (generation on the rollout mesh, then decoding and rewards on
the host; `generate` reads lengths back while it runs, so generating on the main thread would
hold the host until it ends). Before step s+1 trains, the batches of steps up to s+1+max_staleness
are queued with the rollout copy of the time, version s, then the loop waits for the batch of step
s+1 (time_rollout_wait_s) and trains on it while the worker generates the next one:

    max_staleness 1: step s+1 trains on rollouts of version s-1 (version 0 for steps 1 and 2),
        while the worker generates step s+2's with version s: generation and reward of one batch
        overlap the update, scoring and sync of the previous one;
    max_staleness 0: step s+1's rollouts are generated with version s once the sync is done:
        nothing overlaps, and the run repeats the colocated one on the rollout devices.

A batch's prompts and PRNG key are those of the step that consumes it (as in colocated mode), so
the rollouts depend on the step and the weights version alone. The importance ratio of the loss
uses the rollout's own log-probs of the sampled tokens as the behaviour log-probs (exact under
speculation); the records log `staleness` (trained version - the batch's version) next to the
ratio statistics (ratio_mean, clip_low_frac, clip_high_frac, dual_clip_frac).

Checkpoints hold, next to the training state, the rollout copy that the batch in flight was
generated with ("rollout", "rollout_version"); a resumed run regenerates that batch from it and
continues the uninterrupted run's metrics. Validation runs on the trainer mesh, as in colocated
mode.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp

from jaxspec.models.sharding import Sharding, make_mesh, param_shardings
from jaxspec.rl.batch import Rollouts
from jaxspec.rl.metrics import StageTimer, block
from jaxspec.rl.resources import make_spec


@dataclasses.dataclass(frozen=True)
class RolloutWeights:
    """A copy of the policy (and of the draft's params, or None) on the rollout mesh, in
    rollout.dtype, and the weights version it copies (RL steps done when it was synced)."""

    policy: dict
    draft: dict | None
    version: int


@dataclasses.dataclass
class _Batch:
    step: int  # the RL step (1-based) that trains on it
    weights: RolloutWeights
    result: Future  # (Rollouts, {stage: seconds})


class _StageSeconds:
    """Seconds per stage of one batch in the worker thread (`StageTimer.stage` without the
    compilation counters, which the main thread's timer counts for the whole process)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def rollout_mesh(devices: int) -> Sharding:
    """The rollout mesh: data = the last `devices` devices (weights replicated, rows split)."""
    chosen = jax.devices()[-devices:]
    return Sharding(make_mesh(len(chosen), 1, 1, devices=chosen))


class AsyncRollouts:
    """The rollout mesh, its weights copy and the queue of batches in flight of one `GRPORun`."""

    def __init__(self, run):
        self.run = run
        self.sharding = rollout_mesh(run.cfg.mesh.rollout_devices)
        self.max_staleness = run.cfg.rollout.max_staleness
        self.in_flight: collections.deque[_Batch] = collections.deque()
        self.weights: RolloutWeights | None = None
        self.next_weights: RolloutWeights | None = None  # what the batch after the queued ones will use
        self.next_step = 0
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts")

    def copy(self, version: int) -> RolloutWeights:
        """The run's current weights, cast to rollout.dtype, copied onto the rollout mesh."""
        policy, draft = self.run.rollout_weights()
        policy = jax.device_put(policy, param_shardings(self.sharding, policy))
        if self.weights is not None and self.run.online is None:
            draft = self.weights.draft  # a frozen draft is copied once
        elif draft is not None:
            draft = jax.device_put(draft, self.sharding.replicated())
        return RolloutWeights(*block((policy, draft)), version)

    def template(self) -> dict:
        """The checkpoint entries of a fresh run (`checkpoint_entries` of version 0), which tell a
        resume where to restore them: onto the rollout mesh."""
        self.weights = self.copy(0)
        return self.checkpoint_entries()

    def checkpoint_entries(self) -> dict:
        """The state entries that let a resumed run regenerate the batch in flight: the weights
        copy it was generated with, or (none in flight: the run's last step) the copy the next
        batch would have been generated with, so that a run extended by --resume with more
        train.steps continues as if it had been longer from the start."""
        weights = self.in_flight[0].weights if self.in_flight else self.next_weights or self.weights
        return {"rollout": {"policy": weights.policy, **({} if weights.draft is None else {"draft": weights.draft})},
                "rollout_version": jnp.int32(weights.version)}

    def start(self, state: dict, resumed: bool) -> None:
        """Copies the trainer's weights onto the rollout mesh; after a resume with max_staleness
        >= 1, queues the batch that was in flight at the checkpoint with the weights it used."""
        step = self.run.step
        self.weights = self.copy(step)
        self.next_step = step + 1
        if resumed and step > 0 and self.max_staleness > 0:
            saved = state["rollout"]
            self._submit(RolloutWeights(saved["policy"], saved.get("draft"), int(state["rollout_version"])))
        state.update(self.checkpoint_entries())  # no longer holds the template's or a restored copy

    def sync(self) -> int:
        """Copies the update's weights onto the rollout mesh (once the run's step counter advanced);
        returns the bytes copied (the policy's, and the draft's when it trains online)."""
        self.weights = self.copy(self.run.step)
        return sum(x.nbytes for x in jax.tree.leaves((self.weights.policy,
                                                      self.weights.draft if self.run.online else None)))

    def _submit(self, weights: RolloutWeights) -> None:
        run, step = self.run, self.next_step
        ids = run.sampler.indices(run.position + (step - run.step - 1) * run.cfg.rollout.prompts_per_step)
        key = jax.random.fold_in(jax.random.fold_in(run.state["key"], step - 1), 0)  # as `GRPORun._generate`'s
        key = jax.device_put(key, self.sharding.replicated())
        draft = None if run.draft is None else (run.draft[0], weights.draft)
        spec = make_spec(run.cfg.spec, draft)

        def work():
            seconds = _StageSeconds()
            out = run._rollouts(ids, weights.policy, spec, key, seconds, sharding=self.sharding)
            return out, seconds.seconds

        self.in_flight.append(_Batch(step, weights, self._worker.submit(work)))
        self.next_step += 1

    def next_batch(self, timer: StageTimer) -> tuple[Rollouts, int, int]:
        """The rollouts of the step the run is about to train (as `GRPORun._generate` returns them,
        with their staleness and rollout_version), once the batches up to max_staleness steps
        ahead are queued. timer gets the batch's generation and reward seconds (measured in the
        worker, overlapped with the trainer) and rollout_wait (the trainer waiting for it)."""
        # No batch past train.steps: the run would wait for it at the end.
        last = min(self.run.step + 1 + self.max_staleness, self.run.cfg.train.steps)
        while self.next_step <= last:
            self._submit(self.weights)
        self.next_weights = self.weights if self.max_staleness else None
        batch = self.in_flight.popleft()
        assert batch.step == self.run.step + 1, (batch.step, self.run.step)
        self.run.state.update(self.checkpoint_entries())  # keeps no copy alive that no batch needs
        with timer.stage("rollout_wait"):
            out, seconds = batch.result.result()
        for name, value in seconds.items():
            timer.seconds[name] = timer.seconds.get(name, 0.0) + value
        out = dataclasses.replace(out, staleness=self.run.step - batch.weights.version,
                                  rollout_version=batch.weights.version)
        return out, self.run.cfg.rollout.prompts_per_step, 1

    def close(self) -> None:
        """Drops the batches not started and waits for the one generating."""
        self._worker.shutdown(wait=True, cancel_futures=True)
