"""Asynchronous GRPO (rollout.mode async): rollouts on their own devices, overlapping the update.

The last mesh.rollout_devices devices form the rollout mesh (data = N: the rollout copy of the
policy and of the draft replicated on each, the rollout rows and KV caches split over them); the
trainer mesh (`jaxspec.run.placement.Placement`) is built from the devices before them. After each
update, `sync` casts the trainer's float32 weights to rollout.dtype on the trainer mesh and copies
them onto the rollout mesh with `jax.device_put` (device to device, no host round trip): that copy
is the weights "version" of the step (version s = the weights after s steps).

One worker thread runs the rollouts (generation on the rollout mesh, then decoding and rewards on
the host; `generate` reads lengths back while it runs, so generating on the main thread would
hold the host until it ends). Before step s+1 trains, the batches of steps up to
s+1+max_staleness are queued with the rollout copy of the time, version s, then the loop waits for
the batch of step s+1 (time_rollout_wait_s) and trains on it while the worker generates the next
ones. With max_staleness = k the pipeline holds k batches in flight between steps, and step t
trains on rollouts of version max(0, t-1-k), i.e. k updates older than the weights it trains
(fewer for the first k steps, which all use the initial weights):

    max_staleness 1: step s+1 trains on rollouts of version s-1 (version 0 for steps 1 and 2),
        while the worker generates step s+2's with version s: generation and reward of one batch
        overlap the update, scoring and sync of the previous one;
    max_staleness k >= 2: step s+1 trains on version s-k while steps s+2..s+1+k are queued or
        generating with versions s-k+1..s (k weights copies alive on the rollout mesh besides the
        latest one); generation may run up to k steps ahead of the trainer;
    max_staleness 0: step s+1's rollouts are generated with version s once the sync is done:
        nothing overlaps, and the run repeats the colocated one on the rollout devices.

A batch's prompts and PRNG key are those of the step that consumes it (as in colocated mode), so
the rollouts depend on the step and the weights version alone. The importance ratio of the loss
uses the rollout's own log-probs of the sampled tokens as the behaviour log-probs (exact under
speculation); the records log `staleness` (trained version - the version of the copy that
generated the batch) next to the ratio statistics (ratio_mean, clip_low_frac, clip_high_frac,
dual_clip_frac).

Checkpoints hold, next to the training state, the max_staleness rollout copies that the batches
after the checkpointed step are (or, past train.steps, would be) generated with ("rollout" slot
i = step+1+i, "rollout_version" int32 [max_staleness]); a resumed run regenerates those batches
from them and continues the uninterrupted run's metrics, also when --resume extends train.steps.
Validation runs on the trainer mesh, as in colocated mode. In a job of several processes every
process trains on its first local devices and generates its share of each step's rollouts on its
last ones (`jaxspec.rl.rollout_hosts`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import numpy as np

from jaxspec.distributed import to_host
from jaxspec.models.sharding import param_shardings
from jaxspec.rl.config import RolloutConfig
from jaxspec.rl.metrics import PhaseTimer, block
from jaxspec.rl.rollout_hosts import RolloutHosts, merge
from jaxspec.rl.rollout_source import RolloutCast, RolloutGenerator, RolloutSource, StepRollouts
from jaxspec.run import Batcher
from jaxspec.run.placement import MeshConfig, Placement


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
    result: Future | None  # (Rollouts, {phase: seconds}); None past train.steps (never generated)


class _PhaseSeconds:
    """Seconds per phase of one batch in the worker thread (`PhaseTimer.phase` without the
    compilation counters, which the main thread's timer counts for the whole process)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


class AsyncRollouts(RolloutSource):
    """rollout.mode async: the rollout mesh, its weights copy and the queue of batches in flight.

    generator: the generation and grading; cast: the trainer's weights as the rollout reads them;
    sampler: the prompt ids of a data position; rollout, mesh: the config sections; steps:
    train.steps; placement: the trainer mesh; draft_trains: whether the draft's weights change
    (draft.online; a frozen draft is copied once).
    """

    def __init__(
        self,
        generator: RolloutGenerator,
        cast: RolloutCast,
        sampler: Batcher,
        rollout: RolloutConfig,
        mesh: MeshConfig,
        steps: int,
        placement: Placement,
        draft_trains: bool,
    ):
        self.generator, self.cast, self.sampler, self.rollout = generator, cast, sampler, rollout
        self.steps, self.placement, self.draft_trains = steps, placement, draft_trains
        self.hosts = RolloutHosts(mesh)
        self.sharding = self.hosts.sharding  # this process's rollout devices
        self.max_staleness = rollout.max_staleness
        # The batches of the steps after the one training, oldest first: max_staleness of them
        # between steps once the pipeline is primed (those past train.steps are not generated but
        # keep their weights for the checkpoint).
        self.in_flight: collections.deque[_Batch] = collections.deque()
        self.weights: RolloutWeights | None = None
        self.next_step = 0
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts")

    def copy(self, state: dict, version: int) -> RolloutWeights:
        """The weights of `state`, cast to rollout.dtype, copied onto the rollout mesh (which
        replicates them by itself: not gathered on the trainer mesh first)."""
        policy, draft = self.cast.weights(state, gather=False)
        trainer = self.cast.sharding
        policy = self.hosts.put(policy, param_shardings(self.sharding, policy), trainer)
        if self.weights is not None and not self.draft_trains:
            draft = self.weights.draft  # a frozen draft is copied once
        elif draft is not None:
            draft = self.hosts.put(draft, jax.tree.map(lambda _: self.sharding.replicated(), draft), trainer)
        return RolloutWeights(*block((policy, draft)), version)

    def initial_entries(self, state: dict) -> dict:
        """The checkpoint entries of a new run (`checkpoint_entries` of version 0), which tell a
        resume where to restore them: onto the rollout mesh."""
        self.weights = self.copy(state, 0)
        return self.checkpoint_entries()

    def checkpoint_entries(self) -> dict:
        """The state entries that let a resumed run regenerate the batches in flight: slot i holds
        the weights copy of the (i+1)-th batch after the trained step (generated or, past
        train.steps, the copy it would be generated with, so that a run extended by --resume with
        more train.steps continues as if it had been longer from the start); none with
        max_staleness 0. Before the pipeline is primed (a new run) every slot holds the current
        copy, which is what those batches will use. Taken after each batch, so that the state
        keeps no copy alive that no batch needs."""
        if not self.max_staleness:
            return {}
        slots = ([b.weights for b in self.in_flight] + [self.weights] * self.max_staleness)[: self.max_staleness]
        rollout = {
            str(i): {"policy": w.policy, **({} if w.draft is None else {"draft": w.draft})} for i, w in enumerate(slots)
        }
        return {
            "rollout": self.hosts.global_view(rollout),
            **self.placement.state({"rollout_version": np.asarray([w.version for w in slots], np.int32)}),
        }

    def start(self, state: dict, step: int, position: int, resumed: bool) -> None:
        """Copies the trainer's weights onto the rollout mesh; after a resume with max_staleness
        >= 1, queues the batches that were in flight at the checkpoint with the weights they used."""
        self.weights = self.copy(state, step)
        self.next_step = step + 1
        if resumed and step > 0 and self.max_staleness > 0:
            versions = [int(v) for v in to_host(state["rollout_version"])]
            copies: dict[int, RolloutWeights] = {}  # one copy per version (the first steps share one)
            restored = self.hosts.local_view(state["rollout"])
            for i, version in enumerate(versions):
                saved = restored[str(i)]
                weights = copies.setdefault(version, RolloutWeights(saved["policy"], saved.get("draft"), version))
                self._submit(weights, state, step, position)

    def update_weights(self, state: dict, step: int, timer: PhaseTimer) -> dict:
        """{"sync_bytes": bytes copied} (`sync`), timed as the "sync" phase."""
        with timer.phase("sync"):
            return {"sync_bytes": self.sync(state, step)}

    def sync(self, state: dict, step: int) -> int:
        """Copies the weights of `state` after `step` steps onto the rollout mesh; returns the
        bytes copied (the policy's, and the draft's when it trains online)."""
        self.weights = self.copy(state, step)
        return sum(
            x.nbytes for x in jax.tree.leaves((self.weights.policy, self.weights.draft if self.draft_trains else None))
        )

    def _submit(self, weights: RolloutWeights, state: dict, step: int, position: int) -> None:
        """Queues the batch of step next_step, generated with `weights` (not past train.steps: the
        run would wait for it at the end); step / position: the run's counters now."""
        batch_step = self.next_step
        self.next_step += 1
        if batch_step > self.steps:
            self.in_flight.append(_Batch(batch_step, weights, None))
            return
        r_cfg = self.rollout
        ids = self.sampler.indices(position + (batch_step - step - 1) * r_cfg.prompts_per_step)
        key = jax.random.fold_in(jax.random.fold_in(state["key"], batch_step - 1), 0)  # as in colocated mode
        key = jax.device_put(to_host(key), self.sharding.replicated())
        spec = self.cast.spec_of(weights.draft)
        # This process's generate calls, each with the key colocated mode gives it (`RolloutGenerator`).
        rows = r_cfg.prompts_per_step * r_cfg.samples_per_prompt
        size = (r_cfg.sub_batch or rows) // r_cfg.samples_per_prompt  # prompts per call
        calls = self.hosts.calls(rows, r_cfg.sub_batch)
        keys = [key] if size == len(ids) else [jax.random.fold_in(key, i) for i in calls]

        def work():
            seconds = _PhaseSeconds()
            out = merge(
                [
                    self.generator.rollouts(
                        ids[i * size : (i + 1) * size], weights.policy, spec, call_key, seconds, sharding=self.sharding
                    )
                    for i, call_key in zip(calls, keys)
                ]
            )
            return out, seconds.seconds

        self.in_flight.append(_Batch(batch_step, weights, self._worker.submit(work)))

    def next_batch(self, state: dict, step: int, position: int, timer: PhaseTimer) -> StepRollouts:
        """The rollouts of step `step` + 1 (with their staleness and rollout_version), once the
        batches up to max_staleness steps ahead are queued. timer gets the batch's generation and
        reward seconds (measured in the worker, overlapped with the trainer) and rollout_wait (the
        trainer waiting for it)."""
        while self.next_step <= step + 1 + self.max_staleness:
            self._submit(self.weights, state, step, position)
        batch = self.in_flight.popleft()
        assert batch.step == step + 1, (batch.step, step)
        with timer.phase("rollout_wait"):
            out, seconds = batch.result.result()
            out = self.hosts.gather(out)
        for name, value in seconds.items():
            timer.seconds[name] = timer.seconds.get(name, 0.0) + value
        out = dataclasses.replace(out, staleness=step - batch.weights.version, rollout_version=batch.weights.version)
        return StepRollouts(out, self.rollout.prompts_per_step, 1)

    def close(self) -> None:
        """Drops the batches not started and waits for the one generating."""
        self._worker.shutdown(wait=True, cancel_futures=True)
