"""`jaxspec bench verify`: the tree-verification kernel vs its jnp reference.

Random f32 logits [batch, nodes, vocab] and a random tree per row (each node's parent drawn below
it, random draft tokens), deterministic drafts; with `--stochastic`, drafts verified as drawn from q
(a random softmax per node, f32): the stochastic-draft kernel against `verify_stochastic`. Times are
per call with `--iters` calls inside one compiled `fori_loop` (`in_loop_seconds`: device time, as
inside the compiled rollout loop; each call has its own key, and depends on the one before through
in-place zero updates of the logits and the tree, so XLA hoists none of the work out of the loop),
less `loop_ms`, the same loop's time per iteration with a call that does nothing. The `latency`
columns time single blocking calls, dispatch and host round trip included. The achieved rate is
logits bytes (and q's, for stochastic drafts) / time, compared with the device copy bandwidth (bytes
read + written per second) measured in the same run. `agree` is the fraction of rows where both
implementations return the same path, count and next token from the same key (they share the noise;
float summation order can flip a decision that lands within rounding of a boundary).

`--profile` also traces 10 calls of each implementation per shape and reports the device time of
the kernels they launch: all of them, and the kernel path's node-statistics kernel alone (the
Triton kernels run under jax scopes named for them, `tree_verify_node_stats` and so on, which the
trace's op names carry). Off a GPU the kernels run in Triton's interpreter (slow).
As in `jaxspec bench profile`, XLA's command buffers are off for the whole run, so the timing
columns then include launch gaps that command buffers would hide.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.bench.kernel_trace import kernel_times, op_scopes, set_dump_flags, trace_calls
from jaxspec.bench.timing import (
    add_error,
    add_fraction,
    ceilings,
    copy_bytes_per_second,
    in_loop_seconds,
    median_seconds,
    net_of_loop,
    out_of_memory,
    print_table,
    write_results,
)
from jaxspec.kernels.tree_stochastic_triton import verify_stochastic_triton
from jaxspec.kernels.tree_verify_reference import verify_reference
from jaxspec.kernels.tree_verify_triton import TARGET_PROGRAMS, tree_verify_node_stats, verify_triton

VERIFY_MODULES = {
    "jit_verify_triton": "kernel",
    "jit_verify_stochastic_triton": "kernel",
    "jit_verify_reference": "reference",
}  # HLO module: program
PROFILE_CALLS = 10


def random_trees(batch: int, nodes: int, vocab: int, seed: int):
    """(parents int32 [B, N], draft_tokens int32 [B, N], num_nodes int32 [B]) of full random trees."""
    rng = np.random.default_rng(seed)
    parents = np.full((batch, nodes), -1, np.int32)
    for n in range(1, nodes):
        parents[:, n] = rng.integers(0, n, size=batch)
    tokens = rng.integers(0, vocab, size=(batch, nodes), dtype=np.int32)
    return jnp.asarray(parents), jnp.asarray(tokens), jnp.full((batch,), nodes, jnp.int32)


def _in_loop(call, inputs: tuple, calls: int, make_inputs) -> tuple[float | None, tuple]:
    """(`in_loop_seconds` of call(*inputs, i), or None when the device runs out of memory; the
    inputs to use next: the loop donates them, so they are made again after a failure)."""
    timed = _timed(lambda: in_loop_seconds(call, inputs, calls=calls))
    return (None, make_inputs()) if timed is None else timed


def _timed(measure) -> float | None:
    """measure() (seconds per call), or None when the device runs out of memory."""
    try:
        return measure()
    except jax.errors.JaxRuntimeError as err:
        out_of_memory(err)  # raises any other error
        return None


def traced_kernels(trace_dir: Path, scopes: dict[tuple[int, str], str], program: str) -> dict:
    """Device time per call of the kernels of `program` ("kernel" or "reference") in a
    `trace_calls` trace: the total, the launches, the node-statistics kernel (kernel path)
    and the longest kernels."""
    kernels = [k for k in kernel_times(trace_dir, scopes, VERIFY_MODULES) if k.program == program]
    per_call = lambda ns: ns / 1e6 / PROFILE_CALLS  # noqa: E731
    traced = {
        "traced_ms": per_call(sum(k.ns for k in kernels)),
        "launches": sum(k.launches for k in kernels) / PROFILE_CALLS,
        "top": [{"ms": per_call(k.ns), "op": k.op, "op_name": k.op_name} for k in kernels[:8]],
    }
    if program == "kernel":
        traced["node_stats_ms"] = per_call(sum(k.ns for k in kernels if tree_verify_node_stats.__name__ in k.op_name))
    return traced


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="jaxspec bench verify", description=__doc__)
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--nodes", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--stochastic",
        action="store_true",
        help="stochastic drafts (draft_probs): the stochastic-draft kernel; --tile is its tile",
    )
    p.add_argument("--iters", type=int, default=20, help="calls per timing (in one loop, or blocking)")
    p.add_argument("--tile", type=int, default=2048, help="vocabulary tile of the kernel (a power of 2)")
    p.add_argument("--num-warps", type=int, default=4)
    p.add_argument("--num-stages", type=int, default=3)
    p.add_argument(
        "--programs",
        type=int,
        default=TARGET_PROGRAMS,
        help="about how many (row, node, vocabulary split) programs the kernel runs",
    )
    p.add_argument("--copy-bytes", type=int, default=None, help="buffer size of the copy-bandwidth baseline")
    p.add_argument(
        "--profile",
        action="store_true",
        help="trace each implementation and report device time by kernel (command buffers off)",
    )
    p.add_argument("--out", default=None, help="write JSON results here")
    args = p.parse_args(argv)
    if args.tile < 1 or args.tile & (args.tile - 1):
        raise ValueError(f"--tile must be a power of 2, got {args.tile}")
    if args.programs < 1:
        raise ValueError(f"--programs must be >= 1, got {args.programs}")
    if args.temperature < 0 or (args.stochastic and args.temperature == 0):
        raise ValueError(f"--temperature must be >= 0 (> 0 with --stochastic), got {args.temperature}")
    work = Path(tempfile.mkdtemp(prefix="jaxspec-verify-")) if args.profile else None
    if work is not None:
        set_dump_flags(work / "hlo", ".*verify_(stochastic_triton|triton|reference).*", "bench verify --profile")

    gpu = jax.default_backend() == "gpu"
    copy_bytes = args.copy_bytes or (1 << 30 if gpu else 1 << 24)
    copy_rate = copy_bytes_per_second(copy_bytes)
    rows = []
    for batch in args.batch:
        for nodes in args.nodes:
            shape, seed = (batch, nodes, args.vocab), jax.random.key(batch * 1000 + nodes)
            q_shape = shape if args.stochastic else (1,)  # q: unused by deterministic drafts
            make_inputs = lambda shape=shape, seed=seed, q_shape=q_shape: (  # noqa: E731  (arguments, never constants)
                jax.random.normal(seed, shape, jnp.float32),
                jax.nn.softmax(2.0 * jax.random.normal(jax.random.fold_in(seed, 1), q_shape, jnp.float32), axis=-1),
                *random_trees(*shape, seed=shape[1]),
                jax.random.key(0),
            )

            def kernel_call(logits, q, parents, tokens, num_nodes, key, i=0):
                key = jax.random.fold_in(key, i)
                if args.stochastic:
                    return verify_stochastic_triton(
                        logits,
                        q,
                        parents,
                        tokens,
                        num_nodes,
                        key,
                        temperature=args.temperature,
                        interpret=not gpu,
                        tile=args.tile,
                        num_warps=args.num_warps,
                        num_stages=args.num_stages,
                    )
                return verify_triton(
                    logits,
                    parents,
                    tokens,
                    num_nodes,
                    key,
                    temperature=args.temperature,
                    interpret=not gpu,
                    tile=args.tile,
                    num_warps=args.num_warps,
                    num_stages=args.num_stages,
                    programs=args.programs,
                )

            reference_call = lambda logits, q, parents, tokens, num_nodes, key, i=0: verify_reference(  # noqa: E731
                logits,
                parents,
                tokens,
                num_nodes,
                jax.random.fold_in(key, i),
                temperature=args.temperature,
                tile=args.tile,
                draft_probs=q if args.stochastic else None,
            )
            loop_call = lambda logits, q, parents, tokens, num_nodes, key, i: jax.random.key_data(  # noqa: E731
                jax.random.fold_in(key, i)
            )
            inputs = make_inputs()
            t_loop, inputs = _in_loop(loop_call, inputs, args.iters, make_inputs)  # the loop's own cost
            net = {}
            net["kernel"], inputs = _in_loop(kernel_call, inputs, args.iters, make_inputs)
            net["reference"], inputs = _in_loop(reference_call, inputs, args.iters, make_inputs)
            fits = None not in (t_loop, *net.values())  # None: out of memory
            errors = []
            for name in ("kernel", "reference"):
                try:
                    net[name] = net_of_loop(net[name], t_loop, f"verify {name} batch {batch} nodes {nodes}")
                except ValueError as err:
                    net[name] = None
                    errors.append(str(err))
            t_kernel, t_reference = net["kernel"], net["reference"]
            logits = inputs[0]
            kernel = lambda a=inputs: kernel_call(*a)  # noqa: E731
            reference = lambda a=inputs: reference_call(*a)  # noqa: E731
            lat_kernel, lat_reference = (
                _timed(lambda f=f: median_seconds(f, iters=args.iters)) for f in (kernel, reference)
            )
            agree = None
            if fits:
                a, b = kernel(), reference()
                same = [
                    np.all(np.asarray(x) == np.asarray(y), axis=tuple(range(1, np.ndim(x))))
                    for x, y in zip(a[:3], b[:3])
                ]
                agree = float(np.mean(np.logical_and.reduce(same)))
            nbytes = logits.nbytes + (inputs[1].nbytes if args.stochastic else 0)

            def scaled(t, unit):
                return None if t is None else unit(t)

            def ratio(num, den):
                return None if None in (num, den) else num / den

            def ms(t):
                return 1e3 * t

            rows.append(
                {
                    "batch": batch,
                    "nodes": nodes,
                    "vocab": args.vocab,
                    "loop_ms": scaled(t_loop, ms),
                    "kernel_ms": scaled(t_kernel, ms),
                    "reference_ms": scaled(t_reference, ms),
                    "speedup": ratio(t_reference, t_kernel),
                    "kernel_latency_ms": scaled(lat_kernel, ms),
                    "reference_latency_ms": scaled(lat_reference, ms),
                    "latency_speedup": ratio(lat_reference, lat_kernel),
                    "kernel_GBps": scaled(t_kernel, lambda t: nbytes / t / 1e9),
                    "reference_GBps": scaled(t_reference, lambda t: nbytes / t / 1e9),
                    "agree": agree,
                }
            )
            add_fraction(
                rows[-1],
                "kernel_vs_copy",
                scaled(t_kernel, lambda t: nbytes / t),
                copy_rate,
                f"verify batch {batch} nodes {nodes}: logits bytes per second / copy bandwidth",
            )
            for error in errors:
                add_error(rows[-1], error)
            if errors:
                print(f"error: {rows[-1]['error']}")
            if work is not None:
                trace_calls(kernel, work / f"trace_{batch}_{nodes}_kernel", PROFILE_CALLS)
                trace_calls(reference, work / f"trace_{batch}_{nodes}_reference", PROFILE_CALLS)
            del logits, inputs, kernel, reference  # frees the logits before the next shape's
    if work is not None:
        scopes = op_scopes(work / "hlo")  # every program has been compiled (and dumped) by now
        for row in rows:
            for name in ("kernel", "reference"):
                traced = traced_kernels(work / f"trace_{row['batch']}_{row['nodes']}_{name}", scopes, name)
                row.update({f"{name}_{k}": v for k, v in traced.items()})
    baseline = {
        **ceilings(copy_rate=copy_rate),
        "copy_GBps": copy_rate / 1e9,
        "copy_bytes": copy_bytes,
        "temperature": args.temperature,
        "draft_probs": args.stochastic,
        "tile": args.tile,
        "num_warps": args.num_warps,
        "num_stages": args.num_stages,
        "programs": args.programs,
        "kernel": ("stochastic-" if args.stochastic else "") + ("triton" if gpu else "triton-interpret"),
        "timing": "in_loop_seconds, minus loop_ms",
    }
    print(f"measured copy bandwidth (read + write): {copy_rate / 1e9:.1f} GB/s")
    print_table(
        rows,
        [
            "batch",
            "nodes",
            "vocab",
            "loop_ms",
            "kernel_ms",
            "reference_ms",
            "speedup",
            "kernel_latency_ms",
            "reference_latency_ms",
            "latency_speedup",
            "kernel_GBps",
            "kernel_vs_copy",
            "agree",
        ],
    )
    if work is not None:
        print(f"device time per call by kernel ({PROFILE_CALLS} traced calls, command buffers off):")
        print_table(
            rows,
            [
                "batch",
                "nodes",
                "kernel_ms",
                "kernel_traced_ms",
                "kernel_node_stats_ms",
                "kernel_launches",
                "reference_ms",
                "reference_traced_ms",
                "reference_launches",
            ],
        )
        baseline["command_buffers"] = False
    write_results(args.out, "verify", rows, baseline)
    return 0
