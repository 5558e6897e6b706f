"""`jaxspec train --config PATH --run-dir DIR [--resume] [dotted.key=value ...]`."""

from __future__ import annotations

import sys
from pathlib import Path

from jaxspec.config_io import load_config, naming_overrides, run_parser
from jaxspec.distributed import initialize_from_env
from jaxspec.rl.checkpointing import check_run_dir
from jaxspec.rl.config import GRPOConfig
from jaxspec.rl.validation import validate
from jaxspec.rl.driver import train
from jaxspec.rl.resources import check_inputs
from jaxspec.run import EXIT_CHECKPOINTED


def _parser():
    return run_parser("jaxspec train", "GRPO post-training of a policy with (optionally speculative) rollouts, "
                      "in one JAX program.", "configs/grpo_tiny.yaml", "checkpoints, metrics and the trained policy")


def main(argv: list[str] | None = None) -> int:
    """Runs the command. A bad config, input file or run directory prints one line
    `jaxspec train: error: ...` and returns 2 before any compute. SIGTERM or Ctrl-C checkpoints at the
    next step boundary and returns EXIT_CHECKPOINTED (75: not finished, continue with --resume)."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        initialize_from_env()  # several processes (SLURM tasks, JAX_COORDINATOR_ADDRESS): one job
        cfg = load_config(GRPOConfig, args.config, args.overrides)
        with naming_overrides(args.config, args.overrides):
            validate(cfg, args.config)
        inputs = check_inputs(cfg)
        check_run_dir(cfg, Path(args.run_dir), args.resume)
    except (ValueError, FileNotFoundError) as err:
        print(f"jaxspec train: error: {err}", file=sys.stderr)
        return 2
    result = train(cfg, args.run_dir, resume=args.resume, inputs=inputs)
    return EXIT_CHECKPOINTED if result["preempted"] else 0
