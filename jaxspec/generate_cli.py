"""`jaxspec generate`: sample answers to task problems from a policy and score them.

Defaults to the embedded tiny policy; `--spec-method` turns on speculative decoding (the
samples are distributed exactly as without it; the acceptance statistics are printed), with any
other `spec` setting of a `jaxspec train` config as `--spec-set KEY=VALUE` (a YAML value, e.g.
`--spec-set adaptive=true --spec-set "verify_token_cost=[[1, 0.0], [64, 0.1]]"`); `--slots` runs
the continuous-batching engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import numpy as np

from jaxspec.assets import tiny_policy_path
from jaxspec.config_io import apply_override, from_dict
from jaxspec.models import load_hf
from jaxspec.rewards import get_reward
from jaxspec.rollout import Sampling, Spec, SpecConfig, generate
from jaxspec.tasks import ChatTokenizer, generate_problems, load_prompts

SPEC_KEYS = tuple(f.name for f in dataclasses.fields(SpecConfig) if f.name not in ("method", "draft"))


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
    p.add_argument(
        "--spec-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another spec setting of a train config (repeatable; a YAML value), e.g. adaptive=true, tree_width=2",
    )
    p.add_argument(
        "--slots",
        default=None,
        help="continuous batching over paged KV: this many decode slots, or 'auto' (default: the staged engine)",
    )
    p.add_argument(
        "--coupled",
        action="store_true",
        help="coupled draws: a speculative run gives the autoregressive run's tokens for the same --seed",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", type=int, default=3, help="responses to print")
    args = p.parse_args(argv)
    if args.spec_set and args.spec_method == "none":
        raise ValueError("--spec-set needs a --spec-method")
    for flag in ("num_problems", "samples", "max_new_tokens"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.spec_method == "eagle3" and not args.draft:
        raise ValueError("--draft is required with --spec-method eagle3")
    if args.suffix_branches and args.spec_method != "eagle3":
        raise ValueError(f"--suffix-branches needs --spec-method eagle3, got {args.spec_method}")
    slots(args.slots)  # bad settings fail before the policy loads
    settings = spec_settings(args) if args.spec_method != "none" else None

    policy = args.policy or tiny_policy_path()
    cfg, params = load_hf(policy)
    tok = ChatTokenizer.from_file(policy)
    if args.data:
        examples = load_prompts(args.data, prompt_field=args.prompt_field, answer_field=args.answer_field)
        examples = [{"question": e["prompt"], "answer": e["answer"]} for e in examples][: args.num_problems]
    else:
        examples = generate_problems(args.num_problems, seed=args.seed, levels=args.levels)
    spec = None
    if settings is not None:  # suffix: each problem's --samples rows are one group
        draft = None
        if args.spec_method == "eagle3":
            from jaxspec.draft import load_eagle3

            draft = load_eagle3(args.draft, policy=cfg)
        spec = Spec.from_config(settings, draft)
    rows = [e for e in examples for _ in range(args.samples)]
    prompts = [tok.encode_prompt(e["question"]) for e in rows]
    sampling = Sampling(
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        eos_id=tok.eos_id,
        coupled=args.coupled,
    )
    start = time.perf_counter()
    out = generate(cfg, params, prompts, jax.random.key(args.seed), sampling, spec=spec, slots=slots(args.slots))
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


def spec_settings(args) -> SpecConfig:
    """The `SpecConfig` of --spec-method, --num-draft-tokens, --suffix-branches and every
    --spec-set KEY=VALUE (later ones win); ValueError naming the flag and key on a bad one."""
    data = {
        "method": args.spec_method,
        "num_draft_tokens": args.num_draft_tokens,
        "suffix_branches": args.suffix_branches,
    }
    for override in args.spec_set:
        key = override.partition("=")[0].strip()
        if key not in SPEC_KEYS:
            raise ValueError(f"--spec-set {override!r}: unknown spec setting {key!r} (known: {', '.join(SPEC_KEYS)})")
        apply_override(data, override)
    settings = from_dict(SpecConfig, data, "--spec-set")
    for key, message in settings.errors(prefix=""):
        raise ValueError(f"--spec-set {key}: {message}")
    return settings


def slots(value: str | None) -> int | str | None:
    """--slots: None (the staged engine), a positive integer, or 'auto'."""
    if value is None or value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"--slots must be a positive integer or 'auto', got {value!r}")
    return int(value)
