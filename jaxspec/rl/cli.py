"""`jaxspec train --config PATH --run-dir DIR [--resume] [dotted.key=value ...]`."""

from __future__ import annotations

import sys
from pathlib import Path

from jaxspec.config_io import load_validated, run_command, run_parser
from jaxspec.distributed import initialize_from_env
from jaxspec.rl.config import FIXED_ON_RESUME, GRPOConfig
from jaxspec.rl.driver import train
from jaxspec.rl.resources import check_inputs
from jaxspec.rl.validation import validate
from jaxspec.run import check_run_dir


def _parser():
    return run_parser(
        "jaxspec train",
        "GRPO post-training of a policy with (optionally speculative) rollouts, in one JAX program.",
        "configs/grpo_tiny.yaml",
        "checkpoints, metrics and the trained policy",
    )


def main(argv: list[str] | None = None) -> int:
    """Runs the command. A bad config, input file, reward or run directory prints one line
    `jaxspec train: error: ...` before any compute and returns the status of its kind
    (`jaxspec.exits`: 2, or 3 for a reward that cannot grade).
    SIGTERM, Ctrl-C or the job's time limit (JAXSPEC_STOP_BY, `jaxspec.rl.driver`) checkpoints at a
    step boundary and returns EXIT_CHECKPOINTED (75: not finished, continue with --resume)."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)

    def prepare() -> tuple:
        initialize_from_env()  # several processes (SLURM tasks, JAX_COORDINATOR_ADDRESS): one job
        cfg = load_validated(GRPOConfig, validate, args)
        inputs = check_inputs(cfg)
        check_run_dir(Path(args.run_dir), args.resume, cfg, FIXED_ON_RESUME)
        return cfg, inputs

    return run_command(
        "jaxspec train",
        prepare,
        lambda prepared: train(prepared[0], args.run_dir, resume=args.resume, inputs=prepared[1]),
    )
