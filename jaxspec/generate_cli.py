"""`jaxspec generate`: sample answers to task problems from a policy and score them.

Defaults to the embedded tiny policy; `--spec-method` turns on speculative decoding (the
samples are distributed exactly as without it; the acceptance statistics are printed).
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from jaxspec.assets import tiny_policy_path
from jaxspec.models import load_hf
from jaxspec.rewards import get_reward
from jaxspec.rollout import Sampling, Spec, generate
from jaxspec.tasks import ChatTokenizer, generate_problems, load_prompts


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="jaxspec generate", description=__doc__)
    p.add_argument("--policy", default=None, help="HF folder with tokenizer.json (default: embedded tiny policy)")
    p.add_argument("--data", default=None, help="local JSONL/parquet prompts (default: generated problems)")
    p.add_argument("--prompt-field", default="question")
    p.add_argument("--answer-field", default="answer")
    p.add_argument("--num-problems", type=int, default=16)
    p.add_argument("--levels", type=int, nargs="+", default=[1])
    p.add_argument("--samples", type=int, default=1, help="responses per problem")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--spec-method", choices=["none", "ngram", "suffix", "eagle3"], default="none")
    p.add_argument("--draft", default=None, help="EAGLE-3 head folder for --spec-method eagle3")
    p.add_argument(
        "--suffix-branches",
        action="store_true",
        help="--spec-method eagle3: hybrid trees, the head's and suffix branches from each problem's --samples rows",
    )
    p.add_argument("--num-draft-tokens", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", type=int, default=3, help="responses to print")
    args = p.parse_args(argv)
    for flag in ("num_problems", "samples", "max_new_tokens"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.spec_method == "eagle3" and not args.draft:
        raise ValueError("--draft is required with --spec-method eagle3")
    if args.suffix_branches and args.spec_method != "eagle3":
        raise ValueError(f"--suffix-branches needs --spec-method eagle3, got {args.spec_method}")

    policy = args.policy or tiny_policy_path()
    cfg, params = load_hf(policy)
    tok = ChatTokenizer.from_file(policy)
    if args.data:
        examples = load_prompts(args.data, prompt_field=args.prompt_field, answer_field=args.answer_field)
        examples = [{"question": e["prompt"], "answer": e["answer"]} for e in examples][: args.num_problems]
    else:
        examples = generate_problems(args.num_problems, seed=args.seed, levels=args.levels)
    spec = None
    if args.spec_method in ("ngram", "suffix"):  # suffix: each problem's --samples rows are one group
        spec = Spec(method=args.spec_method, num_draft_tokens=args.num_draft_tokens)
    elif args.spec_method == "eagle3":
        from jaxspec.draft import load_eagle3

        spec = Spec(
            method="eagle3",
            draft=load_eagle3(args.draft, policy=cfg),
            num_draft_tokens=args.num_draft_tokens,
            suffix_branches=args.suffix_branches,
        )
    rows = [e for e in examples for _ in range(args.samples)]
    prompts = [tok.encode_prompt(e["question"]) for e in rows]
    sampling = Sampling(
        temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens, eos_id=tok.eos_id
    )
    start = time.perf_counter()
    out = generate(cfg, params, prompts, jax.random.key(args.seed), sampling, spec=spec)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    seconds = time.perf_counter() - start
    reward = get_reward("arithmetic")  # the built-in task's integer and fraction answers
    texts = [tok.decode(t[:n]) for t, n in zip(tokens, lengths)]
    scores = [reward(text, example) for text, example in zip(texts, rows)]
    for text, example, score in list(zip(texts, rows, scores))[: args.show]:
        print(f"Q: {example['question']}\nA: {text}\nreward {score} (answer {example['answer']})\n")
    print(
        f"{len(rows)} responses, mean reward {np.mean(scores):.3f}, {int(lengths.sum())} tokens "
        f"in {seconds:.1f} s (incl. compilation), acceptance length {out.stats['acceptance_length']:.2f}"
    )
    return 0
