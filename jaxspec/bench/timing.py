"""Timing, device-ceiling and device-memory measurements shared by the benchmarks."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp


def median_seconds(fn: Callable[[], object], warmup: int = 2, iters: int = 10) -> float:
    """Median wall time of fn() in seconds, blocking on its outputs (each call's dispatch and host
    round trip included); warm-up calls excluded."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def in_loop(fn: Callable[..., object], calls: int) -> Callable[..., tuple]:
    """A jitted program(args) -> args' that runs fn(*args, i) for i = 0 .. calls - 1 in a
    `lax.fori_loop` (i an int32 scalar, e.g. for `jax.random.fold_in`), as a compiled rollout loop
    runs it. After each call the first element of every numeric array argument is written again,
    in place, as its value before the loop + 0 * (the sum of the call's outputs): each call
    depends on the one before and no argument is loop-invariant, so XLA neither hoists work out of
    the loop (e.g. what depends on the logits or the tree alone) nor drops the calls. The written
    value does not read the array, so the update needs no copy of it. args (a tuple) is donated;
    args' replaces it."""

    def numeric(x: jax.Array) -> bool:
        return jnp.issubdtype(x.dtype, jnp.number)  # not e.g. a PRNG key: the calls differ by i

    def program(args: tuple) -> tuple:
        corners = [jnp.ravel(x)[:1] if numeric(x) else None for x in args]

        def body(i, args):
            out = fn(*args, i)
            zero = 0.0 * sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(out))
            return tuple(
                x
                if corner is None
                else jax.lax.dynamic_update_slice(
                    x, (corner + zero).astype(x.dtype).reshape((1,) * x.ndim), (0,) * x.ndim
                )
                for x, corner in zip(args, corners)
            )

        return jax.lax.fori_loop(0, calls, body, args)

    return jax.jit(program, donate_argnums=0)


def in_loop_seconds(fn: Callable[..., object], args: tuple, calls: int = 20, repeats: int = 5) -> tuple[float, tuple]:
    """(seconds per iteration of `in_loop(fn, calls)` (median over `repeats` runs, each blocked on
    once), args' to use in place of the donated args): the device time of a call inside a compiled
    loop, plus the loop's own cost per iteration (time an `fn` that does nothing to subtract it).
    No host dispatch between calls: jitted calls dispatched back to back from Python can fall
    behind a device that takes ~0.1 ms per call."""
    program = in_loop(fn, calls)
    times = []
    for _ in range(repeats + 1):  # the first compiles
        start = time.perf_counter()
        args = jax.block_until_ready(program(tuple(args)))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) / calls, args


def empty_loop_seconds(args: tuple, calls: int = 20, repeats: int = 5) -> tuple[float, tuple]:
    """(seconds per iteration of `in_loop_seconds`' loop around a call that does nothing, at these
    arrays' shapes: its own cost, the in-place writes of every argument included, which
    `net_of_loop` takes off a call's time; the arrays to use in place of the donated `args`)."""
    return in_loop_seconds(lambda *a: jnp.ravel(a[0])[:1], args, calls=calls, repeats=repeats)


def net_of_loop(seconds: float | None, loop_seconds: float | None, what: str) -> float | None:
    """seconds - loop_seconds: a call's own time per iteration of `in_loop_seconds` once the empty
    loop's is taken off; None if either is None. Raises ValueError naming `what` when the
    difference is not positive: the call cannot take no time, so the timings are noise (too few
    iterations, or a busy machine)."""
    if seconds is None or loop_seconds is None:
        return None
    if seconds <= loop_seconds:
        raise ValueError(
            f"{what}: {1e3 * seconds:.4g} ms per iteration is no more than the empty loop's "
            f"{1e3 * loop_seconds:.4g} ms; the timing is noise (time more iterations)"
        )
    return seconds - loop_seconds


