"""GPU check and timing of a mixture-of-experts layer's grouped matmuls: the Triton kernel
(`jaxspec.kernels.grouped_matmul`, through jax-triton) against `jax.lax.ragged_dot` and a dense
matmul of the same useful FLOPs, and, with --tokamax, tokamax's `ragged_dot` implementations (the
well-kept kernel library the project would adopt where it is faster: `pip install tokamax`).

    pytest -m gpu tests/gpu/test_moe.py                  # the check, as tests
    python3 -m tests.gpu.check_moe [--rows 512 2048 8192 32768] [--block-m 64 ...]
    python3 -m tests.gpu.check_moe --grad     # forward + backward (dX, dW) of each
    python3 -m tests.gpu.check_moe --tiny     # CPU smoke run: tiny shapes, Triton's interpreter
    python3 -m tests.gpu.check_moe --grad --tokamax mosaic triton   # tokamax's kernels beside ours

Shapes: Qwen3-30B-A3B's experts (E=128, top-8, hidden D=2048, expert width F=768) and small_moe's
(E=16, D=1024, F=1536), each projection direction (D -> F as gate/up, F -> D as down), rows = the
sorted token-expert assignments (tokens x top-k: 64 x 8 = 512 is a decode step of 64 rows). Tokens
pick their experts uniformly at random. bf16 operands, float32 accumulation.

Per case: milliseconds per call inside a compiled loop (`in_loop_seconds`), useful TFLOP/s
(2 x rows x K x N / time), the compiled program's temporary memory, and the kernel's max error
relative to ragged_dot's largest output. With --grad, each call is a forward and backward pass
(`moe.grouped_matmul`'s gradient: the kernel on transposed experts for dX, the grouped x.T @ dY
kernel for dW; the dense row: a matmul and its gradient), useful FLOPs 3x, the error the worst of
the output, dX and dW. A tokamax implementation (row `tokamax-<impl>`) is checked as the kernel is;
one that cannot run here (tokamax raises, e.g. NotImplementedError off its platform, or it does not
lower on this JAX) prints why in its row and is left out. Exits non-zero when the kernel or a
tokamax implementation that ran disagrees with ragged_dot.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.bench.timing import in_loop_seconds
from jaxspec.bench.tokamax_kernels import IMPLEMENTATIONS, load_tokamax
from jaxspec.kernels.grouped_matmul import grouped_matmul_triton
from jaxspec.models.moe import grouped_matmul

EXPERT_SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "small_moe": (16, 8, 1024, 1536)}  # E, top-k, D, F
ROWS = (64 * 8, 256 * 8, 1024 * 8, 32768)
TINY_SHAPES = {"tiny": (8, 2, 64, 48)}
TINY_ROWS = (16, 96)
TOLERANCE = 2.0**-7  # two bf16 roundings of the output, relative to its largest entry


def routed_group_sizes(key: jax.Array, rows: int, num_experts: int, top_k: int) -> jax.Array:
    """int32 [E]: how many of rows // top_k tokens (each picking top_k distinct experts uniformly
    at random) go to each expert; sums to rows (rows a multiple of top_k)."""
    tokens = rows // top_k
    _, experts = jax.lax.top_k(jax.random.uniform(key, (tokens, num_experts)), top_k)
    return jnp.bincount(experts.reshape(-1), length=num_experts).astype(jnp.int32)


def tokamax_ragged_dot(implementation: str):
    """fn(x, w, group_sizes) -> tokamax's ragged_dot with that implementation (`IMPLEMENTATIONS`)."""
    tokamax = load_tokamax()
    return lambda x, w, s: tokamax.ragged_dot(x, w, s, implementation=implementation)


def impls(interpret: bool, tiles: dict, grad: bool, tokamax: tuple[str, ...] = ()) -> dict:
    """name -> fn(x, w, group_sizes, dense_w) -> output, or with grad (output, dX, dW) of the
    output's sum weighted by a fixed probe (the kernel's gradient with default tiles); tokamax: its
    ragged_dot implementations to add, each as `tokamax-<implementation>`."""
    extra = {f"tokamax-{impl}": tokamax_ragged_dot(impl) for impl in tokamax}
    if grad:
        kernel = "triton-interpret" if interpret else "triton"

        def with_grad(f, dense_weights: bool = False):
            def fn(x, w, s, d):
                out, vjp = jax.vjp(lambda x, w: f(x, w, s), x, d if dense_weights else w)
                probe = jnp.cos(jnp.arange(out.shape[1], dtype=jnp.float32)).astype(out.dtype)
                return (out, *vjp(jnp.broadcast_to(probe, out.shape)))

            return fn

        return {
            "kernel": with_grad(lambda x, w, s: grouped_matmul(x, w, s, kernel)),
            "ragged_dot": with_grad(lambda x, w, s: jax.lax.ragged_dot(x, w, s)),
            "dense": with_grad(lambda x, w, s: jnp.dot(x, w), dense_weights=True),
            **{name: with_grad(f) for name, f in extra.items()},
        }
    kernel = functools.partial(grouped_matmul_triton, interpret=interpret, **tiles)
    return {
        "kernel": lambda x, w, s, d: kernel(x, w, s),
        "ragged_dot": lambda x, w, s, d: jax.lax.ragged_dot(x, w, s),
        "dense": lambda x, w, s, d: jnp.dot(x, d),
        **{name: (lambda x, w, s, d, f=f: f(x, w, s)) for name, f in extra.items()},
    }


