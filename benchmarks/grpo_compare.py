"""Side-by-side summary of GRPO runs that differ only in how rollouts are generated.

    python3 benchmarks/grpo_compare.py --out benchmarks/results/<campaign>/grpo_small.json \
        --plot benchmarks/results/<campaign>/grpo_small.png [--warmup 2] \
        ar=runs/grpo-ar spec=runs/grpo-spec frozen=runs/grpo-frozen

Reads each run's metrics.jsonl. Step times are medians over the steps that every run reached
(runs of different lengths compare the same prompts), after the first --warmup (2: compile and
warm-up), that compiled nothing (where metrics record `compiles`; a new packed row count
compiles the update once), excluding the stages that only some steps run (eval, checkpoint):
generation, log-prob recompute, train and the whole step. Speedups are against the first run named (the
autoregressive baseline of the same invocation). Validation curves are compared at the eval steps
after step 0 that every run reached: the mean and largest |accuracy - baseline accuracy|, so that an
autoregressive run at another seed gives the seed-to-seed spread the others are read against. The
plot (needs matplotlib) shows validation accuracy, the reward (10-step moving mean) and the
acceptance length against step for every run.

A step's generation lasts as long as its longest answer (the last rows run nearly alone), and runs
that generate differently draw different answers (speculation keeps the law, not the samples), so
on a heavy-tailed workload a few steps' generation times mostly compare the draws. Each run also
reports generation_ms_per_longest_token, the median over the timed steps of the generation time
over the step's longest answer (`response_length_max`), and tail_generation_speedup, the
baseline's over the run's: the generation speedup with the longest answers' draw taken out; and
cut_steps, the timed steps where some answer ran to rollout.max_new_tokens without an eos
(`truncated_frac` > 0): such a step's generation lasts the cap, whatever the rest drew. Runs with
rollout.coupled (coupled draws) generate the baseline's answers where their policies agree, which
takes the draw out of the step times themselves as long as no near-tie breaks between the runs'
bf16 logits (not over answers of thousands of tokens): same_answers is the share of the timed
steps whose answers (mean and longest length, mean reward) equal the baseline's at that step.

Runs with rollout.mode async also report sync_s (the weight copy onto the rollout mesh),
rollout_wait_s (the trainer waiting for its batch) and overlap: the step time over the longer of
the two meshes' work, max(generation, logprob + train + sync); 1.0 = the two overlap completely,
(generation + trainer work) / max(...) = not at all.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

STAGES = ("generation", "logprob", "train", "sync", "rollout_wait")
WARMUP_STEPS = 2
ANSWER_KEYS = ("response_length_mean", "response_length_max", "reward_mean")  # a step's answers, summarized


def load(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics (did the run start?)")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def summarize(records: list[dict], last_step: int | None = None, warmup: int = WARMUP_STEPS) -> dict:
    """Timing medians and curves of one run; timings over steps warmup + 1 .. last_step."""
    steps = [r for r in records if warmup < r.get("step", 0) <= (last_step or r["step"]) and "time_step_s" in r]
    if not steps:
        raise ValueError("no training steps past warm-up in metrics.jsonl")
    timed = [r for r in steps if not r.get("compiles", 0)] or steps

    def median(key: str, rows: list[dict] = timed) -> float | None:
        values = [r[key] for r in rows if key in r]
        return statistics.median(values) if values else None

    per_longest = [
        1e3 * r["time_generation_s"] / r["response_length_max"] for r in timed if r.get("response_length_max")
    ]
    step_core = [r["time_step_s"] - r.get("time_eval_s", 0.0) - r.get("time_checkpoint_s", 0.0) for r in timed]
    out = {f"{stage}_s": median(f"time_{stage}_s") for stage in STAGES}
    out.update(
        step_s=statistics.median(step_core),
        steps=len(steps),
        timed_steps=len(timed),
        compiling_steps=sum(1 for r in steps if r.get("compiles", 0)),
        acceptance_length=median("acceptance_length", steps),
        response_length=median("response_length_mean", steps),
        longest_response=median("response_length_max", timed),
        generation_ms_per_longest_token=statistics.median(per_longest) if per_longest else None,
        cut_steps=[r["step"] for r in timed if r.get("truncated_frac", 0.0) > 0],
        answers={r["step"]: [r.get(k) for k in ANSWER_KEYS] for r in timed},
        reward_first=statistics.mean(r["reward_mean"] for r in steps[:5]),
        reward_last=statistics.mean(r["reward_mean"] for r in steps[-5:]),
    )
    if any("staleness" in r for r in steps):  # rollout.mode async
        trainer = sum(out[f"{stage}_s"] or 0.0 for stage in ("logprob", "train", "sync"))
        out["overlap"] = out["step_s"] / max(out["generation_s"], trainer)
    out["eval_accuracy"] = [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    out["reward"] = [(r["step"], r["reward_mean"]) for r in records if "reward_mean" in r]
    out["acceptance"] = [
        (r["step"], r["acceptance_length"])
        for r in records
        if r.get("acceptance_length", 1.0) > 1.0 and "time_step_s" in r
    ]
    return out


def accuracy_gap(curve: list[tuple[int, float]], base: list[tuple[int, float]], steps: set[int]) -> dict:
    """Mean and largest |accuracy - base accuracy| over `steps`, and the mean of the last 5 of them."""
    mine, theirs = dict(curve), dict(base)
    shared = sorted(steps)
    if not shared:
        return {"accuracy_gap_mean": None, "accuracy_gap_max": None, "accuracy_last5": None}
    gaps = [abs(mine[s] - theirs[s]) for s in shared]
    return {
        "accuracy_gap_mean": statistics.mean(gaps),
        "accuracy_gap_max": max(gaps),
        "accuracy_last5": statistics.mean(mine[s] for s in shared[-5:]),
    }


def same_answers(answers: dict, base: dict) -> float | None:
    """The share of the steps timed in both runs whose answers (`ANSWER_KEYS`) are equal, None if no
    step is."""
    shared = answers.keys() & base.keys()
    if not shared:
        return None
    return sum(answers[step] == base[step] for step in shared) / len(shared)


def moving_mean(points: list[tuple[int, float]], window: int) -> list[tuple[int, float]]:
    """(step, mean of the last `window` values) for every step from the window's end."""
    values = [v for _, v in points]
    return [(points[i][0], statistics.mean(values[i + 1 - window : i + 1])) for i in range(window - 1, len(points))]


