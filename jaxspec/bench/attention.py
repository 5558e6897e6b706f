"""`jaxspec bench attention`: cache attention of a decode / verification step, the attention kernel
vs the dense path.

One layer's `cache_attention` for T new tokens per row over a bf16 KV cache of max_len slots,
whose rows are filled to a fraction of it (each row's length drawn uniformly in
[0.5, 1.5] x fill x max_len, capped). The dense XLA path (`xla_ms`) reads every slot; the Triton
attention kernel (`jaxspec.kernels.paged_attention_triton`, on the dense cache as one page per
row: `kernel_ms`) reads KV blocks up to each row's length; both are device times inside one
compiled loop, less the loop's own time per iteration (`loop_ms`, that of a call that does
nothing). `roofline` is the time to read the filled KV once at the device read bandwidth (a sum
over --read-bytes, measured in the same run), over the kernel's time.

--paged also lays the same keys and values out in shuffled pages of --page-size positions and
times `paged_attention` on them: its jnp reference (`paged_xla_ms`: a gather of every page of the
table, then the dense path) and the same kernel through the page table (`paged_triton_ms`, its
largest difference from the dense path and its roofline fraction). --heads-major then times the
kernel and its merge from the query rows over those pages laid out position-major
[P, page, Nk, D] (the pools' layout: a head's D values every Nk x D) and head-major
[P, Nk, page, D] (each head's positions of a page adjacent), with their roofline fractions.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.bench.timing import (
    add_error,
    add_fraction,
    empty_loop_seconds,
    in_loop_seconds,
    net_of_loop,
    print_table,
    read_bytes_per_second,
    write_results,
)
from jaxspec.kernels.attention_partials import causal_token_bits
from jaxspec.models.attention import (
    IMPL_ENV,
    cache_attention,
    kernel_attention_rows,
    kernel_impl,
    merge_kernel,
    query_rows_of,
    triton_kernel,
)
from jaxspec.models.config import ModelConfig
from jaxspec.models.paged import paged_attention


def attention_inputs(
    batch: int, t: int, heads: int, kv_heads: int, head_dim: int, max_len: int, fill: float, seed: int = 0
):
    """(q [B, T, Nq, D], k and v caches [B, S, Nk, D] in bf16, cache_len int32 [B])."""
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (batch, t, heads, head_dim), jnp.bfloat16)
    k = jax.random.normal(ks[1], (batch, max_len, kv_heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(ks[2], (batch, max_len, kv_heads, head_dim), jnp.bfloat16)
    rng = np.random.default_rng(seed)
    lengths = rng.uniform(0.5, 1.5, size=batch) * fill * max_len
    return q, k, v, jnp.asarray(np.clip(lengths, 1, max_len - t).astype(np.int32))


def paged_inputs(k: jax.Array, v: jax.Array, page_size: int, seed: int = 0):
    """(k_pool, v_pool [B * S / page_size, page_size, Nk, D], page_table int32 [B, S / page_size]):
    the caches k/v [B, S, Nk, D] cut into pages, shuffled over the pool."""
    batch, max_len = k.shape[:2]
    if max_len % page_size:
        raise ValueError(f"--max-len {max_len} must be a multiple of --page-size {page_size}")
    pages = batch * max_len // page_size
    order = np.random.default_rng(seed).permutation(pages)  # pool page i holds cache page order[i]
    table = np.empty(pages, np.int32)
    table[order] = np.arange(pages, dtype=np.int32)

    def pool(cache):
        return cache.reshape(pages, page_size, *cache.shape[2:])[order]

    return pool(k), pool(v), jnp.asarray(table.reshape(batch, max_len // page_size))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="jaxspec bench attention", description=__doc__)
    p.add_argument(
        "--model",
        nargs="+",
        default=["configs/models/qwen3-8b.json"],
        help="model config JSON(s) (HF config.json layout) giving the head shapes",
    )
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4], help="new tokens per row (T)")
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--fill", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--kernel-impl",
        choices=["triton", "triton-interpret"],
        default="triton",
        help="triton needs jax-triton on a GPU; triton-interpret runs the kernel in Triton's interpreter "
        "(any backend, slow; needs torch)",
    )
    p.add_argument(
        "--tune",
        action="store_true",
        help="also time the kernel and its merge over block sizes, warps, stages and splits at the last "
        "shape, inside one compiled loop",
    )
    p.add_argument(
        "--paged",
        action="store_true",
        help="also time paged_attention on the same KV in shuffled pages: its jnp reference and the kernel",
    )
    p.add_argument("--page-size", type=int, default=16, help="positions per page with --paged")
    p.add_argument(
        "--heads-major",
        action="store_true",
        help="with --paged, also the kernel from its query rows over the pages laid out position-major "
        "[P, page, Nk, D] (the pools' layout) and head-major [P, Nk, page, D]",
    )
    p.add_argument("--read-bytes", type=int, default=2 << 30, help="array size of the read-bandwidth baseline")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    read_rate = read_bytes_per_second(args.read_bytes)
    rows = []
    for model in args.model:
        cfg = ModelConfig.from_json(model)
        for batch in args.batch:
            for t in args.tokens:
                for fill in args.fill:
                    q, k, v, cache_len = attention_inputs(
                        batch, t, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, args.max_len, fill
                    )
                    try:
                        if kernel_impl(args.kernel_impl, IMPL_ENV, "cache attention", q, k, v) == "xla":
                            print(
                                f"bench attention: the attention kernel does not take {model}'s heads (Nq "
                                f"{cfg.num_heads}, Nk {cfg.num_kv_heads}, D {cfg.head_dim}) at T={t}",
                                file=sys.stderr,
                            )
                            return 2
                        times, outs, errors = time_impls(
                            cache_attention, (q, k, v, cache_len), ("xla", args.kernel_impl), args.iters
                        )
                        pages = paged_inputs(k, v, args.page_size) if args.paged or args.heads_major else None
                        paged = time_paged(q, pages, cache_len, args, outs["xla"], errors) if args.paged else {}
                        layouts = time_layouts(q, pages, cache_len, args, errors) if args.heads_major else {}
                    except ImportError as e:
                        print(f"bench attention: {e}", file=sys.stderr)
                        return 2
                    filled = int(jnp.sum(cache_len + t)) * 2 * cfg.num_kv_heads * cfg.head_dim * 2
                    rows.append(
                        {
                            "model": Path(model).stem,
                            "batch": batch,
                            "tokens": t,
                            "fill": fill,
                            "loop_ms": times["loop"] * 1e3,
                            "xla_ms": milliseconds(times["xla"]),
                            "kernel_ms": milliseconds(times[args.kernel_impl]),
                            "speedup": ratio(times["xla"], times[args.kernel_impl]),
                            "max_abs_diff": float(jnp.max(jnp.abs(outs["xla"] - outs[args.kernel_impl]))),
                            **paged,
                            **layouts,
                        }
                    )
                    for error in errors:
                        add_error(rows[-1], error)
                    shape = f"{Path(model).stem} batch {batch} T={t} fill {fill}"
                    kernel_seconds = {"roofline": times[args.kernel_impl]}
                    if args.paged:
                        kernel_seconds["paged_triton_roofline"] = paged.pop("paged_triton_seconds")
                    if args.heads_major:
                        kernel_seconds["positions_roofline"] = layouts.pop("positions_seconds")
                        kernel_seconds["heads_major_roofline"] = layouts.pop("heads_major_seconds")
                    for name, seconds in kernel_seconds.items():
                        add_fraction(
                            rows[-1], name, ratio(filled, seconds), read_rate, f"{name} {shape}: filled KV read rate"
                        )
                    print_table(rows[-1:], list(rows[-1]))
    print()
    print_table(rows, list(rows[0]))
    tuning = []
    if args.tune:
        tuning = tune_kernel(
            q, k, v, cache_len, cfg.num_heads // cfg.num_kv_heads, args.kernel_impl == "triton-interpret"
        )
    write_results(args.out, "attention", rows + tuning, {"read_bytes_per_second": read_rate, "max_len": args.max_len})
    return 0


def time_impls(fn, args: tuple, impls, iters: int) -> tuple[dict, dict, list[str]]:
    """({impl: seconds or None, "loop": seconds}, {impl: output float32}, errors) of
    fn(*args, impl=impl) for each impl: the device time of a call inside one compiled loop of
    `iters` calls (a call of ~0.1 ms timed alone would be mostly its dispatch), less the loop's own
    time per iteration ("loop", `empty_loop_seconds`: tens of microseconds on a GPU, as much as the
    call at a few rows). A time no longer than the loop's is noise: None, and `net_of_loop`'s
    message in errors."""
    times, outs, errors = {}, {}, []
    args = tuple(jnp.copy(x) for x in args)  # the loop donates them
    times["loop"], args = empty_loop_seconds(args, calls=iters, repeats=3)
    for impl in impls:
        call = functools.partial(fn, impl=impl)
        outs[impl] = jax.jit(call)(*args).astype(jnp.float32)
        seconds, args = in_loop_seconds(lambda *a, call=call: call(*a[:-1]), args, calls=iters, repeats=3)
        try:
            times[impl] = net_of_loop(seconds, times["loop"], f"attention {impl} at q {tuple(args[0].shape)}")
        except ValueError as err:
            times[impl] = None
            errors.append(str(err))
    return times, outs, errors


def time_paged(q, pages: tuple, cache_len, args: argparse.Namespace, dense_out, errors: list[str]) -> dict:
    """paged_xla_ms, paged_triton_ms, paged_triton_seconds and paged_triton_max_abs_diff (from the
    dense path's output dense_out, float32) for q over the caches' shuffled pages (k_pool, v_pool,
    page_table: `paged_inputs`); the timing's errors appended to `errors`."""
    k_pool, v_pool, table = pages
    impls = ("xla", args.kernel_impl)
    times, outs, paged_errors = time_impls(paged_attention, (q, k_pool, v_pool, table, cache_len), impls, args.iters)
    errors.extend(paged_errors)
    return {
        "paged_xla_ms": milliseconds(times["xla"]),
        "paged_triton_ms": milliseconds(times[args.kernel_impl]),
        "paged_triton_seconds": times[args.kernel_impl],
        "paged_triton_max_abs_diff": float(jnp.max(jnp.abs(outs[args.kernel_impl] - dense_out))),
    }


def time_layouts(q, pages: tuple, cache_len, args: argparse.Namespace, errors: list[str]) -> dict:
    """positions_ms and heads_major_ms (and their seconds): the kernel and its merge from the query
    rows (`kernel_attention_rows`, as the attention prologue leaves them) over the caches' shuffled
    pages (k_pool, v_pool, page_table: `paged_inputs`), laid out [P, page, Nk, D] and
    [P, Nk, page, D]; heads_major_max_abs_diff between the two; the timing's errors appended to
    `errors`."""
    t, nq = q.shape[1:3]
    k_pool, v_pool, table = pages
    group = nq // k_pool.shape[2]
    q_rows = query_rows_of(q, k_pool.shape[2], triton_kernel().query_rows(t * group))
    heads = tuple(pool.transpose(0, 2, 1, 3) for pool in (k_pool, v_pool))

    def attend(q_rows, k_pool, v_pool, k_heads, v_heads, table, cache_len, *, impl):
        pools = (k_heads, v_heads) if impl == "heads_major" else (k_pool, v_pool)
        return kernel_attention_rows(
            q_rows,
            *pools,
            table,
            cache_len,
            num_new=t,
            group=group,
            interpret=args.kernel_impl == "triton-interpret",
            heads_major=impl == "heads_major",
        )

    inputs = (q_rows, k_pool, v_pool, *heads, table, cache_len)
    times, outs, layout_errors = time_impls(attend, inputs, ("positions", "heads_major"), args.iters)
    errors.extend(layout_errors)
    return {
        "positions_ms": milliseconds(times["positions"]),
        "heads_major_ms": milliseconds(times["heads_major"]),
        "positions_seconds": times["positions"],
        "heads_major_seconds": times["heads_major"],
        "heads_major_max_abs_diff": float(jnp.max(jnp.abs(outs["heads_major"] - outs["positions"]))),
    }


def milliseconds(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


# (block_kv, num_warps, num_stages, splits relative to `default_splits`) that --tune times
TUNE_GRID = tuple(itertools.product((32, 64, 128), (4, 8), (2, 3), (0.5, 1.0, 2.0, 4.0, 8.0)))


def tune_kernel(q, k, v, cache_len, group: int, interpret: bool = False, grid=TUNE_GRID) -> list[dict]:
    """Device time of the attention kernel on the dense cache k/v [B, S, Nk, D] (one page per row)
    and the merge of its splits for these inputs (causal new tokens), inside one compiled loop
    less the loop's own time (`in_loop_seconds`, `empty_loop_seconds`: a call of ~0.1 ms timed
    alone would be mostly its dispatch), over the GPU parameters in `grid`, each setting once
    (relative splits that come to the same count are one)."""
    kernel = triton_kernel()
    merge_partials = merge_kernel().merge_partials
    b, t, nq, d = q.shape
    rows = kernel.query_rows(t * group)
    q_rows = jnp.zeros((b, nq // group, rows, d), q.dtype)
    bits = jnp.asarray(causal_token_bits(t, group, rows))  # as the engines' causal steps pass them
    table = jnp.arange(b, dtype=jnp.int32)[:, None]
    args = (q_rows, k, v, table, cache_len, bits)
    empty, args = empty_loop_seconds(args, calls=20, repeats=3)
    results, timed = [], set()
    for block_kv, num_warps, num_stages, relative in grid:
        grid_shape, _ = kernel.launch(q_rows, k, table, bits, num_new=t, block_kv=block_kv)
        splits = max(1, round(grid_shape[2] * relative))
        splits = kernel.launch(q_rows, k, table, bits, num_new=t, block_kv=block_kv, splits=splits)[0][2]
        if (block_kv, num_warps, num_stages, splits) in timed:  # relative splits that round alike
            continue
        timed.add((block_kv, num_warps, num_stages, splits))

        def call(
            q_rows,
            k,
            v,
            table,
            cache_len,
            bits,
            i,
            splits=splits,
            block_kv=block_kv,
            warps=num_warps,
            stages=num_stages,
        ):
            parts = kernel.paged_attention_partials(
                q_rows,
                k,
                v,
                table,
                cache_len,
                cache_len,
                bits,
                num_new=t,
                block_kv=block_kv,
                splits=splits,
                num_warps=warps,
                num_stages=stages,
                interpret=interpret,
            )
            return merge_partials(parts, num_new=t, group=group, dtype=q_rows.dtype, interpret=interpret)

        seconds, args = in_loop_seconds(call, args, calls=20, repeats=3)
        seconds = net_of_loop(seconds, empty, f"attention kernel {block_kv, num_warps, num_stages, splits}")
        results.append(
            {
                "kernel": "triton+merge",
                "batch": b,
                "tokens": t,
                "block_kv": block_kv,
                "num_warps": num_warps,
                "num_stages": num_stages,
                "splits": splits,
                "ms": seconds * 1e3,
                "loop_ms": empty * 1e3,
            }
        )
    print_table(results, list(results[0]))
    return results