def temp_bytes(fn, *args) -> float:
    """The compiled program's temporary memory in bytes (nan where the backend does not say)."""
    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    return float(getattr(stats, "temp_size_in_bytes", np.nan)) if stats is not None else np.nan


def rel_err(got, want) -> float:
    """Worst over matching outputs of max |got - want| / max |want|."""
    return max(
        float(
            np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max()
            / np.abs(np.asarray(b, np.float32)).max()
        )
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    )


def run_case(
    name: str, shape: tuple, rows: int, direction: str, fns: dict, calls: int, repeats: int, grad: bool
) -> bool:
    num_experts, top_k, hidden, width = shape
    k, n = (hidden, width) if direction == "up" else (width, hidden)
    keys = jax.random.split(jax.random.key(rows + k), 3)
    sizes = routed_group_sizes(keys[0], rows, num_experts, top_k)
    x = jax.random.normal(keys[1], (rows, k), jnp.bfloat16)
    w = (jax.random.normal(keys[2], (num_experts, k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
    dense_w = w[0]
    want = jax.jit(fns["ragged_dot"])(x, w, sizes, dense_w)
    flops = (6.0 if grad else 2.0) * rows * k * n
    ok = True
    for impl, fn in fns.items():
        row = f"{name:>14} {direction:>4} {num_experts:4d} {rows:6d} {k:5d} {n:5d} {impl:>14}"
        error = " " * 9
        if impl not in ("ragged_dot", "dense"):
            try:
                got = jax.jit(fn)(x, w, sizes, dense_w)
            except Exception as e:  # a tokamax implementation that cannot run on this platform or JAX
                if impl == "kernel":
                    raise
                print(f"{row} did not run: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
                continue
            err = rel_err(got, want)
            error = f"{err:9.2e}"
            if not (err < TOLERANCE and all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(got))):
                print(f"MISMATCH {name} {direction} rows={rows}: {impl} vs ragged_dot {err:.3e} >= {TOLERANCE:.3e}")
                ok = False
        memory = temp_bytes(fn, x, w, sizes, dense_w)
        seconds, (x, w, sizes, dense_w) = in_loop_seconds(
            lambda *a, fn=fn: fn(*a[:4]), (x, w, sizes, dense_w), calls=calls, repeats=repeats
        )
        print(f"{row} {seconds * 1e3:9.3f} {flops / seconds / 1e12:8.2f} {memory / 1e6:10.1f} {error}", flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes, kernel in Triton's interpreter (any backend)")
    p.add_argument("--grad", action="store_true", help="time and check forward + backward passes")
    p.add_argument("--rows", type=int, nargs="+", help=f"sorted assignment rows (default {ROWS})")
    p.add_argument("--shapes", nargs="+", choices=sorted(EXPERT_SHAPES), help="expert shapes (default all)")
    p.add_argument("--calls", type=int, default=20, help="calls per compiled timing loop")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of the loop (median)")
    p.add_argument(
        "--tokamax",
        nargs="+",
        default=(),
        choices=IMPLEMENTATIONS,
        help="tokamax ragged_dot implementations",
    )
    for tile in ("block_m", "block_n", "block_k", "num_warps", "num_stages"):
        p.add_argument("--" + tile.replace("_", "-"), type=int, help="kernel tuning (default: the kernel's)")
    args = p.parse_args(argv)
    if args.tiny:
        shapes, rows, calls, repeats = TINY_SHAPES, args.rows or TINY_ROWS, 2, 1
    else:
        shapes = {s: EXPERT_SHAPES[s] for s in args.shapes or sorted(EXPERT_SHAPES)}
        rows, calls, repeats = args.rows or ROWS, args.calls, args.repeats
    tiles = {
        t: getattr(args, t)
        for t in ("block_m", "block_n", "block_k", "num_warps", "num_stages")
        if getattr(args, t) is not None
    }
    if args.grad and tiles:
        raise SystemExit("--grad times the gradient with the kernels' default tiles: drop the tile options")
    fns = impls(interpret=args.tiny, tiles=tiles, grad=args.grad, tokamax=tuple(args.tokamax))
    print(
        f"device: {jax.devices()[0].device_kind}; {'forward + backward' if args.grad else 'forward'}; "
        f"kernel tiles: {tiles or 'default'}"
    )
    print(
        f"{'shape':>14} {'proj':>4} {'E':>4} {'rows':>6} {'K':>5} {'N':>5} {'impl':>14} {'ms':>9} "
        f"{'TFLOP/s':>8} {'temp MB':>10} {'rel err':>9}"
    )
    ok = True
    for name, shape in shapes.items():
        for r in rows:
            if r % shape[1]:
                raise SystemExit(f"--rows {r} is not a multiple of {name}'s top-k {shape[1]}")
            for direction in ("up", "down"):
                ok &= run_case(name, shape, r, direction, fns, calls, repeats, args.grad)
    also = ", and so does tokamax's wherever it ran" if args.tokamax else ""
    print(f"OK: the kernel equals ragged_dot{also}" if ok else "MISMATCH: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
