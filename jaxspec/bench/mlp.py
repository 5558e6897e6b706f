"""`jaxspec bench mlp`: a dense layer's MLP at decode and verification row counts, its gate and up
projections as one GEMM over their stacked weights (as `jaxspec.models.blocks.dense_mlp` runs them)
and as two GEMMs, against the memory roofline.

Random bf16 weights of a model config's MLP (H = hidden_size, F = intermediate_size) and
x [M, H] bf16 for each M of --rows: the token rows of one step, e.g. 32 slots x 4 verified tokens
= 128. The layer's MLP with its residual, x + silu(h Wg) * (h Wu) Wd with h = rms_norm(x) (the
model's norm, weight 1), runs --iters times back to back inside one compiled loop, each call on the one before's
output (`timing.looped`: the device's time, no dispatch between calls). A decode step must read
the three weights once whatever M is (3 x H x F x 2 bytes), so `roofline` = those bytes per second
over the device copy bandwidth (bytes read + written per second inside one compiled loop,
measured in the same run): the fraction of the card's memory rate the GEMMs reach. A fraction
above 1.0 is an error row, never a result. `fused_speedup` is the two-GEMM time over the one-GEMM
time; `max_abs_diff` their outputs' largest difference after one call. `--tokamax IMPL ...` adds a
form per tokamax implementation (`jaxspec.bench.tokamax_kernels`): its fused gated linear unit over
the same [H, 2, F] weight in place of the one GEMM and the silu product, with its time, roofline,
speedup over the one GEMM and largest difference from it; an implementation tokamax cannot run
here leaves its row's fields empty and says why (`tokamax_<impl>_error`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxspec.bench.timing import add_fraction, copy_bytes_per_second, looped_seconds, print_table, write_results
from jaxspec.bench.tokamax_kernels import IMPLEMENTATIONS, load_tokamax
from jaxspec.models.blocks import dense_mlp, rms_norm
from jaxspec.models.config import ModelConfig
from jaxspec.models.params import pair

NORM_EPS = 1e-6  # Qwen3's rms_norm_eps
APART = ("norm", "gate", "up", "down")  # two_gemms' weights, in its argument order
FUSED = ("norm", "gate_up", "down")  # one_gemm's


def mlp_weights(hidden: int, intermediate: int, seed: int = 0) -> dict[str, jax.Array]:
    """{"norm": bf16 [H] of ones, "gate", "up": bf16 [H, F], "down": bf16 [F, H], "gate_up": bf16
    [H, 2, F] (the model's layout of gate and up)}, the matrices normal with std 1 / sqrt(fan-in),
    so the residual stream keeps its scale over the loop."""
    kg, ku, kd = jax.random.split(jax.random.key(seed), 3)
    gate = (jax.random.normal(kg, (hidden, intermediate)) / hidden**0.5).astype(jnp.bfloat16)
    up = (jax.random.normal(ku, (hidden, intermediate)) / hidden**0.5).astype(jnp.bfloat16)
    down = (jax.random.normal(kd, (intermediate, hidden)) / intermediate**0.5).astype(jnp.bfloat16)
    norm = jnp.ones((hidden,), jnp.bfloat16)
    return {"norm": norm, "gate": gate, "up": up, "down": down, "gate_up": pair(gate, up)}


def two_gemms(x: jax.Array, norm: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """x [M, H] -> x + silu(h gate) * (h up) down [M, H], h = rms_norm(x, norm): gate and up apart."""
    h = rms_norm(x, norm, NORM_EPS)
    return x + (jax.nn.silu(h @ gate) * (h @ up)) @ down


def one_gemm(x: jax.Array, norm: jax.Array, gate_up: jax.Array, down: jax.Array) -> jax.Array:
    """The model's MLP (`dense_mlp`) with gate_up [H, 2, F]: one GEMM, its output split in two."""
    return x + dense_mlp({"gate_up": gate_up, "down": down}, rms_norm(x, norm, NORM_EPS))


def tokamax_glu(implementation: str):
    """The model's MLP as `one_gemm` computes it, its gated linear unit tokamax's fused kernel."""
    tokamax = load_tokamax()

    def mlp(x: jax.Array, norm: jax.Array, gate_up: jax.Array, down: jax.Array) -> jax.Array:
        h = rms_norm(x, norm, NORM_EPS)
        glu = tokamax.gated_linear_unit(h, gate_up, activation=jax.nn.silu, implementation=implementation)
        return x + glu @ down

    return mlp


def time_tokamax(rows: int, weights: dict[str, jax.Array], implementation: str, iters: int, repeats: int) -> dict:
    """{"tokamax_<impl>_ms", "tokamax_<impl>_diff" (largest difference from `one_gemm` after one
    call)}, or {"tokamax_<impl>_error": why it did not run}."""
    name, args = f"tokamax_{implementation}", tuple(weights[k] for k in FUSED)
    x = jax.random.normal(jax.random.key(1), (rows, weights["gate"].shape[0]), jnp.bfloat16)
    mlp = tokamax_glu(implementation)
    try:
        got = jax.jit(mlp)(x, *args)
    except Exception as e:  # e.g. NotImplementedError off a GPU, or a shape its kernel does not take
        return {f"{name}_error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
    want = jax.jit(one_gemm)(x, *args)
    seconds, _ = looped_seconds(mlp, x, *args, calls=iters, repeats=repeats)
    diff = jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)))
    return {f"{name}_ms": seconds * 1e3, f"{name}_diff": float(diff)}