# Datasheet ceilings by device kind (dense bf16 tensor-core FLOP/s; HBM bytes per second, reads
# and writes together), the first matching substring of `jax.Device.device_kind` wins.
DATASHEET: tuple[tuple[str, dict], ...] = (
    ("H100 PCIe", {"bf16_flops": 756e12, "hbm_bytes_per_s": 2.0e12}),
    ("H100", {"bf16_flops": 989e12, "hbm_bytes_per_s": 3.35e12}),  # SXM5 80 GB (HBM3)
    ("H200", {"bf16_flops": 989e12, "hbm_bytes_per_s": 4.8e12}),  # SXM 141 GB (HBM3e)
)


def datasheet(device_kind: str | None = None) -> dict | None:
    """The datasheet ceilings of a device kind (default: device 0's), None if not listed."""
    kind = device_kind or getattr(jax.devices()[0], "device_kind", "")
    return next((dict(figures) for name, figures in DATASHEET if name in kind), None)


def looped(body: Callable[..., jax.Array], calls: int) -> Callable[..., jax.Array]:
    """A jitted program (x, *invariants) -> x after `x = body(x, *invariants)` ran `calls` times in
    one fori_loop (x donated: the loop updates it in place; the invariants, e.g. weights, are the
    program's arguments, not constants compiled into it). The barrier keeps XLA from fusing
    iterations should it unroll the loop."""

    def program(x: jax.Array, *invariants) -> jax.Array:
        step = lambda i, u: jax.lax.optimization_barrier(body(u, *invariants))  # noqa: E731
        return jax.lax.fori_loop(0, calls, step, x)

    return jax.jit(program, donate_argnums=0)


def looped_seconds(
    body: Callable[..., jax.Array], x: jax.Array, *invariants, calls: int, repeats: int
) -> tuple[float, jax.Array]:
    """(median seconds per iteration of `looped(body, calls)` over `repeats` runs after a compiling
    one, each run blocked on once; x after the last run, to use in place of the donated x)."""
    program = looped(body, calls)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        x = jax.block_until_ready(program(x, *invariants))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) / calls, x