def plot(runs: dict[str, dict], path: str, window: int = 10) -> None:
    """Validation accuracy, the reward (moving mean over `window` steps) and the acceptance length
    (speculative runs) against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, reward, accept) = plt.subplots(1, 3, figsize=(15, 4))
    for name, summary in runs.items():
        color = acc.plot([], [])[0].get_color()
        if summary["eval_accuracy"]:  # a run may skip validation (eval.every=0)
            acc.plot(*zip(*summary["eval_accuracy"]), marker="o", markersize=3, color=color, label=name)
        smooth = moving_mean(summary["reward"], min(window, len(summary["reward"])))
        reward.plot(*zip(*smooth), color=color, label=name)
        if summary["acceptance"]:
            accept.plot(*zip(*summary["acceptance"]), color=color, alpha=0.8, label=name)
    acc.set(xlabel="GRPO step", ylabel="validation accuracy (greedy)", title="held-out accuracy")
    reward.set(xlabel="GRPO step", ylabel=f"mean reward, {window}-step moving mean", title="training reward")
    accept.set(xlabel="GRPO step", ylabel="tokens per verification step", title="acceptance length")
    acc.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="name=run_dir; the first is the baseline")
    p.add_argument("--out", required=True, help="JSON summary")
    p.add_argument("--plot", default=None, help="PNG of accuracy and reward curves")
    p.add_argument(
        "--warmup",
        type=int,
        default=WARMUP_STEPS,
        help="first steps left out of the timings (steps that compiled are left out anyway, where metrics "
        "record `compiles`: 1 keeps the second step of a short run)",
    )
    args = p.parse_args()
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    records = {}
    for spec in args.runs:
        name, _, run_dir = spec.partition("=")
        records[name] = load(Path(run_dir))
    last_step = min(max(r.get("step", 0) for r in rows) for rows in records.values())
    runs = {name: summarize(rows, last_step, args.warmup) for name, rows in records.items()}
    print(f"timings over steps {args.warmup + 1}-{last_step}")
    base = next(iter(runs.values()))
    eval_steps = set.intersection(*({step for step, _ in s["eval_accuracy"] if step > 0} for s in runs.values()))
    print(
        f"{'run':<14}{'step_s':>9}{'gen_s':>9}{'train_s':>9}{'step x':>8}{'gen x':>8}{'accept':>8}{'resp':>7}"
        f"{'reward':>14}{'acc last5':>10}{'|gap| mean':>11}{'max':>7}  validation accuracy"
    )
    for name, s in runs.items():
        s["step_speedup"] = base["step_s"] / s["step_s"]
        s["generation_speedup"] = base["generation_s"] / s["generation_s"]
        tail, base_tail = s["generation_ms_per_longest_token"], base["generation_ms_per_longest_token"]
        s["tail_generation_speedup"] = base_tail / tail if tail and base_tail else None
        s.update(accuracy_gap(s["eval_accuracy"], base["eval_accuracy"], eval_steps))
        s["same_answers"] = same_answers(s["answers"], base["answers"])
        curve = " ".join(f"{acc:.3f}" for _, acc in s["eval_accuracy"])
        gaps = "".join(
            f"{s[k]:>{w}.3f}" if s[k] is not None else f"{'-':>{w}}"
            for k, w in (("accuracy_last5", 10), ("accuracy_gap_mean", 11), ("accuracy_gap_max", 7))
        )
        print(
            f"{name:<14}{s['step_s']:>9.3f}{s['generation_s']:>9.3f}{s['train_s'] or 0:>9.3f}"
            f"{s['step_speedup']:>8.2f}{s['generation_speedup']:>8.2f}{s['acceptance_length'] or 1:>8.2f}"
            f"{s['response_length']:>7.1f}{s['reward_first']:>7.3f}->{s['reward_last']:.3f}{gaps}  {curve}"
        )
    for name, s in runs.items():
        if s["tail_generation_speedup"] is not None:
            print(
                f"{name}: longest answer {s['longest_response']:.0f} tokens, generation "
                f"{s['generation_ms_per_longest_token']:.3f} ms per token of it, {s['tail_generation_speedup']:.2f}x"
            )
    for name, s in list(runs.items())[1:]:
        if s["same_answers"] is not None:
            print(f"{name}: the baseline's answers in {s['same_answers']:.0%} of the timed steps both ran")
    for name, s in runs.items():
        if s["cut_steps"]:
            print(f"{name}: answers cut at max_new_tokens in timed steps {s['cut_steps']}")
    for name, s in runs.items():
        if "overlap" in s:
            print(
                f"{name}: sync {s['sync_s']:.3f} s, waits {s['rollout_wait_s']:.3f} s for rollouts, overlap "
                f"{s['overlap']:.2f} (step / max(generation, logprob + train + sync); 1.00 = full overlap)"
            )
    Path(args.out).write_text(json.dumps(runs, indent=1) + "\n", encoding="utf-8")
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
