"""Rows still running at each decode step of an autoregressive rollout, from the response lengths
that `jaxspec bench spec` records (every row's length in its JSON): how long the heavy tail keeps
a batch at low occupancy.

    python3 benchmarks/occupancy.py RESULT.json [--config ar] [--slots-config "ar slots=128"] \
        [--plot FILE.png] [--out FILE.json]

An autoregressive row emits one token per decode step, so the staged engine's occupancy follows
from the lengths exactly: the batch runs as calls of the JSON's `sub_batch` rows (all rows when
null) one after another, a call lasts as many decode steps as its longest row, and at step t of a
call the rows still running are those longer than t. Its loop decodes them in a batch of the
smallest of its stages (`jaxspec.rollout.stages.batch_stages`: B, B/2, B/4 rows, never below 32)
that holds them. Printed per call: its decode steps, the mean occupancy (running rows over the
call's rows), the share of its steps with at most a quarter and an eighth of its rows running, and
the decode steps spent on rows past the batch width they need.

With --slots-config, the same lengths through S slots (the configuration's `slots`), admitted in
row order as slots free up: the slot engine's occupancy, idealised (prefill, the schedule's
rounds of K decode steps and preemptions left out); its step count is printed beside the
measured run's (seconds / step_ms) as the check of that idealisation. The plot (needs
matplotlib) draws the running rows and the batch width against the decode step.

--admission-history CONFIG ... asks whether another admission order would end the slot run
sooner: the same lengths admitted longest first (an oracle that knows each row's length), and by
each named configuration's mean length per prompt (its groups of `samples_per_prompt` rows, the
same prompts drawn again: what a history of earlier epochs' answers would predict), longest
first; printed as decode steps beside the row order's.
"""

from __future__ import annotations

import argparse
import heapq
import json
from pathlib import Path

import numpy as np

from jaxspec.rollout.stages import batch_stages

TAIL_FRACTIONS = (0.25, 0.125)


def running_rows(lengths: np.ndarray) -> np.ndarray:
    """int [max(lengths)]: at each decode step t, the rows with length > t."""
    steps = np.arange(int(lengths.max()))
    return (lengths[None, :] > steps[:, None]).sum(axis=1)


def stage_widths(running: np.ndarray, rows: int) -> np.ndarray:
    """int [T]: the batch the staged loop decodes at each step, the smallest stage holding the
    running rows."""
    stages = np.array(sorted(batch_stages(rows)))
    return stages[np.searchsorted(stages, running)]


def slot_running(lengths: np.ndarray, slots: int, order: np.ndarray | None = None) -> np.ndarray:
    """int [T]: rows decoding at each step when `slots` slots take the rows in `order` (default row
    order), each slot taking the next row the step after its row ends (one token per row per step)."""
    ends: list[int] = []  # the steps at which the busy slots' rows end
    starts = np.zeros(len(lengths), dtype=np.int64)
    for i in range(len(lengths)) if order is None else order:
        start = heapq.heappop(ends) if len(ends) == slots else 0
        starts[i] = start
        heapq.heappush(ends, start + int(lengths[i]))
    total = int((starts + lengths).max())
    delta = np.zeros(total + 1, dtype=np.int64)
    np.add.at(delta, starts, 1)
    np.add.at(delta, starts + lengths, -1)
    return np.cumsum(delta)[:total]