def copy_bytes_per_second(num_bytes: int = 2 << 30, calls: int = 20, repeats: int = 5) -> float:
    """Device copy bandwidth (bytes read + bytes written per second): `x + 1` over a float32 array
    of `num_bytes`, `calls` times back to back inside one compiled loop (one host sync per run), so
    no launch or dispatch gap between copies lowers it. The memory-roofline denominator."""
    x = jnp.zeros((num_bytes // 4,), jnp.float32)
    return 2 * num_bytes / looped_seconds(lambda v: v + 1.0, x, calls=calls, repeats=repeats)[0]


def read_bytes_per_second(num_bytes: int = 2 << 30, calls: int = 20, repeats: int = 5) -> float:
    """Device read bandwidth (bytes read per second): a sum over a float32 array of `num_bytes`
    inside one compiled loop (`in_loop` keeps the array loop-variant without copying it)."""
    x = jax.random.normal(jax.random.key(2), (num_bytes // 4,), jnp.float32)
    seconds, _ = in_loop_seconds(lambda v, i: jnp.sum(v), (x,), calls=calls, repeats=repeats)
    return num_bytes / seconds


def matmul_flops_per_second(n: int = 8192, dtype=jnp.bfloat16, calls: int = 20, repeats: int = 5) -> float:
    """Dense matmul rate (FLOP/s) of n x n bf16 products inside one compiled loop: the better of a
    chain (x = x @ w, w scaled by 1/sqrt(n) so x keeps its scale) and independent products of two
    loop-variant matrices (`in_loop`; the sum of each product that keeps it alive is one small read
    of the output, counted against the rate). The compute-roofline denominator."""
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (n, n), dtype)
    w = (jax.random.normal(kw, (n, n), jnp.float32) / n**0.5).astype(dtype)
    chained, _ = looped_seconds(lambda v, w: v @ w, x, w, calls=calls, repeats=repeats)
    independent, _ = in_loop_seconds(
        lambda a, b, i: a @ b, (jax.random.normal(kx, (n, n), dtype), w), calls=calls, repeats=repeats
    )
    return 2 * n**3 / min(chained, independent)


def out_of_memory(err: jax.errors.JaxRuntimeError) -> str:
    """ "out of device memory: <the error's first line>" for a device out-of-memory error, for a
    result row that records a shape that does not fit; any other runtime error is raised again."""
    if "RESOURCE_EXHAUSTED" not in str(err):
        raise err
    return f"out of device memory: {str(err).splitlines()[0][:400]}"


def roofline_fraction(achieved: float, ceiling: float, what: str) -> float:
    """achieved / ceiling; ValueError when above 1.0: a rate above the measured ceiling means the
    work or the ceiling was counted wrong, never a result."""
    frac = achieved / ceiling
    if not frac <= 1.0:
        raise ValueError(
            f"{what}: {frac:.3f} of the measured ceiling ({achieved:.4g} of {ceiling:.4g} per s) "
            f"is above 1.0: a measurement bug"
        )
    return frac


def add_error(row: dict, message: str) -> None:
    """Appends `message` to row["error"] ("; " between problems), so that no problem a row already
    names is overwritten by a later one."""
    row["error"] = "; ".join(filter(None, [row.get("error"), message]))


def add_fraction(row: dict, key: str, achieved: float | None, ceiling: float, what: str) -> None:
    """row[key] = `roofline_fraction`, or None and an error on the row (`add_error`) naming the
    problem when it is above 1.0 (the row stays in the results, marked, instead of reporting an
    impossible figure)."""
    if achieved is None:
        row[key] = None
        return
    try:
        row[key] = roofline_fraction(achieved, ceiling, what)
    except ValueError as err:
        row[key] = None
        add_error(row, str(err))


def ceilings(copy_rate: float | None = None, matmul_rate: float | None = None) -> dict:
    """The measured ceilings beside the card's datasheet figures, for a result file's baseline."""
    sheet = datasheet() or {}
    out = {"device_kind": getattr(jax.devices()[0], "device_kind", "unknown")}
    if copy_rate is not None:
        out["copy_TBps_in_loop"] = copy_rate / 1e12
        if "hbm_bytes_per_s" in sheet:
            out["copy_vs_datasheet"] = copy_rate / sheet["hbm_bytes_per_s"]
    if matmul_rate is not None:
        out["matmul_TFLOPs_in_loop"] = matmul_rate / 1e12
        if "bf16_flops" in sheet:
            out["matmul_vs_datasheet"] = matmul_rate / sheet["bf16_flops"]
    return out


def memory_stat(name: str) -> list[int | None]:
    """`name` of every local device's memory statistics (None: not reported, e.g. on the CPU):
    peak_bytes_in_use (since the process started), bytes_in_use or largest_free_block_bytes (now)."""
    return [(d.memory_stats() or {}).get(name) for d in jax.local_devices()]


def largest_free_block() -> list[int | None]:
    """Every local device's largest free block of XLA's pool; None where unknown: the CPU, and the
    `cuda_async` allocator (XLA_PYTHON_CLIENT_ALLOCATOR), whose pool the CUDA driver manages and
    which reports 0."""
    if os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") == "cuda_async":
        return [None] * len(jax.local_devices())
    return memory_stat("largest_free_block_bytes")


def gigabytes(values: list[int | None]) -> list[float | None]:
    return [None if b is None else round(b / 1e9, 2) for b in values]


def device_description() -> str:
    dev = jax.devices()[0]
    return f"{dev.platform}:{getattr(dev, 'device_kind', 'unknown')} x{jax.device_count()}"


def write_results(path: str | None, name: str, rows: list[dict], baseline: dict) -> None:
    """Writes {"benchmark", "device", "jax", "python", "settings", "baseline", "rows"} as JSON when a
    path is given; "settings": the JAXSPEC_* variables that choose kernels and XLA_FLAGS, as set."""
    if not path:
        return
    out = {
        "benchmark": name,
        "device": device_description(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "settings": kernel_settings(),
        "baseline": baseline,
        "rows": rows,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=2))


def kernel_settings() -> dict[str, str]:
    """The environment variables set now that choose a run's kernels (JAXSPEC_*) and XLA's flags."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("JAXSPEC_") or k == "XLA_FLAGS"}


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