def time_mlp(rows: int, weights: dict[str, jax.Array], iters: int, repeats: int) -> dict:
    """{"two_gemms_ms", "one_gemm_ms": device time of one MLP call over x [rows, H] in a compiled
    loop, "max_abs_diff": the two forms' outputs after one call}."""
    hidden = weights["gate"].shape[0]
    x = jax.random.normal(jax.random.key(1), (rows, hidden), jnp.bfloat16)
    diff = jnp.max(
        jnp.abs(
            jax.jit(two_gemms)(x, *(weights[k] for k in APART)).astype(jnp.float32)
            - jax.jit(one_gemm)(x, *(weights[k] for k in FUSED)).astype(jnp.float32)
        )
    )
    apart, x = looped_seconds(two_gemms, x, *(weights[k] for k in APART), calls=iters, repeats=repeats)
    fused, _ = looped_seconds(one_gemm, x, *(weights[k] for k in FUSED), calls=iters, repeats=repeats)
    return {"two_gemms_ms": apart * 1e3, "one_gemm_ms": fused * 1e3, "max_abs_diff": float(diff)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="jaxspec bench mlp", description=__doc__)
    p.add_argument(
        "--model",
        nargs="+",
        default=["configs/models/qwen3-1.7b.json", "configs/models/qwen3-8b.json"],
        help="model config JSON(s) (HF config.json layout) giving H and F",
    )
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 512], help="token rows M")
    p.add_argument("--iters", type=int, default=50, help="MLP calls per compiled loop")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of the loop (median)")
    p.add_argument("--copy-bytes", type=int, default=2 << 30, help="array size of the copy-bandwidth baseline")
    p.add_argument("--tokamax", nargs="+", default=[], choices=IMPLEMENTATIONS, help="also tokamax's fused GLU")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    copy_rate = copy_bytes_per_second(args.copy_bytes)
    rows = []
    for model in args.model:
        cfg = ModelConfig.from_json(model)
        weights = mlp_weights(cfg.hidden_size, cfg.intermediate_size)
        weight_bytes = 3 * cfg.hidden_size * cfg.intermediate_size * 2
        for m in args.rows:
            row = {"model": Path(model).stem, "rows": m, **time_mlp(m, weights, args.iters, args.repeats)}
            row["fused_speedup"] = row["two_gemms_ms"] / row["one_gemm_ms"]
            for impl in args.tokamax:
                row.update(time_tokamax(m, weights, impl, args.iters, args.repeats))
                if f"tokamax_{impl}_ms" in row:
                    row[f"tokamax_{impl}_speedup"] = row["one_gemm_ms"] / row[f"tokamax_{impl}_ms"]
            for form in ("two_gemms", "one_gemm", *(f"tokamax_{impl}" for impl in args.tokamax)):
                if f"{form}_ms" not in row:
                    continue
                seconds = row[f"{form}_ms"] * 1e-3
                what = f"{row['model']} MLP, {form}, {m} rows: weight read rate"
                add_fraction(row, f"{form}_roofline", weight_bytes / seconds, copy_rate, what)
            rows.append(row)
            print_table(rows[-1:], list(rows[-1]))
    print()
    print_table(rows, list(dict.fromkeys(column for row in rows for column in row)))
    write_results(args.out, "mlp", rows, {"copy_bytes_per_second": copy_rate})
    return 0
