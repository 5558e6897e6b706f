"""Device memory around the phases of `jaxspec train`: what XLA's allocator holds, against the
arrays Python holds and the run's state.

Runs `jaxspec train` with the given arguments and, before and after each phase of a step (generate:
`ColocatedRollouts.next_batch` of `jaxspec.rl.rollout_source`; score, optimize: `_score`, `_optimize` of
`jaxspec.rl.loop.GRPORun`), prints per local device the
allocator's bytes in use and peak, the bytes of every live array and of the run's state, and on
the first device the arrays outside the state by dtype and sharding. In use above the live
arrays is memory no Python object holds; live arrays above the state are copies the run keeps,
or other arrays over the state's own buffers where in use stays at the state; a phase's peak
above its start is that phase's working memory (the peak is the process's, so it only grows).
Inside `_optimize`, the first `--updates` minibatch updates (default 2) also report before their
gradients program, after it and after the optimizer step, each waited for:

    PYTHONPATH=. python3 benchmarks/train_phase_memory.py [--updates N] --config CONFIG --run-dir DIR [key=value ...]
"""

from __future__ import annotations

import collections
import math
import sys

import jax

from jaxspec.cli import main
from jaxspec.rl import loop, step
from jaxspec.rl.rollout_source import ColocatedRollouts

# (class, method, the phase's name)
PHASES = (
    (ColocatedRollouts, "next_batch", "generate"),
    (loop.GRPORun, "_score", "score"),
    (loop.GRPORun, "_optimize", "optimize"),
)
RUNS: list[loop.GRPORun] = []  # the run being measured (the report reads its state)


def _bytes_on(array: jax.Array, device) -> int:
    if device not in array.sharding.device_set:
        return 0
    return math.prod(array.sharding.shard_shape(array.shape)) * array.dtype.itemsize


def report(run: loop.GRPORun, tag: str) -> None:
    arrays = jax.live_arrays()
    state = {id(x) for x in jax.tree.leaves(run.state) if isinstance(x, jax.Array)}
    for device in jax.local_devices():
        stats = device.memory_stats() or {}
        live = sum(_bytes_on(x, device) for x in arrays)
        held = sum(_bytes_on(x, device) for x in arrays if id(x) in state)
        print(
            f"{tag} device {device.id}: in use {stats.get('bytes_in_use', 0) / 1e9:.3f} GB, peak "
            f"{stats.get('peak_bytes_in_use', 0) / 1e9:.3f}, live arrays {live / 1e9:.3f}, state {held / 1e9:.3f}",
            flush=True,
        )
    outside = collections.Counter()
    first = jax.local_devices()[0]
    for x in arrays:
        if id(x) not in state and _bytes_on(x, first) > 1e6:
            outside[(str(x.dtype), str(getattr(x.sharding, "spec", x.sharding)))] += _bytes_on(x, first)
    for (dtype, sharding), size in outside.most_common(12):
        print(f"  {tag} outside the state, device {first.id}: {dtype} {sharding} {size / 1e9:.3f} GB", flush=True)


def _reporting(owner, method: str, phase: str):
    call = getattr(owner, method)

    def wrapped(self, *args, **kwargs):
        report(RUNS[-1], f"before {phase}")
        out = call(self, *args, **kwargs)
        report(RUNS[-1], f"after {phase}")
        return out

    return wrapped


def _remembering_runs():
    init = loop.GRPORun.__init__

    def remember(self, *args, **kwargs):
        init(self, *args, **kwargs)
        RUNS.append(self)

    loop.GRPORun.__init__ = remember


def _reporting_updates(limit: int):
    """`MinibatchUpdate.__call__` reporting around its programs for the first `limit` calls: its
    gradients program, waited for, then the whole update once it returns (its gradients freed)."""
    call, calls = step.MinibatchUpdate.__call__, [0]

    def wrapped(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] > limit:
            return call(self, *args, **kwargs)
        tag = f"update {calls[0]}"

        def gradients(*inputs):
            report(RUNS[-1], f"{tag} before gradients")
            out = jax.block_until_ready(self.gradients(*inputs))
            report(RUNS[-1], f"{tag} after gradients")
            return out

        out = jax.block_until_ready(call(self._replace(gradients=gradients), *args, **kwargs))
        report(RUNS[-1], f"{tag} after the optimizer step")
        return out

    step.MinibatchUpdate.__call__ = wrapped


if __name__ == "__main__":
    args = sys.argv[1:]
    updates = 2
    if args[:1] == ["--updates"]:
        updates, args = int(args[1]), args[2:]
    _remembering_runs()
    for owner, method, phase in PHASES:
        setattr(owner, method, _reporting(owner, method, phase))
    _reporting_updates(updates)
    sys.exit(main(["train", *args]))
