"""Peer for `jaxspec bench decode`: HF transformers `generate` with a static cache on the GPU.

Builds the model from a config.json with random bf16 weights (normal(0, 0.02)), optionally saves
them so jaxspec decodes the same weights, and times sampling at temperature 1 with no eos:
step time = (time of `--new` tokens - time of 1 token) / (new - 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    import torch
    import transformers

    from jaxspec.models.config import ModelConfig

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, nargs="+", required=True)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--save-weights", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    hf = ModelConfig.from_json(args.model).to_hf("bfloat16")
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.02)
            else:
                param.fill_(1.0)
    model.eval()
    if args.save_weights:
        model.save_pretrained(args.save_weights)

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    def timed(batch_ids, new):
        times = []
        for i in range(args.iters + 1):
            sync()
            start = time.perf_counter()
            model.generate(
                batch_ids,
                attention_mask=torch.ones_like(batch_ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                cache_implementation="static",
                pad_token_id=0,
            )
            sync()
            if i:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    rows = []
    for batch in args.batch:
        ids = torch.randint(0, config.vocab_size, (batch, args.prompt), device=args.device)
        try:
            t_full, t_one = timed(ids, args.new), timed(ids, 1)
            rows.append({"batch": batch, "step_ms": 1e3 * (t_full - t_one) / (args.new - 1), "prefill_ms": 1e3 * t_one})
        except torch.OutOfMemoryError:
            rows.append({"batch": batch, "step_ms": None, "error": "out of memory"})
        if args.device == "cuda":
            torch.cuda.empty_cache()
        print(f"transformers {transformers.__version__} batch {batch}: {rows[-1]}", flush=True)
    Path(args.out).write_text(
        json.dumps({"peer": "transformers", "version": transformers.__version__, "rows": rows}, indent=2)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
