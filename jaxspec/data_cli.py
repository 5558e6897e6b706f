"""`jaxspec data stats`: what a config's generated workload asks of a policy and its drafter.

Draws the first --num problems of a pretraining config's data section (its kinds, levels and
`tally` settings, from data.seed) as `jaxspec pretrain` does, times their generation, and prints
under the workload's tokenizer (--tokenizer, else data.tokenizer, else a BPE of data.vocab_size
trained on these problems as pretraining trains one on its corpus):

* response lengths in tokens (solution + eos): percentiles and a histogram; prompt lengths;
* the data's entropy per response token (nats) and the acceptance length an ideal greedy
  drafter of the data distribution reaches at draft depths k = 1..--max-draft
  (`jaxspec.tasks.workload`: an upper bound for a trained head);
* with --sweep, the same two for other values of the tally kind's variation knob.

--plot writes the figures (matplotlib), --json everything printed. Generating 2000 problems of
configs/pretrain_long.yaml takes ~3 s; their entropy and ideal acceptance ~1-2 min on one CPU core (as
long again per --sweep value).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxspec.config_io import load_config, naming_overrides
from jaxspec.pretrain.config import DataConfig, PretrainConfig, validate
from jaxspec.tasks.generator import generate_problems, generate_recorded
from jaxspec.tasks.tally import describe
from jaxspec.tasks.tokenizer import ChatTokenizer, train_tokenizer
from jaxspec.tasks.workload import SegmentTokenizer, analyze_response, percentiles, summarize

SUBCOMMANDS = ("stats",)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxspec data stats", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--config",
        required=True,
        help="pretraining config whose data section defines the workload (e.g. configs/pretrain_long.yaml)",
    )
    p.add_argument("--num", type=int, default=2000, help="problems to draw (default 2000)")
    p.add_argument("--seed", type=int, default=None, help="seed of the problems (default: data.seed)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json to count tokens with (e.g. a pretraining run's; "
        "default: data.tokenizer, else a BPE trained on the problems)",
    )
    p.add_argument("--max-draft", type=int, default=7, help="largest draft depth k of the ideal drafter (default 7)")
    p.add_argument(
        "--sweep",
        type=float,
        nargs="+",
        default=[],
        metavar="V",
        help="also report entropy and ideal acceptance at these values of data.tally.variation",
    )
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write the figures here (needs matplotlib)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the report here as JSON")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. data.tally.variation=0.5")
    return p


def _tokenizer(data: DataConfig, path: str | None, problems: list[dict], folder: Path) -> tuple[ChatTokenizer, str]:
    """(the tokenizer, where it came from)."""
    source = path or data.tokenizer
    if source is None:
        source = folder / "tokenizer.json"
        train_tokenizer((t for p in problems for t in (p["question"], p["solution"])), data.vocab_size, source)
        origin = f"a byte-level BPE (data.vocab_size={data.vocab_size}) trained on these problems"
    else:
        origin = str(source)
    tok = ChatTokenizer.from_file(
        source,
        eos_token=data.eos_token,
        pad_token=data.pad_token,
        bos_token=data.bos_token,
        prompt_template=data.prompt_template,
    )
    return tok, origin


def response_lengths(
    data: DataConfig, problems: list[dict], tokenizer: str | None = None
) -> tuple[list[int], ChatTokenizer, str]:
    """The lengths in tokens (solution + eos) of the responses of `problems` (drawn from `data`,
    `jaxspec.tasks.generate_problems`) under the workload's tokenizer (`tokenizer`, else
    data.tokenizer, else a BPE of data.vocab_size trained on them). Returns (lengths, the
    tokenizer, where it came from)."""
    with tempfile.TemporaryDirectory() as folder:
        tok, origin = _tokenizer(data, tokenizer, problems, Path(folder))
    return [len(tok.encode_response(p["solution"])) for p in problems], tok, origin


def _analyze(
    data: DataConfig, num: int, seed: int, tok: ChatTokenizer, max_depth: int, expected: list[dict] | None = None
) -> dict:
    """`summarize` of the first `num` problems of `data` (ValueError if they differ from `expected`:
    recording the choice points must not change what is drawn)."""
    recorded = generate_recorded(num, seed, data.levels, data.kinds, data.tally)
    if expected is not None and [p for p, _ in recorded] != expected:
        raise ValueError("the recorded problems differ from the generated ones (generation is not deterministic)")
    tokens = SegmentTokenizer(tok)
    return summarize([analyze_response(segments, tokens) for _, segments in recorded], max_depth)


def _histogram(lengths: list[int]) -> list[tuple[int, int, int]]:
    """(low, high, count) over power-of-two bins [2^i, 2^(i+1)) covering `lengths`."""
    low, high = int(math.log2(min(lengths))), int(math.log2(max(lengths)))
    counts = np.bincount(np.log2(lengths).astype(int) - low, minlength=high - low + 1)
    return [(2 ** (low + i), 2 ** (low + i + 1), int(c)) for i, c in enumerate(counts)]


def _fmt(stats: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.0f}" for k, v in stats.items())


def _print_report(report: dict) -> None:
    main = report["analysis"]
    print(
        f"workload: kinds {report['kinds']}, levels {report['levels']}"
        + (f"; tally: {report['tally_law']}" if "tally" in report["kinds"] else "")
    )
    print(
        f"{report['num']} problems (seed {report['seed']}) generated in {report['generate_seconds']:.2f} s; "
        f"tokenizer: {report['tokenizer']} ({report['vocab_size']} tokens)"
    )
    print(f"response tokens (solution + eos): {_fmt(main['response_tokens'])}  mean {main['mean_response_tokens']:.0f}")
    print(f"prompt tokens: {_fmt(report['prompt_tokens'])}")
    print(f"solution lines: {_fmt(report['solution_lines'])}")
    width = max(count for _, _, count in report["histogram"])
    for low, high, count in report["histogram"]:
        print(f"  [{low:>6}, {high:>6}) {count:>6} {'#' * round(40 * count / width)}")
    print(
        f"entropy: {main['entropy_per_token']:.3f} nats per response token "
        f"({main['entropy_per_response']:.1f} nats per response)"
    )
    ks = range(1, len(main["ideal_acceptance"]) + 1)
    print(
        "ideal greedy drafter, acceptance length: "
        + "  ".join(
            f"k={k} {a:.2f}±{e:.2f}" for k, a, e in zip(ks, main["ideal_acceptance"], main["ideal_acceptance_se"])
        )
    )
    if report["sweep"]:
        print("\nvariation  entropy/token  " + "  ".join(f"k={k:<3}" for k in ks))
        for row in report["sweep"]:
            print(
                f"{row['variation']:>9.3f}  {row['entropy_per_token']:>13.3f}  "
                + "  ".join(f"{a:5.2f}" for a in row["ideal_acceptance"])
            )


def _plot(report: dict, lengths: list[int], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install matplotlib)") from None
    panels = 3 if report["sweep"] else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    ax = axes[0, 0]
    ax.hist(lengths, bins=np.geomspace(min(lengths), max(lengths) + 1, 40))
    ax.set_xscale("log")
    for name, value in report["analysis"]["response_tokens"].items():
        ax.axvline(value, color="k", lw=0.6, ls=":")
        ax.text(value, ax.get_ylim()[1] * 0.95, name, rotation=90, va="top", ha="right", fontsize=7)
    ax.set(
        xlabel="response tokens (solution + eos)",
        ylabel="problems",
        title=f"{report['num']} problems, kinds {', '.join(report['kinds'])}",
    )
    if report["sweep"]:
        variation = [row["variation"] for row in report["sweep"]]
        axes[0, 1].plot(variation, [row["entropy_per_token"] for row in report["sweep"]], "o-")
        axes[0, 1].set(xlabel="data.tally.variation", ylabel="entropy per response token (nats)")
        curves = np.array([row["ideal_acceptance"] for row in report["sweep"]])
        for k in range(curves.shape[1]):
            axes[0, 2].plot(variation, curves[:, k], "o-", label=f"k={k + 1}")
        axes[0, 2].set(xlabel="data.tally.variation", ylabel="ideal acceptance length")
        axes[0, 2].legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def stats(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.num < 1:
        raise ValueError(f"--num must be >= 1, got {args.num}")
    if args.max_draft < 1:
        raise ValueError(f"--max-draft must be >= 1, got {args.max_draft}")
    bad = [v for v in args.sweep if not 0.0 <= v <= 1.0]
    if bad:
        raise ValueError(f"--sweep: variation values must be in [0, 1], got {bad}")
    if args.tokenizer is not None and not Path(args.tokenizer).is_file():
        raise FileNotFoundError(f"--tokenizer: file not found: {args.tokenizer}")
    cfg = load_config(PretrainConfig, args.config, args.overrides)
    with naming_overrides(args.config, args.overrides):
        validate(cfg, args.config)
    data = cfg.data
    seed = data.seed if args.seed is None else args.seed
    start = time.perf_counter()
    problems = generate_problems(args.num, seed, data.levels, data.kinds, tally=data.tally)
    generate_seconds = time.perf_counter() - start
    lengths, tok, origin = response_lengths(data, problems, args.tokenizer)
    report = {
        "config": args.config,
        "overrides": args.overrides,
        "kinds": list(data.kinds),
        "levels": list(data.levels),
        "tally": dataclasses.asdict(data.tally),
        "tally_law": describe(data.tally),
        "num": args.num,
        "seed": seed,
        "generate_seconds": generate_seconds,
        "tokenizer": origin,
        "vocab_size": tok.vocab_size,
        "prompt_tokens": percentiles([len(tok.encode_prompt(p["question"])) for p in problems]),
        "solution_lines": percentiles([p["solution"].count("\n") + 1 for p in problems]),
        "histogram": _histogram(lengths),
    }
    start = time.perf_counter()
    report["analysis"] = _analyze(data, args.num, seed, tok, args.max_draft, expected=problems)
    report["sweep"] = [
        {
            "variation": v,
            **_analyze(
                dataclasses.replace(data, tally=dataclasses.replace(data.tally, variation=v)),
                args.num,
                seed,
                tok,
                args.max_draft,
            ),
        }
        for v in args.sweep
    ]
    report["analyze_seconds"] = time.perf_counter() - start
    _print_report(report)
    print(f"(entropy and acceptance computed in {report['analyze_seconds']:.1f} s)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.plot:
        _plot(report, lengths, args.plot)
        print(f"figures: {args.plot}")
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in SUBCOMMANDS:
        usage = f"usage: jaxspec data {{{','.join(SUBCOMMANDS)}}} ...; `jaxspec data stats --help` for its options"
        if argv and argv[0] in ("-h", "--help"):
            print(usage)
            return 0
        print(usage, file=sys.stderr)
        return 2
    return stats(argv[1:])
