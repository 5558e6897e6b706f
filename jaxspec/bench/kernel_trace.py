"""Each traced kernel's device time, launches and jax scope, from a `jax.profiler` trace and XLA's
optimized-HLO dump: what `jaxspec bench profile` and `jaxspec bench verify --profile` charge.

XLA dumps the optimized HLO of the programs asked for (`set_dump_flags`, before the process uses
JAX); its metadata names the jax scope (op_name) every instruction came from (`op_scopes`). The
trace's op events of those programs, summed per HLO instruction, are the kernels (`kernel_times`);
the device's idle time between two of them, summed per pair, is `idle_gaps`.
"""

from __future__ import annotations

import collections
import itertools
import os
import re
from pathlib import Path
from typing import NamedTuple

# Bytes of distinct weights that calls taken in turn read (`rotated_copies`): over twice the L2 cache
# of an H100 or H200 (50 MB), which a weight read by back-to-back calls would otherwise partly hit.
L2_MISS_BYTES = 256 * 2**20
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_OP_NAME = re.compile(r'metadata=\{[^}]*?op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_CONTROL = re.compile(r"^(while|conditional|call)(\.\d+)?$")


def set_dump_flags(dump_dir: Path, module_re: str, command: str) -> None:
    """Makes XLA dump the optimized HLO of the programs matching `module_re` to `dump_dir` (for
    `op_scopes`) and turns its command buffers off; raises if this process has already used JAX."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise ValueError(
            f"jaxspec {command} must start before anything in this process has used JAX "
            "(it sets XLA_FLAGS to dump the optimized HLO)"
        )
    flags = os.environ.get("XLA_FLAGS", "")
    # Without command buffers (CUDA graphs) every kernel is traced under its own HLO name.
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_dump_to={dump_dir} --xla_dump_hlo_as_text "
        f"--xla_dump_hlo_module_re={module_re} --xla_gpu_enable_command_buffer="
    ).strip()


def op_scopes(dump_dir: Path) -> dict[tuple[int, str], str]:
    """{(program id, instruction name): jax op_name} from the optimized HLO in an XLA dump (files
    module_<program id>.<name>...after_optimizations.txt). A fusion that XLA gave no metadata
    of its own gets the scopes its fused instructions share."""
    scopes = {}
    for path in Path(dump_dir).glob("module_*after_optimizations.txt"):
        program = int(path.name.split(".")[0].removeprefix("module_"))
        computation, names, calls = None, collections.defaultdict(list), {}
        for line in path.read_text().splitlines():
            header = _COMPUTATION.match(line)
            if header:
                computation = header.group(1)
                continue
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            meta, called = _OP_NAME.search(line), _CALLS.search(line)
            if meta:
                scopes[(program, m.group(1))] = meta.group(1)
                names[computation].append(meta.group(1).split("/"))
            elif called:
                calls[m.group(1)] = called.group(1)
        for instruction, computation in calls.items():
            paths = names.get(computation)
            if paths:
                shared = [parts[0] for parts in zip(*paths) if len(set(parts)) == 1]
                scopes[(program, instruction)] = "/".join(shared)
    return scopes


class Kernel(NamedTuple):
    """One HLO kernel of a traced program, summed over its launches."""

    program: str  # the program's label (`kernel_times`' modules)
    op: str  # HLO instruction
    op_name: str  # jax scopes and primitive
    ns: float  # device time
    launches: int


def kernel_times(trace_dir: Path, scopes: dict[tuple[int, str], str], modules: dict[str, str]) -> list[Kernel]:
    """Every kernel of the programs named in `modules` ({HLO module: program label}) in a trace,
    longest first.

    Counts the leaf kernels of the accelerator planes (or the host's XLA ops on CPU, where a
    while/conditional/call thunk that encloses its body's ops on its thread is skipped; a call
    XLA compiled into one kernel encloses none and counts)."""
    ns: dict[tuple[str, str, str], float] = collections.defaultdict(float)
    launches: dict[tuple[str, str, str], int] = collections.defaultdict(int)
    for line in _trace_lines(trace_dir):
        for event in _leaf_ops(line, modules):
            key = (event.program, event.op, scopes.get((event.program_id, event.op), ""))
            ns[key] += event.duration_ns
            launches[key] += 1
    return sorted((Kernel(*key, ns[key], launches[key]) for key in ns), key=lambda k: -k.ns)


TRACED_MODULE = "jit_traced_call"  # the HLO module `traced_seconds` compiles


def trace_calls(fn, trace_dir: Path, calls: int = 10) -> None:
    """Writes a profiler trace of `calls` calls of fn() (a compiled program, run once first so that
    its compilation stays out of the trace) to `trace_dir`."""
    import jax

    jax.block_until_ready(fn())
    with jax.profiler.trace(str(trace_dir)):
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)


def traced_seconds(fn, args: tuple | list[tuple], trace_dir: Path, calls: int = 10) -> float:
    """Device seconds per call of fn(*args): the kernels of `calls` calls in a profiler trace
    written to `trace_dir` (`trace_calls`), summed: the device's time alone, none of the host's or
    of the gaps between launches. args: one call's arguments, or a list of argument tuples of one
    shape that the calls take in turn (`rotated_copies`: no call then reads what the call before
    left in the L2 cache). Every kernel counts only under its own name when the process has called
    `set_dump_flags` (command buffers off) before using JAX."""
    import jax

    def traced_call(*args):
        return fn(*args)

    trace_calls(in_turn(jax.jit(traced_call), args if isinstance(args, list) else [args]), trace_dir, calls)
    kernels = kernel_times(trace_dir, {}, {TRACED_MODULE: "call"})
    if not kernels:
        raise ValueError(f"no kernel of {TRACED_MODULE} in the trace at {trace_dir}")
    return sum(k.ns for k in kernels) / calls / 1e9


def in_turn(fn, arg_sets: list[tuple]):
    """A function of no arguments whose n-th call (from 0) is fn(*arg_sets[n % len(arg_sets)])."""
    turn = itertools.count()
    return lambda: fn(*arg_sets[next(turn) % len(arg_sets)])


def rotated_copies(args: tuple, first: int = 1, min_bytes: int = L2_MISS_BYTES) -> list[tuple]:
    """Argument tuples like args whose arrays from index `first` on (a call's weights) are distinct
    copies, as many tuples as make those copies hold at least min_bytes (args itself first): calls
    that take them in turn read their weights from memory, not from the L2 cache."""
    import jax.numpy as jnp

    weight_bytes = sum(a.size * a.dtype.itemsize for a in args[first:])
    count = max(1, -(-min_bytes // max(weight_bytes, 1)))
    return [args] + [(*args[:first], *(jnp.array(a, copy=True) for a in args[first:])) for _ in range(count - 1)]


class Gap(NamedTuple):
    """The device's idle time between two kernels of a traced program, summed over the times the
    one ran right after the other on a trace line."""

    program: str
    before: str  # the HLO instruction that ran last before the gap
    before_name: str  # its jax scopes
    after: str  # the first one after it
    after_name: str
    ns: float
    count: int


def idle_gaps(trace_dir: Path, scopes: dict[tuple[int, str], str], modules: dict[str, str]) -> list[Gap]:
    """Where a program's device line sat idle between two of its kernels (`kernel_times`' leaf
    kernels, consecutive on one trace line), longest total first: the host's share of a loop
    (a branch's index or a loop's predicate read back, launches that outrun the kernels)."""
    ns: dict[tuple[str, str, str], float] = collections.defaultdict(float)
    count: dict[tuple[str, str, str], int] = collections.defaultdict(int)
    for line in _trace_lines(trace_dir):
        events = sorted(_leaf_ops(line, modules), key=lambda e: e.start_ns)
        for first, second in zip(events, events[1:]):
            gap = second.start_ns - (first.start_ns + first.duration_ns)
            if first.program == second.program and gap > 0:
                key = (first.program, (first.program_id, first.op), (second.program_id, second.op))
                ns[key] += gap
                count[key] += 1
    gaps = [
        Gap(program, before[1], scopes.get(before, ""), after[1], scopes.get(after, ""), ns[key], count[key])
        for key in ns
        for program, before, after in (key,)
    ]
    return sorted(gaps, key=lambda g: -g.ns)


def _trace_lines(trace_dir: Path):
    """The trace lines of the accelerator planes of every profile under trace_dir (the host's
    CPU plane where there is no accelerator)."""
    from jax.profiler import ProfileData

    for path in Path(trace_dir).rglob("*.xplane.pb"):
        data = ProfileData.from_file(str(path))
        planes = [p for p in data.planes if p.name.startswith("/device:")] or [
            p for p in data.planes if p.name == "/host:CPU"
        ]
        for plane in planes:
            yield from plane.lines


class _Event(NamedTuple):
    program: str  # label
    op: str
    program_id: int
    start_ns: float
    duration_ns: float


def _leaf_ops(line, modules: dict[str, str]) -> list[_Event]:
    """Each op event on one trace line of a program in `modules`, in order, less the control
    thunks that enclose other op events."""
    events = []
    for event in line.events:
        stats = dict(event.stats)
        program = modules.get(str(stats.get("hlo_module")))
        if program is not None and stats.get("hlo_op") is not None and "program_id" in stats:
            events.append((event.start_ns, event.duration_ns, program, str(stats["hlo_op"]), int(stats["program_id"])))
    events.sort(key=lambda e: (e[0], -e[1]))  # an enclosing thunk before the ops it starts with
    return [
        _Event(program, op, program_id, start, duration)
        for i, (start, duration, program, op, program_id) in enumerate(events)
        if not (_CONTROL.match(op) and i + 1 < len(events) and events[i + 1][0] < start + duration)
    ]
