"""PROJECTION (computed, not measured): colocated vs asynchronous GRPO steps on N GPUs, from the
per-phase costs of one colocated and one async run of the same workload (`grpo_compare.py` JSON).

    python3 benchmarks/async_projection.py benchmarks/results/u_h100x4/async_overlap_u_h100.json \
        --colocated coloc:2 --async async:1:1 --rollouts 256 --gpus 8 32 [--generation-speedup 1.75]

`--colocated NAME:DEVICES` and `--async NAME:ROLLOUT_DEVICES:TRAINER_DEVICES` name the two runs in the
JSON and the devices each ran on; `--rollouts` is the rollouts per step of both. When the two are
speculative runs, `--baseline NAME` (the colocated autoregressive run of the same study, as many
devices as --colocated) is what `async_vs_colocated_ar` divides: its measured step, which the model's
weak scaling keeps at any N. Without it, the baseline is the fitted pair's own colocated step with
generation at speedup 1.

    python3 benchmarks/async_projection.py benchmarks/results/<campaign>/async_study.json \
        --colocated frozen:2 --async async_frozen:1:1 --baseline ar --rollouts 256 --gpus 2 8 32

The model, stated so it can be argued with:
- Weak scaling: on N GPUs a step has rollouts x N / colocated devices rollouts, so every GPU of the
  colocated layout keeps the measured run's rows. Collectives that grow with N are ignored.
- Generation time on a device holding b rows is linear in b, t_gen(b) = a + c b: a fixed cost per
  decode step (weight reads, launches) plus a per-row one (KV reads, compute). a and c come from the
  two measured runs' generation at their rows per device (the colocated one and the async rollout
  mesh's). With `--generation-speedup s` (a measured speculative generation speedup), t_gen / s.
- The trainer's work (log-probs + update) is proportional to its rows per device: at the colocated
  run's rate per row on a trainer of several GPUs (its gradient reductions included), at the async
  run's rate on a trainer of one. The weight sync costs its measured seconds (the same bytes at any N).
- The colocated step adds what the colocated run spent outside generation, log-probs and update
  (rewards, host work) as measured. The async step is the measured overlap factor (async step over
  max(generation, trainer work + sync)) times max(t_gen(rows / n_r), trainer(rows / (N - n_r)) +
  sync), at the split n_r (rollout GPUs) that minimises it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

STUDY = "the study's own projection: ~2.5x end to end for async + EAGLE-3 at Qwen3-235B-A22B (simulator)"


@dataclass(frozen=True)
class Costs:
    gen_fixed_s: float  # a: seconds of generation per step whatever the rows
    gen_per_row_s: float  # c: seconds per row on one device
    train_per_row_s: float  # log-probs + update, seconds per row of a device of a one-GPU trainer
    train_per_row_multi_s: float  # the same on a trainer of several GPUs (the colocated run's rate)
    sync_s: float
    colocated_other_s: float  # the colocated step outside generation, log-probs and update
    overlap: float  # measured async step / max(generation, trainer work + sync)
    colocated_rows: float  # rows per device of the colocated run


def _run(runs: dict, name: str) -> dict:
    if name not in runs:
        raise ValueError(f"no run named {name!r} in the comparison (runs: {sorted(runs)})")
    return runs[name]


def _field(run: dict, name: str, key: str) -> float:
    value = run.get(key)
    if value is None:
        raise ValueError(f"run {name!r} has no {key} (is it an async run with timed steps?)")
    return float(value)


def fit_costs(
    runs: dict,
    colocated: str,
    colocated_devices: int,
    async_run: str,
    rollout_devices: int,
    trainer_devices: int,
    rollouts: int,
) -> Costs:
    """The model's costs from the two runs' medians (see the module docstring)."""
    col, asy = _run(runs, colocated), _run(runs, async_run)
    col_rows, gen_rows = rollouts / colocated_devices, rollouts / rollout_devices
    col_gen, asy_gen = _field(col, colocated, "generation_s"), _field(asy, async_run, "generation_s")
    if col_rows == gen_rows:
        raise ValueError(
            "the two runs hold the same rows per generating device: no slope to fit; "
            "use a different device split for the async run"
        )
    slope = (asy_gen - col_gen) / (gen_rows - col_rows)
    trainer = _field(asy, async_run, "logprob_s") + _field(asy, async_run, "train_s")
    col_phases = col_gen + _field(col, colocated, "logprob_s") + _field(col, colocated, "train_s")
    sync = _field(asy, async_run, "sync_s")
    return Costs(
        gen_fixed_s=col_gen - slope * col_rows,
        gen_per_row_s=slope,
        train_per_row_s=trainer / (rollouts / trainer_devices),
        train_per_row_multi_s=(col_phases - col_gen) / col_rows,
        sync_s=sync,
        colocated_other_s=_field(col, colocated, "step_s") - col_phases,
        overlap=_field(asy, async_run, "step_s") / max(asy_gen, trainer + sync),
        colocated_rows=col_rows,
    )


def generation_s(c: Costs, rows: float, speedup: float) -> float:
    return (c.gen_fixed_s + c.gen_per_row_s * rows) / speedup


def project(c: Costs, gpus: int, speedup: float = 1.0) -> dict:
    """Colocated and best-split async step seconds on `gpus` GPUs (weak scaling)."""
    rows = c.colocated_rows * gpus
    colocated = (
        generation_s(c, c.colocated_rows, speedup) + c.train_per_row_multi_s * c.colocated_rows + c.colocated_other_s
    )
    best = None
    for rollout_gpus in range(1, gpus):
        gen = generation_s(c, rows / rollout_gpus, speedup)
        trainer_gpus = gpus - rollout_gpus
        per_row = c.train_per_row_s if trainer_gpus == 1 else c.train_per_row_multi_s
        trainer = per_row * rows / trainer_gpus + c.sync_s
        step = c.overlap * max(gen, trainer)
        if best is None or step < best["async_step_s"]:
            best = {
                "rollout_gpus": rollout_gpus,
                "trainer_gpus": gpus - rollout_gpus,
                "async_step_s": step,
                "async_generation_s": gen,
                "async_trainer_s": trainer,
            }
    return {
        "gpus": gpus,
        "rollouts_per_step": rows,
        "generation_speedup": speedup,
        "colocated_step_s": colocated,
        **best,
        "async_vs_colocated": colocated / best["async_step_s"],
    }


def _split(text: str, parts: int, flag: str) -> list[str]:
    fields = text.split(":")
    if len(fields) != parts:
        raise ValueError(f"{flag} {text!r}: expected {parts} fields separated by ':'")
    return fields


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("comparison", help="grpo_compare.py --out JSON with a colocated and an async run")
    p.add_argument("--colocated", required=True, metavar="NAME:DEVICES")
    p.add_argument("--async", dest="async_run", required=True, metavar="NAME:ROLLOUT_DEVICES:TRAINER_DEVICES")
    p.add_argument("--rollouts", type=int, required=True, help="rollouts per step of both runs")
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 32])
    p.add_argument(
        "--generation-speedup",
        type=float,
        nargs="*",
        default=[],
        help="measured speculative generation speedups to project too",
    )
    p.add_argument(
        "--baseline",
        default=None,
        metavar="NAME",
        help="the colocated autoregressive run whose step async_vs_colocated_ar divides",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        col_name, col_devices = _split(args.colocated, 2, "--colocated")
        asy_name, rollout_devices, trainer_devices = _split(args.async_run, 3, "--async")
        with open(args.comparison, encoding="utf-8") as f:
            runs = json.load(f)
        costs = fit_costs(
            runs, col_name, int(col_devices), asy_name, int(rollout_devices), int(trainer_devices), args.rollouts
        )
        baseline = None if args.baseline is None else _field(_run(runs, args.baseline), args.baseline, "step_s")
    except (ValueError, OSError) as err:
        print(f"async_projection: {err}", file=sys.stderr)
        return 2
    rows = [project(costs, n, s) for s in [1.0, *args.generation_speedup] for n in args.gpus]
    for r in rows:  # the baseline of every row: the colocated autoregressive step on as many GPUs
        ar_step = baseline if baseline is not None else project(costs, r["gpus"])["colocated_step_s"]
        r["async_vs_colocated_ar"] = ar_step / r["async_step_s"]
    print(f"PROJECTION (computed from {args.comparison}, not measured); {STUDY}")
    print(
        f"fitted: generation {costs.gen_fixed_s:.3f} s + {1e3 * costs.gen_per_row_s:.3f} ms per row, trainer "
        f"{1e3 * costs.train_per_row_s:.3f} ms per row on one GPU, {1e3 * costs.train_per_row_multi_s:.3f} on "
        f"several, sync {costs.sync_s:.3f} s, overlap {costs.overlap:.3f}"
    )
    keys = [
        "gpus",
        "generation_speedup",
        "rollouts_per_step",
        "colocated_step_s",
        "rollout_gpus",
        "trainer_gpus",
        "async_step_s",
        "async_vs_colocated",
        "async_vs_colocated_ar",
    ]
    print(" ".join(f"{k:>19}" for k in keys))
    for r in rows:
        print(" ".join(f"{r[k]:>19.3f}" if isinstance(r[k], float) else f"{r[k]:>19}" for k in keys))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "projection": "computed, not measured (benchmarks/async_projection.py docstring)",
                    "source": args.comparison,
                    "baseline": args.baseline,
                    "study": STUDY,
                    "costs": vars(costs),
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
