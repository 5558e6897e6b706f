"""`jaxspec bench forward`: training-shaped forward (and forward+backward) throughput and MFU.

Random bf16 weights of a checkpoint's shape (a config.json), tokens [batch, seq]. MFU is model
FLOP/s over the bf16 matmul rate measured in the same run. Model FLOPs per token (forward):
2 x matmul params (projections, MLP, LM head) + 4 x layers x q_heads x head_dim x seq/2 (causal
attention scores and values). A training step counts 3x the forward.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

from jaxspec.bench.timing import (
    add_fraction,
    ceilings,
    matmul_flops_per_second,
    median_seconds,
    print_table,
    write_results,
)
from jaxspec.models import ModelConfig, forward, init_params


def forward_flops_per_token(cfg: ModelConfig, seq: int) -> float:
    h, d = cfg.hidden_size, cfg.head_dim
    per_layer = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * h * cfg.intermediate_size
    matmul = cfg.num_layers * per_layer + h * cfg.vocab_size
    attention = 4 * cfg.num_layers * cfg.num_heads * d * seq / 2
    return 2 * matmul + attention


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="jaxspec bench forward", description=__doc__)
    p.add_argument("--model", default="configs/models/qwen3-1.7b.json", help="HF config.json giving the shape")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-backward", action="store_true", help="time the forward only")
    p.add_argument("--matmul-size", type=int, default=8192, help="n of the n^3 matmul that measures the peak")
    p.add_argument("--attention", default="auto", choices=["auto", "xla", "cudnn"])
    p.add_argument("--out", default=None, help="write JSON results here")
    args = p.parse_args(argv)

    cfg = ModelConfig.from_json(args.model)
    dtype = jnp.dtype(args.dtype)
    params = jax.jit(init_params, static_argnums=(0, 2))(cfg, jax.random.key(0), dtype)
    peak = matmul_flops_per_second(args.matmul_size)

    @jax.jit
    def fwd(params, tokens):
        return forward(cfg, params, tokens, attention_impl=args.attention)[
            :, -1
        ]  # the full logits stay inside the program

    def loss(params, tokens):
        logits = forward(cfg, params, tokens[:, :-1], remat=True, attention_impl=args.attention)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    grad_step = jax.jit(jax.value_and_grad(loss))
    rows = []
    for batch in args.batch:
        # seq + 1 tokens: the training step predicts tokens[:, 1:] from tokens[:, :-1] (seq positions)
        tokens = jax.random.randint(jax.random.key(batch), (batch, args.seq + 1), 0, cfg.vocab_size, jnp.int32)
        flops = forward_flops_per_token(cfg, args.seq) * batch * args.seq
        t = median_seconds(lambda: fwd(params, tokens[:, :-1]), iters=args.iters)
        rows.append(
            {"pass": "forward", "batch": batch, "seq": args.seq, "ms": 1e3 * t, "tokens_per_s": batch * args.seq / t}
        )
        add_fraction(rows[-1], "mfu", flops / t, peak, f"forward batch {batch}: FLOP/s / matmul rate")
        if not args.no_backward:
            t = median_seconds(lambda: grad_step(params, tokens), iters=args.iters)
            rows.append(
                {
                    "pass": "fwd+bwd",
                    "batch": batch,
                    "seq": args.seq,
                    "ms": 1e3 * t,
                    "tokens_per_s": batch * args.seq / t,
                }
            )
            add_fraction(rows[-1], "mfu", 3 * flops / t, peak, f"fwd+bwd batch {batch}: FLOP/s / matmul rate")
    baseline = {
        **ceilings(matmul_rate=peak),
        "attention": args.attention,
        "matmul_tflops": peak / 1e12,
        "params": cfg.num_params(),
        "model": args.model,
        "dtype": args.dtype,
    }
    print(f"measured bf16 matmul rate: {peak / 1e12:.1f} TFLOP/s; params {cfg.num_params() / 1e9:.2f} B")
    print_table(rows, ["pass", "batch", "seq", "ms", "tokens_per_s", "mfu"])
    write_results(args.out, "forward", rows, baseline)
    return 0
