"""`jaxspec bench projections`: a decode or verification step's weight projections, XLA's GEMMs
against the thin-matmul kernel, as fractions of the card's memory rate.

For each model config and each --rows M (the token rows of one step: B rows x T tokens), random
weights of the model's shapes and x [M, K] (--dtype, default bfloat16), each projection `extend` makes
(`jaxspec.models.projection`): the fused q/k/v [H, Nk, G + 2, D], the attention output [Nq, D, H]
(two contracted dims), the MLP's gate and up [H, 2, F] with its SwiGLU, the down projection [F, H]
and the LM head (the tied embedding [V, H] read transposed, float32 logits). Each runs --iters
times inside one compiled loop (`timing.in_loop`: each call depends on the one before, no dispatch
between calls), the empty loop's time taken off. A step must read each weight once whatever M is,
so `<form>_roofline` = the weight's bytes per second over the card's memory rate measured in the
same run inside one compiled loop: the faster of a copy (bytes read + written per second) and a
read (a sum over the array), since a projection only reads and a card can read a little faster
than it copies (an H100's 8B gate/up weights at 1.004 of its copy rate). The loop also sums the
output, which a fraction counts against it. A fraction above 1.0 is an error row, never a result.
`max_rel_diff`: the kernel's largest difference from XLA's after one call, relative to max(1, |XLA's|).
A mixture-of-experts config's MLP is its experts instead (`expert_projections`): --rows tokens
routed uniformly at random to their top-k experts, the grouped matmuls a step runs without the
expert kernel against `expert_matmul`, the roofline over the bytes of the experts the rows touch.
--sweep also times the kernel over a grid of tiles (`SWEEP`: BLOCK_N x BLOCK_K x split-K, then
warps and stages around the best) and reports the best tiles, their time and roofline: the data for
`thin_matmul_triton.default_tiles`. --interpret runs the kernel in Triton's interpreter (any
backend, slow: a smoke test).
--profile times each call instead by the device time of its kernels in a profiler trace (XLA's
command buffers off, `kernel_trace.traced_seconds`): a call of a few microseconds is shorter than
a loop iteration's own cost on an H100 (~15 us), which hides it from the compiled loop's timing.
The traced calls take copies of the weights in turn (`kernel_trace.rotated_copies`, 256 MiB of
them): a 17-50 MB weight read by back-to-back calls otherwise partly stays in the card's 50 MB L2
(lease SS: read rates up to 1.3x the in-loop copy's).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxspec.bench.kernel_trace import TRACED_MODULE, rotated_copies, set_dump_flags, traced_seconds
from jaxspec.bench.timing import (
    add_fraction,
    copy_bytes_per_second,
    empty_loop_seconds,
    in_loop_seconds,
    net_of_loop,
    print_table,
    read_bytes_per_second,
    write_results,
)
from jaxspec.kernels import expert_matmul_triton as experts_kernel
from jaxspec.kernels import thin_matmul_triton as kernel
from jaxspec.models.config import ModelConfig
from jaxspec.models.projection import project, swiglu

DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}
SWEEP = {
    "block_n": (16, 32, 64, 128),
    "block_k": (64, 128, 256, 512),
    "split_k": (1, 4),
    "num_warps": (2, 4, 8),
    "num_stages": (3, 4, 5),
}


def projections(cfg: ModelConfig) -> dict[str, dict]:
    """name -> {"x": x's shape per token row, "w": the weight's shape, "equation", "transpose",
    "swiglu", "out": the output dtype, None for x's} for each projection of a step of `cfg`."""
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nk, group = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    tied = cfg.tie_word_embeddings
    base = dict(transpose=False, swiglu=False, out=None)
    return {
        "qkv": base | dict(x=(h,), w=(h, nk, group + 2, d), equation="mc,cngd->mngd"),
        "o": base | dict(x=(cfg.num_heads, d), w=(cfg.num_heads, d, h), equation="mnd,ndh->mh"),
        **(
            {}
            if cfg.num_experts
            else {
                "gate_up_swiglu": base | dict(x=(h,), w=(h, 2, f), equation=None, swiglu=True),
                "down": base | dict(x=(f,), w=(f, h), equation="mf,fh->mh"),
            }
        ),
        "lm_head": base
        | dict(
            x=(h,),
            w=(cfg.vocab_size, h) if tied else (h, cfg.vocab_size),
            equation="mh,hv->mv",
            transpose=tied,
            out=jnp.float32,
        ),
    }


def expert_projections(cfg: ModelConfig) -> dict[str, dict]:
    """name -> {"x": a row's shape, "w": one expert weight's shape, "swiglu"} for a sparse layer of
    `cfg` (none for a dense model): the experts' gate and up with the SwiGLU, and their down
    projection times each row's routing weight."""
    if not cfg.num_experts:
        return {}
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    return {
        "experts_gate_up_swiglu": dict(x=(h,), w=(cfg.num_experts, h, i), swiglu=True),
        "experts_down": dict(x=(i,), w=(cfg.num_experts, i, h), swiglu=False),
    }


def time_experts(name: str, spec: dict, cfg: ModelConfig, tokens: int, args, memory_rate: float) -> dict:
    """One expert projection at `tokens` token rows routed uniformly at random to top-k experts:
    the grouped matmuls a step runs without the expert kernel (`moe.grouped_matmul` with the
    implementation "auto" picks there; the gather of the rows, or the weighting and the scatter
    back to token order) against `expert_matmul`; the roofline counts the touched experts' bytes."""
    from jaxspec.models import moe

    keys = jax.random.split(jax.random.key(0), 5)
    dtype, top_k, experts = DTYPES[args.dtype], cfg.num_experts_per_tok, cfg.num_experts
    picks = jax.lax.top_k(jax.random.uniform(keys[0], (tokens, experts)), top_k)[1].reshape(-1)
    ids, order = jax.lax.sort((picks, jnp.arange(picks.size, dtype=jnp.int32)), num_keys=1, is_stable=True)
    sizes = jnp.bincount(picks, length=experts).astype(jnp.int32)
    factor = jax.random.uniform(keys[1], (tokens * top_k,)).astype(dtype)
    rows = tokens * top_k
    impl = moe.resolve_impl("auto", True, work=experts * rows)
    interpret = args.interpret
    weights = [
        (jax.random.normal(k, spec["w"]) / spec["w"][1] ** 0.5).astype(dtype) for k in keys[2 : 2 + 1 + spec["swiglu"]]
    ]
    if spec["swiglu"]:
        x = jax.random.normal(keys[4], (tokens, *spec["x"]), dtype)

        def xla(x, gate, up):
            picked = x[order // top_k]
            return jax.nn.silu(moe.grouped_matmul(picked, gate, sizes, impl)) * moe.grouped_matmul(
                picked, up, sizes, impl
            )

        def fused(x, gate, up):
            return experts_kernel.expert_matmul(x, gate, ids, source=order, repeat=top_k, up=up, interpret=interpret)
    else:
        x = jax.random.normal(keys[4], (rows, *spec["x"]), dtype)

        def xla(x, down):
            out = moe.grouped_matmul(x, down, sizes, impl) * factor[order][:, None]
            return jnp.zeros_like(out).at[order].set(out)

        def fused(x, down):
            return experts_kernel.expert_matmul(x, down, ids, dest=order, scale=factor, interpret=interpret)

    touched = int(jnp.sum(sizes > 0))
    weight_bytes = touched * sum(math.prod(w.shape[1:]) * w.dtype.itemsize for w in weights)
    arrays = (x, *weights)
    want = jax.jit(xla)(*arrays).astype(jnp.float32)
    got = jax.jit(fused)(*arrays).astype(jnp.float32)
    row = {"projection": name, "rows": tokens, "weight_mb": weight_bytes / 1e6, "experts_touched": touched}
    row["grouped_impl"] = impl
    row["max_rel_diff"] = float(jnp.max(jnp.abs(got - want) / jnp.maximum(1.0, jnp.abs(want))))
    timer, arrays = timer_for(arrays, args)
    for form, fn in {"xla": xla, "kernel": fused}.items():
        seconds, arrays = timer(fn, arrays)
        row[f"{form}_us"] = seconds * 1e6
    row["speedup"] = row["xla_us"] / row["kernel_us"]
    for form in ("xla", "kernel"):
        what = f"{name} at {tokens} tokens, {form}: touched experts' read rate"
        add_fraction(row, f"{form}_roofline", weight_bytes / (row[f"{form}_us"] * 1e-6), memory_rate, what)
    return row


def call(spec: dict, impl: str, tiles: kernel.Tiles | None = None):
    """fn(x, w) of one projection through `impl` ("xla", "triton", "triton-interpret"), or with
    explicit tiles the kernel itself ("triton-interpret": in Triton's interpreter)."""
    preferred = spec["out"]
    if tiles is not None:
        return functools.partial(
            kernel.thin_matmul,
            contract=len(spec["x"]),
            transpose=spec["transpose"],
            swiglu=spec["swiglu"],
            out_dtype=preferred,
            tiles=tiles,
            interpret=impl == "triton-interpret",
        )
    if spec["swiglu"]:
        return functools.partial(swiglu, impl=impl)
    return functools.partial(
        project, spec["equation"], impl=impl, transpose=spec["transpose"], preferred_element_type=preferred
    )


def loop_seconds(fn, args: tuple, empty: float, iters: int, repeats: int) -> tuple[float, tuple]:
    """(device seconds of one fn(*args) inside a compiled loop, less `empty`, the empty loop's per
    iteration (`empty_loop_seconds`); the arrays to use in place of the donated `args`)."""
    seconds, args = in_loop_seconds(lambda *a: fn(*a[:-1]), args, calls=iters, repeats=repeats)
    return net_of_loop(seconds, empty, "projection"), args


def timer_for(arrays: tuple, args: argparse.Namespace):
    """(timer, arrays): timer(fn, arrays) -> (seconds per call of fn(*arrays), the arrays to use
    next), by the device time of a profiler trace (--profile) or inside a compiled loop less the
    empty loop's at these arrays' shapes (timed here: the arrays it returns replace the donated)."""
    if args.profile:
        in_turn = rotated_copies(arrays)  # copies of the weights: each call reads its weights from memory

        def traced(fn, arrays):
            return traced_seconds(fn, in_turn, Path(tempfile.mkdtemp(dir=args.work))), arrays

        return traced, arrays
    empty, arrays = empty_loop_seconds(arrays, args.iters, args.repeats)
    return (lambda fn, arrays: loop_seconds(fn, arrays, empty, args.iters, args.repeats)), arrays


def time_projection(name: str, spec: dict, rows: int, args: argparse.Namespace, memory_rate: float) -> dict:
    kx, kw = jax.random.split(jax.random.key(0))
    fan_in = math.prod(spec["x"])
    dtype = DTYPES[args.dtype]
    x = jax.random.normal(kx, (rows, *spec["x"]), dtype)
    w = (jax.random.normal(kw, spec["w"]) / fan_in**0.5).astype(dtype)
    weight_bytes = w.size * w.dtype.itemsize
    impl = "triton-interpret" if args.interpret else "triton"
    forms = {"xla": call(spec, "xla"), "kernel": call(spec, impl)}
    want = jax.jit(forms["xla"])(x, w).astype(jnp.float32)
    got = jax.jit(forms["kernel"])(x, w).astype(jnp.float32)
    row = {"projection": name, "rows": rows, "weight_mb": weight_bytes / 1e6}
    row["max_rel_diff"] = float(jnp.max(jnp.abs(got - want) / jnp.maximum(1.0, jnp.abs(want))))
    timer, arrays = timer_for((x, w), args)
    for form, fn in forms.items():
        seconds, arrays = timer(fn, arrays)
        row[f"{form}_us"] = seconds * 1e6
    row["speedup"] = row["xla_us"] / row["kernel_us"]
    if args.sweep:
        row |= sweep(spec, arrays, timer, args)
    for form in ("xla", "kernel", "best"):
        if f"{form}_us" in row:
            what = f"{name} at {rows} rows, {form}: weight read rate"
            add_fraction(row, f"{form}_roofline", weight_bytes / (row[f"{form}_us"] * 1e-6), memory_rate, what)
    return row


def sweep(spec: dict, arrays: tuple, timer, args: argparse.Namespace) -> dict:
    """{"best_tiles", "best_us", "swept_us"}: the kernel's fastest tiles of SWEEP at this shape
    (BLOCK_N x BLOCK_K x split_k at 4 warps and 4 stages, then warps x stages at the best of those),
    shared memory within SHARED_BYTES; tiles written "BLOCK_M x BLOCK_N x BLOCK_K x warps x stages x
    split_k"; swept_us every timed tiles' microseconds (the data for a rule of `default_tiles`)."""
    rows, itemsize = arrays[0].shape[0], arrays[0].dtype.itemsize
    block_m = kernel.default_tiles(rows, 16, 16).block_m

    def fits(t: kernel.Tiles) -> bool:
        return kernel.shared_bytes(t, itemsize, swiglu=spec["swiglu"]) <= kernel.SHARED_BYTES

    def timed(candidates) -> tuple[float, kernel.Tiles]:
        nonlocal arrays
        impl, results = "triton-interpret" if args.interpret else "triton", []
        for tiles in filter(fits, candidates):
            seconds, arrays = timer(call(spec, impl, tiles), arrays)
            results.append((seconds, tiles))
            swept["x".join(map(str, tiles))] = round(seconds * 1e6, 3)
        return min(results)

    swept: dict[str, float] = {}

    blocks = itertools.product(SWEEP["block_n"], SWEEP["block_k"], SWEEP["split_k"])
    _, best = timed(kernel.Tiles(block_m, n, k, split_k=split) for n, k, split in blocks)
    settings = itertools.product(SWEEP["num_warps"], SWEEP["num_stages"])
    seconds, best = timed(best._replace(num_warps=wp, num_stages=st) for wp, st in settings)
    return {"best_tiles": "x".join(map(str, best)), "best_us": seconds * 1e6, "swept_us": swept}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="jaxspec bench projections", description=__doc__)
    p.add_argument(
        "--model",
        nargs="+",
        default=["configs/models/qwen3-1.7b.json", "configs/models/qwen3-8b.json"],
        help="model config JSON(s) (HF config.json layout)",
    )
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 256], help="token rows M of a step")
    p.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="these projections alone (qkv o gate_up_swiglu down lm_head experts_gate_up_swiglu experts_down)",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--iters", type=int, default=100, help="calls per compiled loop")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of the loop (median)")
    p.add_argument("--sweep", action="store_true", help="also time the kernel over SWEEP's tiles")
    p.add_argument("--copy-bytes", type=int, default=2 << 30, help="array size of the bandwidth baselines")
    p.add_argument("--interpret", action="store_true", help="the kernel in Triton's interpreter (smoke test)")
    p.add_argument("--profile", action="store_true", help="time calls by their kernels' device time in a trace")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.work = tempfile.mkdtemp(prefix="jaxspec-projections-") if args.profile else None
    if args.profile:
        set_dump_flags(Path(args.work) / "hlo", TRACED_MODULE, "bench projections --profile")

    copy_rate, read_rate = copy_bytes_per_second(args.copy_bytes), read_bytes_per_second(args.copy_bytes)
    memory_rate = max(copy_rate, read_rate)
    rows = []
    for model in args.model:
        cfg = ModelConfig.from_json(model)
        for name, spec in {**projections(cfg), **expert_projections(cfg)}.items():
            if args.only and name not in args.only:
                continue
            for m in args.rows:
                if name.startswith("experts_"):
                    row = time_experts(name, spec, cfg, m, args, memory_rate)
                else:
                    row = time_projection(name, spec, m, args, memory_rate)
                rows.append({"model": Path(model).stem} | row)
                print_table(rows[-1:], [c for c in rows[-1] if c != "swept_us"])
    print()
    print_table(rows, list(dict.fromkeys(column for row in rows for column in row if column != "swept_us")))
    timing = "device time in a profiler trace" if args.profile else "in a compiled loop, less the empty loop"
    rates = {"copy_bytes_per_second": copy_rate, "read_bytes_per_second": read_rate, "memory_rate": memory_rate}
    write_results(args.out, "projections", rows, rates | {"timing": timing})
    return 0
