"""`jaxspec bench attention`: cache attention of a decode / verification step, ragged kernel vs dense.

One layer's `cache_attention` for T new tokens per row over a bf16 KV cache of max_len slots,
whose rows are filled to a fraction of it (each row's length drawn uniformly in
[0.5, 1.5] x fill x max_len, capped). The dense XLA path reads every slot; the Pallas kernel
reads KV blocks up to each row's length. `roofline` is the time to read the filled KV once at
the device read bandwidth (a sum over --read-bytes, measured in the same run), over the kernel's time.

--paged also lays the same keys and values out in shuffled pages of --page-size positions and
times `paged_attention` on them: its jnp reference (`paged_xla_ms`: a gather of every page of the
table, then the dense path) and the paged kernels of --paged-backends, which read each row's
pages up to its length: "mosaic" (Pallas Mosaic GPU, `jaxspec.kernels.paged_attention_mosaic`)
and "triton" (the Triton language through jax-triton, `jaxspec.kernels.paged_attention_triton`),
each with its device time inside one compiled loop (`paged_<backend>_ms`), its largest difference
from the dense path and its roofline fraction, beside the dense path (`xla_ms`) and the Pallas (Triton backend) ragged
kernel on the dense cache (`kernel_ms`) of the same run.
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
    add_fraction,
    in_loop_seconds,
    median_seconds,
    print_table,
    read_bytes_per_second,
    write_results,
)
from jaxspec.kernels.ragged_attention import cache_attention_pallas, merge, new_token_bits, split_plan
from jaxspec.models.attention import cache_attention
from jaxspec.models.config import ModelConfig
from jaxspec.models.paged import kernel_applies, paged_attention

PAGED_BACKENDS = ("mosaic", "triton")  # the paged kernels --paged times


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
        choices=["pallas", "interpret"],
        default="pallas",
        help="interpret runs the kernel in Pallas interpret mode (any backend, slow)",
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
        help="also time paged_attention on the same KV in shuffled pages: jnp reference and the paged kernels "
        "of --paged-backends (interpret mode with --kernel-impl interpret)",
    )
    p.add_argument("--page-size", type=int, default=16, help="positions per page with --paged")
    p.add_argument(
        "--paged-backends",
        nargs="+",
        choices=PAGED_BACKENDS,
        default=list(PAGED_BACKENDS),
        help="paged kernels --paged times (triton needs jax-triton on a GPU, triton and torch in interpret mode)",
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
                    times, outs = {}, {}
                    for impl in ("xla", args.kernel_impl):
                        fn = jax.jit(functools.partial(cache_attention, impl=impl))
                        outs[impl] = fn(q, k, v, cache_len).astype(jnp.float32)
                        times[impl] = median_seconds(lambda: fn(q, k, v, cache_len), iters=args.iters)
                    err = float(jnp.max(jnp.abs(outs["xla"] - outs[args.kernel_impl])))
                    filled = int(jnp.sum(cache_len + t)) * 2 * cfg.num_kv_heads * cfg.head_dim * 2
                    rows.append(
                        {
                            "model": Path(model).stem,
                            "batch": batch,
                            "tokens": t,
                            "fill": fill,
                            "xla_ms": times["xla"] * 1e3,
                            "kernel_ms": times[args.kernel_impl] * 1e3,
                            "speedup": times["xla"] / times[args.kernel_impl],
                            "max_abs_diff": err,
                        }
                    )
                    add_fraction(
                        rows[-1],
                        "roofline",
                        filled / times[args.kernel_impl],
                        read_rate,
                        f"attention {Path(model).stem} batch {batch} T={t} fill {fill}: filled KV read rate",
                    )
                    if args.paged:
                        try:
                            paged_row = time_paged(
                                q,
                                k,
                                v,
                                cache_len,
                                args.page_size,
                                args.paged_backends,
                                args.kernel_impl,
                                args.iters,
                                outs["xla"],
                            )
                        except (ValueError, ImportError) as e:
                            print(
                                f"bench attention --paged: {e} ({model}: Nq {cfg.num_heads}, Nk {cfg.num_kv_heads}, "
                                f"D {cfg.head_dim}, T={t}, page size {args.page_size})",
                                file=sys.stderr,
                            )
                            return 2
                        for backend in args.paged_backends:
                            add_fraction(
                                paged_row,
                                f"paged_{backend}_roofline",
                                filled / (paged_row[f"paged_{backend}_ms"] * 1e-3),
                                read_rate,
                                f"paged attention ({backend}) {Path(model).stem} batch {batch} T={t} fill {fill}: "
                                "filled KV read rate",
                            )
                        rows[-1].update(paged_row)
                    print_table(rows[-1:], list(rows[-1]))
    print()
    print_table(rows, list(rows[0]))
    tuning = []
    if args.tune:
        tuning = tune_kernel(q, k, v, cache_len, cfg.num_heads // cfg.num_kv_heads, args.kernel_impl == "interpret")
    write_results(args.out, "attention", rows + tuning, {"read_bytes_per_second": read_rate, "max_len": args.max_len})
    return 0


def time_paged(
    q, k, v, cache_len, page_size: int, backends: list[str], kernel_impl: str, iters: int, dense_out
) -> dict:
    """paged_xla_ms, and for each backend paged_<backend>_ms and paged_<backend>_max_abs_diff (from
    the dense path's output dense_out, float32), for q and the caches k/v laid out in pages.
    ValueError naming a backend whose kernel does not take these shapes; ImportError where the
    Triton kernel's packages are missing."""
    k_pool, v_pool, table = paged_inputs(k, v, page_size)
    interpret = {"mosaic": "interpret", "triton": "triton-interpret"}
    impls = {backend: backend if kernel_impl == "pallas" else interpret[backend] for backend in backends}
    for backend, impl in impls.items():
        if not kernel_applies(q, k_pool, v_pool, impl):
            raise ValueError(f"the {backend} kernel does not take these heads")
    row = {}
    args = tuple(jnp.copy(x) for x in (q, k_pool, v_pool, table, cache_len))  # the loop donates them
    for name, impl in {"xla": "xla", **impls}.items():
        call = functools.partial(paged_attention, impl=impl)
        out = jax.jit(call)(*args).astype(jnp.float32)
        # device time inside one compiled loop: a call of ~0.1 ms timed alone would be mostly its dispatch
        seconds, args = in_loop_seconds(lambda *a: call(*a[:-1]), args, calls=iters, repeats=3)
        row[f"paged_{name}_ms"] = seconds * 1e3
        if name != "xla":
            row[f"paged_{name}_max_abs_diff"] = float(jnp.max(jnp.abs(out - dense_out)))
    return row


# (block_k, num_warps, num_stages, splits relative to `split_plan`'s default) that --tune times
TUNE_GRID = tuple(itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (0.5, 1.0, 2.0)))