def admission_orders(lengths: np.ndarray, samples: int, history: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Admission orders of rows whose groups of `samples` consecutive rows share a prompt: row order,
    longest first (the lengths known), and longest predicted first for each history's lengths (the
    same prompts' rows in another run: their mean per prompt predicts each row of the prompt)."""
    orders = {
        "row order": np.arange(len(lengths)),
        "longest first (known lengths)": np.argsort(-lengths, kind="stable"),
    }
    for name, other in history.items():
        predicted = np.repeat(other.reshape(-1, samples).mean(axis=1), samples)
        orders[f"by {name}'s mean per prompt"] = np.argsort(-predicted, kind="stable")
    return orders


def call_summary(running: np.ndarray, widths: np.ndarray, rows: int) -> dict:
    occupancy = running / rows
    return {
        "steps": int(len(running)),
        "mean_occupancy": float(occupancy.mean()),
        **{f"steps_at_most_{f:g}": float((occupancy <= f).mean()) for f in TAIL_FRACTIONS},
        "idle_row_steps": int((widths - running).sum()),
        "row_steps": int(widths.sum()),
    }


def staged_calls(lengths: np.ndarray, sub_batch: int | None) -> list[dict]:
    size = sub_batch or len(lengths)
    if len(lengths) % size:
        raise ValueError(f"sub_batch {size} does not divide the {len(lengths)} rows")
    calls = []
    for start in range(0, len(lengths), size):
        running = running_rows(lengths[start : start + size])
        widths = stage_widths(running, size)
        calls.append({"rows": size, **call_summary(running, widths, size), "running": running, "widths": widths})
    return calls


def find_row(result: dict, config: str) -> dict:
    for row in result["rows"]:
        if row["config"] == config:
            if "lengths" not in row:
                raise KeyError(f"configuration {config!r} records no per-row lengths (an older bench spec JSON)")
            return row
    raise KeyError(f"no configuration {config!r}; the file has {[r['config'] for r in result['rows']]}")


def plot(path: Path, calls: list[dict], slots: dict | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = len(calls) + (slots is not None)
    fig, axes = plt.subplots(panels, 1, figsize=(8, 2.2 * panels), squeeze=False)
    for i, (ax, call) in enumerate(zip(axes[:, 0], calls, strict=False)):
        ax.plot(call["running"], label="rows running")
        ax.plot(call["widths"], label="batch decoded", linestyle="--")
        ax.set_title(f"staged call {i + 1}: {call['rows']} rows, mean occupancy {call['mean_occupancy']:.2f}")
        ax.set_ylabel("rows")
        ax.legend(loc="upper right")
    if slots is not None:
        ax = axes[-1, 0]
        ax.plot(slots["running"], label="slots decoding")
        ax.set_title(f"{slots['slots']} slots (idealised), mean occupancy {slots['mean_occupancy']:.2f}")
        ax.set_ylabel("slots")
        ax.legend(loc="upper right")
    axes[-1, 0].set_xlabel("decode step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", type=Path, help="a `jaxspec bench spec --out` JSON")
    p.add_argument("--config", default="ar", help="the staged autoregressive configuration")
    p.add_argument("--slots-config", default=None, help="an autoregressive slot configuration, e.g. 'ar slots=128'")
    p.add_argument(
        "--admission-history",
        nargs="+",
        default=[],
        metavar="CONFIG",
        help="with --slots-config: also admit longest first, known and predicted from these configurations' lengths",
    )
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    result = json.loads(args.result.read_text(encoding="utf-8"))
    try:
        staged = find_row(result, args.config)
        slot_row = None if args.slots_config is None else find_row(result, args.slots_config)
        history = {
            name: np.asarray(find_row(result, name)["lengths"], dtype=np.int64) for name in args.admission_history
        }
    except KeyError as e:
        raise SystemExit(f"{args.result}: {e.args[0]}") from None
    lengths = np.asarray(staged["lengths"], dtype=np.int64)
    calls = staged_calls(lengths, result["baseline"].get("sub_batch"))
    print("| call | rows | decode steps | mean occupancy | steps with <= 1/4 running | <= 1/8 | decoded rows idle |")
    print("|---|---|---|---|---|---|---|")
    for i, c in enumerate(calls):
        print(
            f"| {i + 1} | {c['rows']} | {c['steps']} | {c['mean_occupancy']:.2f} | {c['steps_at_most_0.25']:.2f} | "
            f"{c['steps_at_most_0.125']:.2f} | {c['idle_row_steps'] / c['row_steps']:.2f} |"
        )
    slots = None
    if slot_row is not None:
        if not slot_row.get("slots"):
            raise SystemExit(f"{args.result}: {args.slots_config!r} is not a slot configuration")
        running = slot_running(np.asarray(slot_row["lengths"], dtype=np.int64), slot_row["slots"])
        measured = round(1e3 * slot_row["seconds"] / slot_row["step_ms"])
        slots = {
            "slots": slot_row["slots"],
            **call_summary(running, np.full_like(running, slot_row["slots"]), slot_row["slots"]),
        }
        slots |= {"measured_steps": measured, "running": running}
        print(
            f"{slot_row['slots']} slots, idealised: {slots['steps']} decode steps (the measured run: {measured}), mean "
            f"occupancy {slots['mean_occupancy']:.2f}, steps with <= 1/4 of the slots decoding "
            f"{slots['steps_at_most_0.25']:.2f}"
        )
        if history:
            samples = result["baseline"].get("samples_per_prompt") or 1
            lengths = np.asarray(slot_row["lengths"], dtype=np.int64)
            print("| admission order | decode steps | against row order |")
            print("|---|---|---|")
            slots["admission_steps"] = {}
            for name, order in admission_orders(lengths, samples, history).items():
                steps = len(slot_running(lengths, slot_row["slots"], order))
                slots["admission_steps"][name] = steps
                print(f"| {name} | {steps} | {steps / slots['steps']:.3f} |")
    elif args.admission_history:
        raise SystemExit("--admission-history needs --slots-config")
    if args.plot:
        plot(args.plot, calls, slots)
    if args.out:
        strip = lambda d: {k: v for k, v in d.items() if k not in ("running", "widths")}  # noqa: E731
        summary = {"source": args.result.name, "calls": [strip(c) for c in calls]}
        summary["slots"] = None if slots is None else strip(slots)
        args.out.write_text(json.dumps(summary, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
