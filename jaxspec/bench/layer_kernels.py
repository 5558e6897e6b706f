"""`jaxspec bench layer-kernels`: the decoder layer's fused kernels against the XLA pieces they replace.

For a model config and each batch B x new tokens T of a decode or verification step (random
inputs of the model's shapes, --dtype):

* the residual norm (`jaxspec.kernels.residual_norm_triton`): x + delta and the RMS norm of the sum
  over [B * T, H], against `residual_norm_reference` under XLA;
* the attention prologue (`jaxspec.kernels.attention_prologue_triton`): from the fused q/k/v GEMM's
  output [B, T, Nk, G + 2, D] (the model's biases and q/k norms) the query rows and the new keys and
  values written into shuffled pages of --page-size positions, each row's cache --context positions
  long, against `attention_prologue_reference` under XLA.

Each runs --iters times inside one compiled loop (`timing.looped`: the device's time, no dispatch
between calls), every call on the one before's outputs (the residual stream and its norm; the pools
the keys and values were written into, and the projection, which takes 0 x the sum of the query
rows so that no part of a call is loop-invariant: that sum is part of both timings). Reported per
call in microseconds, loop included, with the kernel's speedup over XLA's pieces and the largest
difference of their outputs after one call (the prologue's: the query rows and the written keys).
--interpret runs the kernels in Triton's interpreter (any backend, slow: a smoke test).
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.bench.timing import looped_seconds, print_table, write_results
from jaxspec.kernels.attention_prologue_triton import attention_prologue
from jaxspec.kernels.paged_attention_triton import query_rows
from jaxspec.kernels.residual_norm_triton import residual_norm
from jaxspec.models.attention_prologue import attention_prologue_reference
from jaxspec.models.config import ModelConfig
from jaxspec.models.residual_norm import residual_norm_reference
from jaxspec.models.rope import rope_tables

DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


def norm_inputs(cfg: ModelConfig, rows: int, dtype, seed: int = 0):
    """(x, delta, weight): a residual stream and a sublayer's output [rows, H], the norm's weight [H]."""
    kx, kd, kw = jax.random.split(jax.random.key(seed), 3)
    h = cfg.hidden_size
    weight = (1 + 0.1 * jax.random.normal(kw, (h,))).astype(dtype)
    return 4 * jax.random.normal(kx, (rows, h)).astype(dtype), jax.random.normal(kd, (rows, h)).astype(dtype), weight


def time_norm(cfg: ModelConfig, rows: int, dtype, iters: int, repeats: int, interpret: bool) -> dict:
    """{"norm_xla_us", "norm_kernel_us", "norm_speedup", "norm_max_diff"} for [rows, H]."""
    x, delta, weight = norm_inputs(cfg, rows, dtype)
    eps = cfg.rms_norm_eps
    kernel = functools.partial(residual_norm, eps=eps, interpret=interpret)
    reference = functools.partial(residual_norm_reference, eps=eps)
    got, want = jax.jit(kernel)(x, delta, weight), jax.jit(reference)(x, delta, weight)
    diff = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))) for g, w in zip(got, want))

    def step(fn):
        return lambda state, weight: fn(*state, weight)  # (x, h) -> (x + h, norm(x + h))

    times, state = {}, (x, delta)
    for name, fn in (("xla", reference), ("kernel", kernel)):
        times[name], state = looped_seconds(step(fn), state, weight, calls=iters, repeats=repeats)
    return _row("norm", times, diff)


def prologue_inputs(cfg: ModelConfig, batch: int, new: int, context: int, page_size: int, dtype, seed: int = 0):
    """(state, invariants) of `prologue_step`: state (proj [B, T, Nk, G + 2, D], k_pool, v_pool) and
    invariants (bias, q_norm, k_norm, cos, sin, cache_len, page_table), the pages shuffled."""
    nk, d, group = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    per_row = -(-(context + new) // page_size)
    num_pages = batch * per_row
    ks = iter(jax.random.split(jax.random.key(seed), 6))
    rng = np.random.default_rng(seed)
    table = jnp.asarray(rng.permutation(num_pages).reshape(batch, per_row), jnp.int32)
    cache_len = jnp.full((batch,), context, jnp.int32)
    cos, sin = rope_tables(cfg, cache_len[:, None] + jnp.arange(new, dtype=jnp.int32)[None, :])
    pool_shape = (num_pages, page_size, nk, d)
    state = (
        jax.random.normal(next(ks), (batch, new, nk, group + 2, d)).astype(dtype),
        jax.random.normal(next(ks), pool_shape).astype(dtype),
        jax.random.normal(next(ks), pool_shape).astype(dtype),
    )
    bias = (0.1 * jax.random.normal(next(ks), (nk, group + 2, d))).astype(dtype) if cfg.attention_bias else None
    norms = [(1 + 0.1 * jax.random.normal(next(ks), (d,))).astype(dtype) if cfg.qk_norm else None for _ in "qk"]
    return state, (bias, *norms, cos, sin, cache_len, table)


def prologue_step(fn, state, *invariants):
    """One call of the prologue `fn` on state (proj, k_pool, v_pool): the next state."""
    proj, k_pool, v_pool = state
    bias, q_norm, k_norm, cos, sin, cache_len, table = invariants
    q_rows, k_pool, v_pool = fn(proj, bias, q_norm, k_norm, cos, sin, cache_len, table, k_pool, v_pool)
    touched = (0 * jnp.sum(q_rows.astype(jnp.float32))).astype(proj.dtype)
    return proj.at[0, 0, 0, 0, 0].add(touched), k_pool, v_pool


def time_prologue(cfg: ModelConfig, batch: int, new: int, args: argparse.Namespace) -> dict:
    """{"prologue_xla_us", "prologue_kernel_us", "prologue_speedup", "prologue_max_diff"}."""
    dtype = DTYPES[args.dtype]
    state, invariants = prologue_inputs(cfg, batch, new, args.context, args.page_size, dtype)
    settings = dict(rows=query_rows(new * cfg.num_heads // cfg.num_kv_heads), eps=cfg.rms_norm_eps)
    kernel = functools.partial(attention_prologue, **settings, interpret=args.interpret)
    reference = functools.partial(attention_prologue_reference, **settings)
    bias, q_norm, k_norm, cos, sin, cache_len, table = invariants
    call = (state[0], bias, q_norm, k_norm, cos, sin, cache_len, table, *state[1:])
    got, want = jax.jit(kernel)(*call), jax.jit(reference)(*call)
    written = jnp.any(want[1] != state[1], axis=(-2, -1))
    diff = max(
        float(jnp.max(jnp.abs(got[0].astype(jnp.float32) - want[0].astype(jnp.float32)))),
        float(jnp.max(jnp.abs(got[1][written].astype(jnp.float32) - want[1][written].astype(jnp.float32)))),
    )
    times = {}
    for name, fn in (("xla", reference), ("kernel", kernel)):
        body = functools.partial(prologue_step, fn)
        times[name], state = looped_seconds(body, state, *invariants, calls=args.iters, repeats=args.repeats)
    return _row("prologue", times, diff)


def _row(name: str, times: dict, diff: float) -> dict:
    return {
        f"{name}_xla_us": times["xla"] * 1e6,
        f"{name}_kernel_us": times["kernel"] * 1e6,
        f"{name}_speedup": times["xla"] / times["kernel"],
        f"{name}_max_diff": diff,
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="jaxspec bench layer-kernels", description=__doc__)
    p.add_argument(
        "--model",
        nargs="+",
        default=["configs/models/qwen3-1.7b.json", "configs/models/qwen3-8b.json"],
        help="model config JSON(s) (HF config.json layout)",
    )
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256], help="rows B")
    p.add_argument("--new", type=int, nargs="+", default=[1, 4], help="new tokens per row T (decode: 1)")
    p.add_argument("--context", type=int, default=1024, help="positions already in each row's cache")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--iters", type=int, default=200, help="calls per compiled loop")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of the loop (median)")
    p.add_argument("--interpret", action="store_true", help="the kernels in Triton's interpreter (smoke test)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    rows = []
    for model in args.model:
        cfg = ModelConfig.from_json(model)
        for batch in args.batch:
            for new in args.new:
                row = {"model": Path(model).stem, "batch": batch, "new": new}
                row |= time_norm(cfg, batch * new, DTYPES[args.dtype], args.iters, args.repeats, args.interpret)
                row |= time_prologue(cfg, batch, new, args)
                rows.append(row)
                print_table(rows[-1:], list(rows[-1]))
    print()
    print_table(rows, list(rows[0]))
    write_results(args.out, "layer-kernels", rows, {"context": args.context, "page_size": args.page_size})
    return 0