def tune_kernel(q, k, v, cache_len, group: int, interpret: bool = False, grid=TUNE_GRID) -> list[dict]:
    """Device time of `cache_attention_pallas` and the merge of its splits for these inputs (causal
    new tokens), inside one compiled loop (`in_loop_seconds`: a call of ~0.1 ms timed alone would
    be mostly its dispatch), over the GPU parameters in `grid`."""
    b, t, nq, d = q.shape
    rows = max(16, 1 << (t * group - 1).bit_length())
    q_rows = jnp.zeros((b, nq // group, rows, d), q.dtype)
    bits = new_token_bits(jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t)), group, rows)
    default_splits, _ = split_plan(b, nq // group, k.shape[1])
    args = (q_rows, k, v, cache_len, bits)
    results = []
    for block_k, num_warps, num_stages, relative in grid:
        splits = max(1, round(default_splits * relative))

        def call(q_rows, k, v, cache_len, bits, i):
            return merge(
                cache_attention_pallas(
                    q_rows,
                    k,
                    v,
                    cache_len,
                    cache_len,
                    bits,
                    num_new=t,
                    block_k=block_k,
                    splits=splits,
                    num_warps=num_warps,
                    num_stages=num_stages,
                    interpret=interpret,
                )
            )

        seconds, args = in_loop_seconds(call, args, calls=20, repeats=3)
        results.append(
            {
                "kernel": "cache+merge",
                "batch": b,
                "tokens": t,
                "block_k": block_k,
                "num_warps": num_warps,
                "num_stages": num_stages,
                "splits": split_plan(b, nq // group, k.shape[1], block_k, splits)[0],
                "ms": seconds * 1e3,
            }
        )
    print_table(results, list(results[0]))
    return results
