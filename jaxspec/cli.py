"""The `jaxspec` command line: each sub-command lives in its own module with a `main(argv)`.

An error ends the output with one line `jaxspec <command>: error: ...` and an exit status of its
kind (`jaxspec.exits`).
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import traceback

from jaxspec.exits import EXIT_CHECKPOINTED, EXIT_ERROR, EXIT_INPUT, EXIT_INTERRUPTED, exit_status

COMMANDS = {
    "pretrain": ("jaxspec.pretrain", "train a small policy from scratch on the math task; export an HF folder"),
    "generate": ("jaxspec.generate_cli", "sample rollouts from a policy and score them with a reward"),
    "draft": (
        "jaxspec.draft_training.cli",
        "draft heads: `jaxspec draft train` trains an EAGLE-3 head on policy rollouts",
    ),
    "train": ("jaxspec.rl", "GRPO post-training with (speculative) rollouts, checkpoints and exact resume"),
    "data": ("jaxspec.data_cli", "`jaxspec data stats`: a config's workload: lengths, entropy, ideal acceptance"),
}
BENCHMARKS = {
    "forward": ("jaxspec.bench.forward", "training-shaped forward/backward throughput and MFU"),
    "decode": ("jaxspec.bench.decode", "autoregressive decode vs the memory roofline and transformers"),
    "spec": ("jaxspec.bench.spec", "speculative vs autoregressive rollouts on a trained policy and draft"),
    "spec-cost": ("jaxspec.bench.spec_cost", "costs of the pieces of a speculative step; projected speedup"),
    "mlp": ("jaxspec.bench.mlp", "a dense MLP's gate and up projections as two GEMMs and as one, vs the roofline"),
    "layer-kernels": (
        "jaxspec.bench.layer_kernels",
        "the residual-norm and attention-prologue kernels vs XLA's pieces",
    ),
    "projections": (
        "jaxspec.bench.projections",
        "a step's weight projections, XLA's GEMMs vs the thin-matmul kernel, vs the roofline",
    ),
    "attention": ("jaxspec.bench.attention", "ragged cache-attention kernel vs dense attention, by cache fill"),
    "verify": ("jaxspec.bench.verify", "tree-verification kernel vs its jnp reference and the copy bandwidth"),
    "grpo-step": ("jaxspec.bench.grpo_step", "time and peak memory of each phase of one GRPO step on a mesh"),
    "profile": ("jaxspec.bench.profile", "device time of a decode-loop iteration by phase (AR vs speculative)"),
}


def _usage() -> str:
    lines = ["usage: jaxspec <command> [args]", "", "commands:"]
    lines += [f"  {name:<16}{doc}" for name, (_, doc) in COMMANDS.items()]
    lines += [f"  bench {name:<13} {doc}" for name, (_, doc) in BENCHMARKS.items()]
    lines += ["", "`jaxspec <command> --help` for a command's options; exit statuses: `jaxspec.exits`."]
    return "\n".join(lines)


def main(argv: list[str] | None = None, *, last_words: bool = False) -> int:
    """Runs a command; returns its exit status (an error prints its one line, see the module doc).
    last_words: the process exits right after an error (`entry`): the error line is then the last
    thing written to stderr, whatever a background thread (a checkpoint write failing too) prints
    before the exit."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else EXIT_INPUT
    table, name, rest = COMMANDS, argv[0], argv[1:]
    if name == "bench":
        if not rest or rest[0] not in BENCHMARKS:
            print(f"jaxspec bench: expected one of {sorted(BENCHMARKS)}", file=sys.stderr)
            return EXIT_INPUT
        table, name, rest = BENCHMARKS, rest[0], rest[1:]
    if name not in table:
        print(f"jaxspec: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return EXIT_INPUT
    module = importlib.import_module(table[name][0])
    try:
        return int(module.main(rest) or 0)
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (those checkpoint and return)
        print(f"jaxspec {name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as err:
        from jaxspec.distributed import await_peer_failure

        await_peer_failure(err)  # a collective that failed because a peer died: that is the error to report
        status, message = exit_status(err)
        if status == EXIT_ERROR:
            traceback.print_exc()
        line = f"jaxspec {name}: error: {message}"
        if last_words:
            _say_last(line)
        else:
            print(line, file=sys.stderr, flush=True)
        return status


def _say_last(line: str) -> None:
    """Writes `line` to stderr and sends everything written there after it to /dev/null. Complete
    lines are already out (stderr is line-buffered); what the buffer still holds is part of a line
    another thread is writing (a background checkpoint's traceback), so it goes to /dev/null too,
    not in front of `line`. That thread may also have flushed the start of a line already (a long
    write goes out in pieces), so while other threads run, `line` starts on a line of its own."""
    stderr = os.dup(2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    sys.stderr.flush()
    fresh_line = "\n" if threading.active_count() > 1 else ""
    os.write(stderr, f"{fresh_line}{line}\n".encode())


def entry() -> None:
    """The console command: `main`, then exit. After an error the process exits at once, so that
    the error stays the last line (threads still writing a checkpoint or a log are not waited for;
    checkpoints are atomic)."""
    status = main(last_words=True)
    if status not in (0, EXIT_CHECKPOINTED):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    entry()
