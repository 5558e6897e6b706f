"""The long workload's entropy knob against what a trained policy and head make of it: for each
`data.tally.variation`, the policy's entropy per sampled token and the EAGLE-3 head's acceptance
length at k = 1..7, from the `jaxspec bench spec` results of `benchmarks/long_workload.sh knob`.

    python3 benchmarks/knob_curve.py RESULTS/spec_long_v0.5.json RESULTS/spec_long_v0.7.json ... \
        [--out RESULTS/knob_curve.json] [--plot RESULTS/knob_curve.png]

Each file's variation is read from its name (`spec_long_v<variation>.json`); its AR row gives the
policy's entropy (`nats_per_token`, an estimate from its own T=1 rollouts) and its k=7 chain's
acceptance rate per position p_1..p_7 (the probability that draft position i is accepted given
that the ones before it were) gives the acceptance length at every depth k <= 7:
1 + p_1 + p_1 p_2 + ... + p_1 ... p_k, the mean tokens a step of a k-token chain emits.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

NAME = re.compile(r"spec_long_v(?P<variation>[0-9.]+)\.json$")
DEPTH = 7


def acceptance_by_depth(rates: list[float]) -> list[float]:
    """Acceptance length at k = 1..len(rates) from the per-position acceptance rates of one chain (a
    position no step reached has no rate, NaN: it adds nothing)."""
    lengths, reach, total = [], 1.0, 1.0
    for rate in rates:
        reach = reach * rate if reach > 0 else 0.0
        total += reach
        lengths.append(total)
    return lengths


def knob_point(path: Path) -> dict:
    """{variation, nats_per_token, acceptance (k = 1..7), chain_k7_acceptance_length} of one result file."""
    match = NAME.search(path.name)
    if match is None:
        raise SystemExit(f"{path}: not a spec_long_v<variation>.json file of `long_workload.sh knob`")
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))["rows"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"{path}: not a `jaxspec bench spec` result ({e})") from e
    by_config = {row["config"]: row for row in rows}
    chain = by_config.get(f"eagle3 chain k={DEPTH}")
    if "ar" not in by_config or chain is None or len(chain["acceptance_per_position"]) != DEPTH:
        raise SystemExit(f"{path}: needs the rows 'ar' and 'eagle3 chain k={DEPTH}' (bench spec --k {DEPTH})")
    return {
        "variation": float(match["variation"]),
        "nats_per_token": by_config["ar"]["nats_per_token"],
        "acceptance": acceptance_by_depth(chain["acceptance_per_position"]),
        "chain_k7_acceptance_length": chain["acceptance_length"],
    }


def plot(points: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for point in points:
        label = f"variation {point['variation']:g} ({point['nats_per_token']:.2f} nats/token)"
        ax.plot(range(1, DEPTH + 1), point["acceptance"], marker="o", label=label)
    ax.set_xlabel("draft depth k")
    ax.set_ylabel("acceptance length (tokens per step)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="spec_long_v<variation>.json files")
    p.add_argument("--out", type=Path, default=None, help="write the curve as JSON here")
    p.add_argument("--plot", type=Path, default=None, help="plot acceptance against depth here (PNG)")
    args = p.parse_args(argv)
    points = sorted((knob_point(path) for path in args.results), key=lambda point: point["variation"])
    print(f"| variation | nats per token | {' | '.join(f'k={k}' for k in range(1, DEPTH + 1))} |")
    print(f"|---|---|{'---|' * DEPTH}")
    for point in points:
        cells = " | ".join(f"{a:.2f}" for a in point["acceptance"])
        print(f"| {point['variation']:g} | {point['nats_per_token']:.3f} | {cells} |")
    if args.out is not None:
        args.out.write_text(json.dumps(points, indent=1), encoding="utf-8")
    if args.plot is not None:
        plot(points, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
