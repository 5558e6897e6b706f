"""Timing and device-ceiling measurements shared by the benchmarks."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

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
            return tuple(x if corner is None else jax.lax.dynamic_update_slice(
                x, (corner + zero).astype(x.dtype).reshape((1,) * x.ndim), (0,) * x.ndim)
                for x, corner in zip(args, corners))

        return jax.lax.fori_loop(0, calls, body, args)

    return jax.jit(program, donate_argnums=0)


def in_loop_seconds(fn: Callable[..., object], args: tuple, calls: int = 20,
                    repeats: int = 5) -> tuple[float, tuple]:
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


def matmul_flops_per_second(n: int = 8192, dtype=jnp.bfloat16, iters: int = 10) -> float:
    """Measured dense matmul rate (FLOP/s) of an n x n x n product on random data."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), dtype)
    b = jax.random.normal(kb, (n, n), dtype)
    mm = jax.jit(lambda x, y: x @ y)
    return 2 * n**3 / median_seconds(lambda: mm(a, b), iters=iters)


def copy_bytes_per_second(num_bytes: int = 2 << 30, iters: int = 10) -> float:
    """Measured device copy bandwidth (bytes read + bytes written per second)."""
    x = jax.random.normal(jax.random.key(1), (num_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda v: v + 1.0)  # one read and one write of every element
    return 2 * num_bytes / median_seconds(lambda: copy(x), iters=iters)


def read_bytes_per_second(num_bytes: int = 2 << 30, iters: int = 10) -> float:
    """Measured device read bandwidth (bytes read per second by a sum over a large array)."""
    x = jax.random.normal(jax.random.key(2), (num_bytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    return num_bytes / median_seconds(lambda: total(x), iters=iters)


def device_description() -> str:
    dev = jax.devices()[0]
    return f"{dev.platform}:{getattr(dev, 'device_kind', 'unknown')} x{jax.device_count()}"


def write_results(path: str | None, name: str, rows: list[dict], baseline: dict) -> None:
    """Writes {"benchmark", "device", "jax", "baseline", "rows"} as JSON when a path is given."""
    if not path:
        return
    out = {"benchmark": name, "device": device_description(), "jax": jax.__version__,
           "python": platform.python_version(), "baseline": baseline, "rows": rows}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=2))


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
