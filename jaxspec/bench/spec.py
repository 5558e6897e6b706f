"""`jaxspec bench spec`: speculative vs autoregressive rollout generation on a trained policy.

The policy (an HF folder, e.g. the `small` workload policy) answers held-out task problems at
temperature 1 in RL-shaped batches; every configuration generates the same prompts with the same
sampling, so the autoregressive run of the same invocation is the baseline. Reported per
configuration: generation time, speedup over AR (the ratio of generation times; rows sample
their own lengths, so the ratio of tokens per second, `throughput_speedup`, is given too),
acceptance length (tokens emitted per verification step and row, the accepted drafts + 1) and
speculation efficiency = speedup / acceptance length (1.0 would mean a verification step costs no
more than one decode step and drafting is free), and the wall time of one loop iteration (decode
step or verification step, prefill included) against the autoregressive one. With --slots, every
configuration also runs on the slot engine (continuous batching over a paged KV cache,
`generate(..., slots=S)`), against the same staged autoregressive baseline. What the rollouts
are is reported beside: accuracy (the task's reward at temperature 1), the policy's entropy per
response token (estimated as the mean -log p of the sampled tokens, nats) and the response
lengths (percentiles; every row's length in the JSON, from which the rows still running at each
decode step follow).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from jaxspec.bench.spec_configs import configurations, parse_args
from jaxspec.bench.timing import print_table, write_results
from jaxspec.draft import init_eagle3, load_eagle3
from jaxspec.models import ModelConfig, load_hf
from jaxspec.rewards.math_verifier import arithmetic_reward
from jaxspec.rollout import RolloutOutput, Sampling, Spec, generate
from jaxspec.rollout.speculative.stats import merge_stats
from jaxspec.tasks import DEFAULT_KINDS, ChatTokenizer, TallyConfig, generate_problems

COLUMNS = [
    "batch",
    "config",
    "seconds",
    "tokens_per_s",
    "speedup",
    "throughput_speedup",
    "acceptance_length",
    "efficiency",
    "step_ms",
    "step_over_ar",
    "accuracy",
    "nats_per_token",
    "length_p50",
    "length_p99",
]
# the slot engine's own statistics, kept per slot row (`jaxspec.rollout.continuous.slot_output`): the
# step's widths and the decode steps at each, how full the page pool got and how often it ran short
SLOT_STATS = (
    "step_widths",
    "width_steps",
    "loop_iterations",
    "kv_pages",
    "peak_kv_pages",
    "preemptions",
    "prefill_chunks",
    "prefix_pages_shared",
)


def bench_problems(
    rows: int, samples: int, seed: int, levels, kinds=DEFAULT_KINDS, tally: TallyConfig = TallyConfig()
) -> list[dict]:
    """`rows` task problems: rows / samples held-out problems of the given levels and kinds, each
    repeated `samples` times in a row, as a GRPO batch of groups is."""
    if samples < 1 or rows % samples:
        raise ValueError(f"--batch {rows} is not a positive multiple of --samples {samples}")
    problems = generate_problems(rows // samples, seed=seed, levels=levels, kinds=kinds, tally=tally)
    return [pr for pr in problems for _ in range(samples)]


def bench_prompts(
    tok: ChatTokenizer,
    rows: int,
    samples: int,
    seed: int,
    levels,
    kinds=DEFAULT_KINDS,
    tally: TallyConfig = TallyConfig(),
) -> list[list[int]]:
    """Token ids of the chat prompts of `bench_problems`."""
    return [tok.encode_prompt(pr["question"]) for pr in bench_problems(rows, samples, seed, levels, kinds, tally)]


def rollout_summary(tok: ChatTokenizer, problems: list[dict], tokens, logprobs, lengths) -> dict:
    """What a batch of T=1 rollouts is: accuracy (the arithmetic reward of each decoded response
    against its problem's answer), nats per response token (mean -log p of the sampled tokens:
    an unbiased estimate of the policy's entropy per token on its own rollouts), length
    percentiles and every row's length. tokens int32 [B, N], logprobs float32 [B, N] (0 past a
    row's end), lengths int32 [B]."""
    tokens, logprobs, lengths = np.asarray(tokens), np.asarray(logprobs), np.asarray(lengths)
    rewards = [
        arithmetic_reward(tok.decode(row[:n].tolist()), str(pr["answer"]))
        for row, n, pr in zip(tokens, lengths, problems, strict=True)
    ]
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return {
        "accuracy": float(np.mean(rewards)),
        "nats_per_token": float(-logprobs.sum() / max(int(lengths.sum()), 1)),
        "length_p50": float(p50),
        "length_p90": float(p90),
        "length_p99": float(p99),
        "length_max": int(lengths.max()),
        "lengths": lengths.tolist(),
    }


def generate_rows(
    cfg, params, prompts, key, sampling, spec, slots, kv_pages, sub_batch, decode_steps=None
) -> RolloutOutput:
    """`generate` of the prompts, on the host and finished: in one call, or with sub_batch in calls of
    that many rows one after another (their keys folded with the call's index, as
    rollout.sub_batch does) whose outputs and statistics are joined as one rollout's. decode_steps:
    the slot engine's decode steps between two rounds of scheduling (None: its default)."""
    size = sub_batch or len(prompts)
    if size < 1 or len(prompts) % size:
        raise ValueError(f"--sub-batch {sub_batch} does not divide the batch of {len(prompts)} rows")
    parts = []
    for i, start in enumerate(range(0, len(prompts), size)):
        call_key = key if size == len(prompts) else jax.random.fold_in(key, i)
        out = generate(
            cfg,
            params,
            prompts[start : start + size],
            call_key,
            sampling,
            spec=spec,
            slots=slots,
            kv_pages=kv_pages,
            decode_steps=decode_steps,
        )
        parts.append(jax.device_get(out))
    if len(parts) == 1:
        return parts[0]
    join = lambda name: np.concatenate([getattr(p, name) for p in parts])  # noqa: E731
    return parts[0]._replace(
        tokens=join("tokens"),
        lengths=join("lengths"),
        logprobs=join("logprobs"),
        stats=merge_stats([p.stats for p in parts]),
    )


def load_draft_model(path: str, policy: ModelConfig, dtype: str) -> tuple[ModelConfig, dict]:
    """(config, params) of a draft model folder; ValueError unless it shares the policy's vocabulary."""
    cfg, params = load_hf(path, dtype=dtype)
    if cfg.vocab_size != policy.vocab_size:
        raise ValueError(
            f"--draft-model {path}: vocabulary of {cfg.vocab_size} tokens, the policy's has "
            f"{policy.vocab_size} (a draft model needs the policy's tokenizer)"
        )
    return cfg, params


def agreement(reference: np.ndarray, tokens) -> dict:
    """How far rows of tokens int32 [B, N] follow the reference's rows: the share of rows equal to
    theirs, and the mean share of a row's N positions before its first difference (coupled draws
    in bfloat16 follow until a near-tie breaks the other way)."""
    differs = np.asarray(tokens) != reference
    first = np.where(differs.any(axis=1), differs.argmax(axis=1), differs.shape[1])
    return {
        "rows_as_ar": float(np.mean(~differs.any(axis=1))),
        "prefix_as_ar": float(np.mean(first / differs.shape[1])),
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv, __doc__)
    levels, kinds, tally = args.levels, DEFAULT_KINDS, TallyConfig()
    if args.data_config:
        from jaxspec.config_io import load_config
        from jaxspec.pretrain.config import PretrainConfig, validate

        data_cfg = load_config(PretrainConfig, args.data_config)
        validate(data_cfg, args.data_config)
        levels, kinds, tally = data_cfg.data.levels, data_cfg.data.kinds, data_cfg.data.tally

    cfg, params = load_hf(args.policy, dtype=args.dtype)
    tok = ChatTokenizer.from_file(args.policy)
    drafts = {"eagle3": load_eagle3(args.draft, dtype=args.dtype, policy=cfg)}
    if args.draft_ood:
        drafts["eagle3-ood"] = load_eagle3(args.draft_ood, dtype=args.dtype, policy=cfg)
    if args.draft_model:
        drafts["draft_model"] = load_draft_model(args.draft_model, cfg, args.dtype)
    if args.random_draft:
        dcfg = drafts["eagle3"][0]
        drafts["eagle3-random"] = init_eagle3(
            cfg, jax.random.key(1), dcfg.draft_vocab_size, aux_layer_ids=dcfg.aux_layer_ids, dtype=args.dtype
        )
    baseline = {
        "policy": args.policy,
        "draft": args.draft,
        "draft_ood": args.draft_ood,
        "random_draft": args.random_draft,
        "draft_model": args.draft_model,
        "params": cfg.num_params(),
        "levels": list(levels),
        "kinds": list(kinds),
        "data_config": args.data_config,
        "tally": dataclasses.asdict(tally),
        "samples_per_prompt": args.samples,
        "temperature": 1.0,
        "max_new_tokens": args.new,
        "sub_batch": args.sub_batch,
        "kv_pages": args.kv_pages,
        "decode_steps": args.decode_steps,
        "coupled": args.coupled,
        "baseline": "autoregressive generate, same run",
    }
    sampling = Sampling(temperature=1.0, max_new_tokens=args.new, eos_id=tok.eos_id, coupled=args.coupled)
    rows = []
    for batch in args.batch:
        problems = bench_problems(batch, args.samples, args.seed + batch, levels, kinds, tally)
        prompts = [tok.encode_prompt(pr["question"]) for pr in problems]
        ar_seconds = None
        # each configuration on the staged engine, then on each slot count: a run cut short still
        # holds the first configurations on both engines
        runs = [
            (label if s is None else f"{label} slots={s}", kwargs, s, args.coupled)
            for label, kwargs in configurations(args)
            for s in (None, *args.slots)
            if not (args.staged_ar_only and s is None and kwargs)
        ]
        if args.coupled:  # the staged AR baseline first, then the same run with the default draws
            runs.insert(1, ("ar default draws", {}, None, False))
        for label, kwargs, slots, coupled in runs:
            kwargs = dict(kwargs)
            spec = None
            if kwargs:
                method = kwargs.pop("method")
                spec = Spec(
                    method="eagle3" if method.startswith("eagle3") else method, draft=drafts.get(method), **kwargs
                )
            key = jax.random.key(0)
            sub_batch = None if slots is not None else args.sub_batch
            draws = dataclasses.replace(sampling, coupled=coupled)
            run = lambda: generate_rows(  # noqa: E731
                cfg, params, prompts, key, draws, spec, slots, args.kv_pages, sub_batch, args.decode_steps
            )
            start = time.perf_counter()
            run()  # compile + warm up
            first_seconds = time.perf_counter() - start
            start = time.perf_counter()
            out = run()
            seconds = time.perf_counter() - start
            tokens = int(np.asarray(out.lengths).sum())
            acc = float(out.stats.get("acceptance_length", 1.0))
            step_ms = 1e3 * seconds / max(int(out.stats.get("steps", 0)), 1)
            if spec is None and slots is None and ar_seconds is None:
                ar_seconds, ar_step_ms, ar_rate = seconds, step_ms, tokens / seconds
                ar_tokens = np.asarray(out.tokens)
            speedup = ar_seconds / seconds
            row = {
                "batch": batch,
                "config": label,
                "slots": slots,
                "seconds": seconds,
                "first_call_seconds": first_seconds,  # compilation included: what a configuration costs a lease
                "tokens": tokens,
                "tokens_per_s": tokens / seconds,
                "speedup": speedup,
                "throughput_speedup": tokens / seconds / ar_rate,
                "acceptance_length": acc,
                "efficiency": speedup / acc,
                "step_ms": step_ms,
                "step_over_ar": step_ms / ar_step_ms,
                "acceptance_per_position": np.asarray(out.stats.get("acceptance_rate_per_position", [])).tolist(),
                **(agreement(ar_tokens, out.tokens) if coupled else {"rows_as_ar": None, "prefix_as_ar": None}),
                "stage_rows": out.stats["stage_rows"],
                "stage_steps": out.stats["stage_steps"],
                "depth_steps": out.stats.get("depth_steps"),  # loop iterations at each draft depth
                "fallback_steps": out.stats.get("fallback_steps"),  # adaptive: iterations that drafted nothing
                "slot_loop": None if slots is None else {k: out.stats[k] for k in SLOT_STATS},
                **rollout_summary(tok, problems, out.tokens, out.logprobs, out.lengths),
            }
            rows.append(row)
            print_table([row], COLUMNS)
            if slots is not None:
                loop = row["slot_loop"]
                print(
                    f"  slot loop: decode steps {loop['width_steps']} at widths {loop['step_widths']}, "
                    f"peak {loop['peak_kv_pages']} of {loop['kv_pages']} pages, {loop['preemptions']} preemptions"
                )
            write_results(args.out, "spec", rows, baseline)  # after each run: a run cut short keeps the rows so far
    print()
    print_table(rows, COLUMNS)
    return 0
