"""The `jaxspec` command line: each sub-command lives in its own module with a `main(argv)`."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "pretrain": ("jaxspec.pretrain", "train a small policy from scratch on the math task; export an HF folder"),
    "generate": ("jaxspec.generate_cli", "sample rollouts from a policy and score them with a reward"),
    "draft": ("jaxspec.draft_training.cli", "draft heads: `jaxspec draft train` trains an EAGLE-3 head on policy rollouts"),
    "train": ("jaxspec.rl", "GRPO post-training with (speculative) rollouts, checkpoints and exact resume"),
    "data": ("jaxspec.data_cli", "`jaxspec data stats`: a config's workload: lengths, entropy, ideal acceptance"),
}
BENCHMARKS = {
    "forward": ("jaxspec.bench.forward", "training-shaped forward/backward throughput and MFU"),
    "decode": ("jaxspec.bench.decode", "autoregressive decode vs the memory roofline and transformers"),
    "spec": ("jaxspec.bench.spec", "speculative vs autoregressive rollouts on a trained policy and draft"),
    "spec-cost": ("jaxspec.bench.spec_cost", "costs of the pieces of a speculative step; projected speedup"),
    "attention": ("jaxspec.bench.attention", "ragged cache-attention kernel vs dense attention, by cache fill"),
    "verify": ("jaxspec.bench.verify", "tree-verification kernel vs its jnp reference and the copy bandwidth"),
    "grpo-step": ("jaxspec.bench.grpo_step", "time and peak memory of each phase of one GRPO step on a mesh"),
    "profile": ("jaxspec.bench.profile", "device time of a decode-loop iteration by phase (AR vs speculative)"),
}


def _usage() -> str:
    lines = ["usage: jaxspec <command> [args]", "", "commands:"]
    lines += [f"  {name:<16}{doc}" for name, (_, doc) in COMMANDS.items()]
    lines += [f"  bench {name:<10}{doc}" for name, (_, doc) in BENCHMARKS.items()]
    lines += ["", "`jaxspec <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    table, name, rest = COMMANDS, argv[0], argv[1:]
    if name == "bench":
        if not rest or rest[0] not in BENCHMARKS:
            print(f"jaxspec bench: expected one of {sorted(BENCHMARKS)}", file=sys.stderr)
            return 2
        table, name, rest = BENCHMARKS, rest[0], rest[1:]
    if name not in table:
        print(f"jaxspec: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(table[name][0])
    try:
        return int(module.main(rest) or 0)
    except (ValueError, FileNotFoundError) as err:
        print(f"jaxspec {name}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (those checkpoint and return)
        print(f"jaxspec {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
