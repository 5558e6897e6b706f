"""`jaxspec bench forward`: training-shaped forward (and forward+backward) throughput and MFU.

Random bf16 weights of a checkpoint's shape (a config.json), tokens [batch, seq]. MFU is model
FLOP/s over the bf16 matmul rate measured in the same run. Model FLOPs per token (forward):
2 x matmul params (projections, MLP, LM head) + 4 x layers x q_heads x head_dim x L/2 (causal
attention scores and values over a sequence of L tokens). A training step counts 3x the forward.

--segments N packs N sequences of seq / N tokens into every row (segment ids, as the trainers pack
rows) and times the same tokens again as batch x N rows of seq / N tokens each: `packed_over_rows`
is the packed rows' time over those rows' (1.0: packed rows cost what their sequences cost; the
attention of a row that ignored its segments' bounds would cost ~N times its sequences').
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
    p.add_argument("--segments", type=int, default=1, help="sequences packed into each row (seq / N tokens each)")
    p.add_argument("--out", default=None, help="write JSON results here")
    args = p.parse_args(argv)
    if args.segments < 1 or args.seq % args.segments:
        p.error(f"--segments {args.segments} must divide --seq {args.seq}")

    cfg = ModelConfig.from_json(args.model)
    dtype = jnp.dtype(args.dtype)
    params = jax.jit(init_params, static_argnums=(0, 2))(cfg, jax.random.key(0), dtype)
    peak = matmul_flops_per_second(args.matmul_size)

    length = args.seq // args.segments  # tokens per sequence

    @jax.jit
    def fwd(params, tokens, segments):
        logits = forward(cfg, params, tokens, attention_impl=args.attention, segment_ids=segments)
        return logits[:, -1]  # the full logits stay inside the program

    def loss(params, tokens, segments):
        logits = forward(cfg, params, tokens[:, :-1], remat=True, attention_impl=args.attention, segment_ids=segments)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    grad_step = jax.jit(jax.value_and_grad(loss))
    rows = []
    for batch in args.batch:
        # seq + 1 tokens: the training step predicts tokens[:, 1:] from tokens[:, :-1] (seq positions)
        tokens = jax.random.randint(jax.random.key(batch), (batch, args.seq + 1), 0, cfg.vocab_size, jnp.int32)
        layouts = [("rows", tokens, None)]
        if args.segments > 1:
            segments = jnp.broadcast_to(1 + jnp.arange(args.seq) // length, (batch, args.seq)).astype(jnp.int32)
            unpacked = tokens[:, : args.seq].reshape(batch * args.segments, length)
            unpacked = jnp.concatenate([unpacked, unpacked[:, :1]], axis=1)  # each row's seq / N + 1 tokens
            layouts = [(f"packed {args.segments}", tokens, segments), ("rows", unpacked, None)]
        flops = forward_flops_per_token(cfg, length) * batch * args.seq
        passes = [("forward", 1, lambda t, s: fwd(params, t[:, :-1], s))]
        if not args.no_backward:
            passes.append(("fwd+bwd", 3, lambda t, s: grad_step(params, t, s)))
        for name, factor, run in passes:
            for layout, toks, segs in layouts:
                t = median_seconds(lambda: run(toks, segs), iters=args.iters)
                rows.append(
                    {
                        "pass": name,
                        "layout": layout,
                        "batch": toks.shape[0],
                        "seq": toks.shape[1] - 1,
                        "ms": 1e3 * t,
                        "tokens_per_s": batch * args.seq / t,
                    }
                )
                add_fraction(
                    rows[-1], "mfu", factor * flops / t, peak, f"{name} {layout} batch {batch}: FLOP/s / matmul rate"
                )
            if args.segments > 1:
                rows[-2]["packed_over_rows"] = rows[-2]["ms"] / rows[-1]["ms"]
    baseline = {
        **ceilings(matmul_rate=peak),
        "attention": args.attention,
        "segments": args.segments,
        "matmul_tflops": peak / 1e12,
        "params": cfg.num_params(),
        "model": args.model,
        "dtype": args.dtype,
    }
    print(f"measured bf16 matmul rate: {peak / 1e12:.1f} TFLOP/s; params {cfg.num_params() / 1e9:.2f} B")
    print_table(rows, ["pass", "layout", "batch", "seq", "ms", "tokens_per_s", "mfu", "packed_over_rows"])
    write_results(args.out, "forward", rows, baseline)
    return 0
