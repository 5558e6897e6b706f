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


def in_program(fn: Callable[..., object], calls: int) -> Callable[..., tuple[list, jax.Array]]:
    """A jitted program(x, *rest) -> (outputs, x') that runs y_i = fn(x_i, *rest, i) for
    i = 0 .. calls - 1 (i an int32 scalar, e.g. for `jax.random.fold_in`). x_{i+1} is x_i with its
    first element plus 0 * (the first element of y_i's first leaf): every call depends on the one
    before, so XLA neither merges calls nor overlaps them, and hoists none of their work, even work
    that does not depend on i. x is donated (the update is in place) and x' is the last x_i."""

    def program(x, *rest):
        outs = []
        for i in range(calls):
            out = fn(x, *rest, jnp.int32(i))
            first = jnp.ravel(jax.tree.leaves(out)[0])[0].astype(x.dtype)
            corner = (0,) * x.ndim
            x = jax.lax.dynamic_update_slice(x, x[corner].reshape((1,) * x.ndim) + 0 * first, corner)
            outs.append(out)
        return outs, x

    return jax.jit(program, donate_argnums=0)


def in_program_seconds(fn: Callable[..., object], x: jax.Array, rest: tuple = (), calls: int = 20,
                       repeats: int = 5) -> tuple[float, jax.Array]:
    """(seconds per call of `in_program(fn, calls)`, blocked on once per program (median over
    `repeats`), and x' to use in place of the donated x): the device time of a call as inside a
    compiled loop, with no host dispatch between calls (jitted calls dispatched back to back from
    Python can fall behind a device that takes ~0.1 ms per call). Each call also pays one
    one-element update of x."""
    program = in_program(fn, calls)
    times = []
    for i in range(repeats + 1):  # the first compiles
        start = time.perf_counter()
        outs, x = program(x, *rest)
        jax.block_until_ready((outs, x))
        times.append(time.perf_counter() - start)
        del outs
    return statistics.median(times[1:]) / calls, x


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
