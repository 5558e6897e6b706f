"""`jaxspec bench decode`: autoregressive rollout decode vs the HBM roofline and HF transformers.

Random bf16 weights of a checkpoint's shape; B random prompts of `--prompt` tokens; sampling at
temperature 1 with no eos, so every row decodes exactly `--new` tokens. The decode step time is
(time of the full rollout - time of a one-token rollout) / (new - 1), so prefill is excluded.
Bytes a step must read: all weights except the embedding table (an untied model reads only B of
its rows; a mixture-of-experts layer: only the experts its B tokens pick, counted as the expected
number of distinct experts under uniform routing, E * (1 - (1 - k/E)^B)) + the KV cache of the
filled slots, averaged over the decode. MoE rows also report the distinct experts per layer that
the router of the random weights picks for B tokens at one position (`experts_measured`). Roofline fraction =
(bytes / step time) / the device copy bandwidth (bytes read + written per second) measured in
the same run inside one compiled loop (`copy_bytes_per_second`); a fraction above 1.0 is
reported as an error row, never as a result.
The peer runs the same shapes through `transformers` `generate` (static cache, PyTorch, same
card) in a subprocess started before JAX touches the GPU; weights are the same when it saves
them with `--share-weights`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.bench.timing import (
    add_fraction,
    ceilings,
    copy_bytes_per_second,
    median_seconds,
    out_of_memory,
    print_table,
    write_results,
)
from jaxspec.models import ModelConfig, init_params, load_hf
from jaxspec.models.moe import distinct_experts, expected_distinct_experts
from jaxspec.models.transformer import forward_router
from jaxspec.rollout import Sampling, generate
from jaxspec.rollout.compiler_options import splits_k


def weight_read_bytes(cfg: ModelConfig, itemsize: int, tokens: int = 1) -> float:
    """Bytes of weights one step over `tokens` tokens reads (embedding table: only when tied as the
    LM head; sparse layers: the expected distinct experts under uniform routing)."""
    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size  # one expert of one layer
    sparse = len(cfg.sparse_layers)
    experts_read = sparse * expected_experts(cfg, tokens) if sparse else 0.0
    return (cfg.num_params() - embed + (experts_read - sparse * cfg.num_experts) * expert) * itemsize


def expected_experts(cfg: ModelConfig, tokens: int) -> float:
    """Expected distinct experts per sparse layer for `tokens` tokens under uniform routing."""
    return expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, tokens)


def measured_experts(cfg: ModelConfig, params, prompts: np.ndarray, positions: int = 16) -> float:
    """Distinct experts per sparse layer that B rows at one position pick, from the router on
    `params`: the mean over layers and the first `positions` positions of the prompts [B, P]."""
    _, _, router = jax.jit(forward_router, static_argnums=0)(cfg, params, jnp.asarray(prompts[:, :positions]))
    return float(jnp.mean(distinct_experts(router, cfg.num_experts_per_tok)))


def kv_read_bytes(cfg: ModelConfig, batch: int, prompt: int, new: int, itemsize: int) -> float:
    """Mean bytes of filled KV slots one decode step reads."""
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    return batch * (prompt + new / 2) * per_token


def random_prompts(cfg: ModelConfig, batch: int, prompt: int) -> np.ndarray:
    return np.random.default_rng(batch).integers(0, cfg.vocab_size, (batch, prompt))


def run_jaxspec(cfg: ModelConfig, params, batch: int, prompt: int, new: int, iters: int) -> dict:
    prompts = random_prompts(cfg, batch, prompt).tolist()
    full = Sampling(temperature=1.0, max_new_tokens=new, eos_id=())
    one = Sampling(temperature=1.0, max_new_tokens=1, eos_id=())
    key = jax.random.key(0)
    t_full = median_seconds(lambda: generate(cfg, params, prompts, key, full).tokens, warmup=1, iters=iters)
    t_one = median_seconds(lambda: generate(cfg, params, prompts, key, one).tokens, warmup=1, iters=iters)
    return {"step_ms": 1e3 * (t_full - t_one) / (new - 1), "prefill_ms": 1e3 * t_one, "total_s": t_full}


def run_peer(args, out_json: Path, weights_dir: str | None) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "jaxspec.bench.decode_transformers",
        "--model",
        args.model,
        "--batch",
        *map(str, args.batch),
        "--prompt",
        str(args.prompt),
        "--new",
        str(args.peer_new),
        "--device",
        args.peer_device,
        "--out",
        str(out_json),
    ]
    if weights_dir:
        cmd += ["--save-weights", weights_dir]
    env = dict(os.environ, CUDA_MODULE_LOADING="LAZY")
    subprocess.run(cmd, check=True, env=env)
    return {r["batch"]: r for r in json.loads(out_json.read_text())["rows"]}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="jaxspec bench decode", description=__doc__)
    p.add_argument("--model", default="configs/models/qwen3-8b.json")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=1024)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--peer", choices=["transformers", "none"], default="transformers")
    p.add_argument("--peer-new", type=int, default=128, help="tokens per row the peer decodes")
    p.add_argument("--peer-device", default="cuda")
    p.add_argument("--copy-bytes", type=int, default=2 << 30)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cfg = ModelConfig.from_json(args.model)

    with tempfile.TemporaryDirectory() as tmp:
        peer, weights = {}, None
        if args.peer == "transformers":  # before JAX allocates GPU memory
            peer = run_peer(args, Path(tmp) / "peer.json", str(Path(tmp) / "weights"))
            weights = Path(tmp) / "weights"
        if weights is not None and weights.exists():
            _, params = load_hf(weights, dtype="bfloat16")
        else:
            # tensor by tensor: one jit of the whole initialiser takes minutes to compile at 8B
            params = init_params(cfg, jax.random.key(0), jnp.bfloat16)
        copy_bw = copy_bytes_per_second(args.copy_bytes)
        rows = []
        for batch in args.batch:
            try:
                r = run_jaxspec(cfg, params, batch, args.prompt, args.new, args.iters)
            except ValueError as err:  # the rollout's own memory check: record it and go on
                rows.append({"batch": batch, "error": str(err)})
                print(f"batch {batch}: {err}")
                continue
            except jax.errors.JaxRuntimeError as err:  # out of device memory past that check: the same
                rows.append({"batch": batch, "error": out_of_memory(err)})
                print(f"batch {batch}: {rows[-1]['error']}")
                continue
            if r["step_ms"] <= 0:  # the difference of two wall times drowned in their noise
                rows.append(
                    {
                        "batch": batch,
                        "error": f"decode step not resolved: {args.new} new tokens took "
                        f"{r['total_s']:.4f} s, 1 token {r['prefill_ms'] / 1e3:.4f} s; "
                        f"raise --new or --iters",
                    }
                )
                print(f"batch {batch}: {rows[-1]['error']}")
                continue
            step_bytes = weight_read_bytes(cfg, 2, batch) + kv_read_bytes(cfg, batch, args.prompt, args.new, 2)
            row = {
                "batch": batch,
                "prompt": args.prompt,
                "new": args.new,
                "split_k": splits_k(cfg),  # XLA's split-K GEMMs in the rollout loop (`rollout.compiler_options`)
                **r,
                "tokens_per_s": batch / (r["step_ms"] / 1e3),
                "bytes_per_step_gb": step_bytes / 1e9,
                "achieved_tb_s": step_bytes / (r["step_ms"] / 1e3) / 1e12,
            }
            if cfg.num_experts:
                row["experts_expected"] = expected_experts(cfg, batch)
                row["experts_measured"] = measured_experts(cfg, params, random_prompts(cfg, batch, args.prompt))
            add_fraction(
                row,
                "roofline_frac",
                step_bytes / (r["step_ms"] / 1e3),
                copy_bw,
                f"decode batch {batch}: bytes per step / step time vs the in-loop copy bandwidth",
            )
            if batch in peer:
                row["hf_step_ms"] = peer[batch].get("step_ms")
                row["speedup_vs_hf"] = (row["hf_step_ms"] / row["step_ms"]) if row["hf_step_ms"] else None
            rows.append(row)
            print_table([row], list(row))
    baseline = {
        **ceilings(copy_rate=copy_bw),
        "copy_tb_s": copy_bw / 1e12,
        "model": args.model,
        "params": cfg.num_params(),
        "active_params": cfg.num_params(active=True),
        "peer": args.peer,
        "peer_new_tokens": args.peer_new,
        "roofline": "bytes per step / (copy bandwidth: bytes read + written per second)",
    }
    print(f"\n{args.model}: copy bandwidth {copy_bw / 1e12:.2f} TB/s (read+write)")
    print_table(
        rows,
        [
            "batch",
            "step_ms",
            "tokens_per_s",
            "bytes_per_step_gb",
            "achieved_tb_s",
            "roofline_frac",
            "hf_step_ms",
            "speedup_vs_hf",
        ]
        + (["experts_expected", "experts_measured"] if cfg.num_experts else []),
    )
    write_results(args.out, "decode", rows, baseline)
    return 0
