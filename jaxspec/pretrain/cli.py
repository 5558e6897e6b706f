"""`jaxspec pretrain --config PATH --run-dir DIR [--resume] [dotted.key=value ...]`."""

from __future__ import annotations

import sys
from pathlib import Path

from jaxspec.config_io import load_validated, run_command, run_parser
from jaxspec.pretrain.config import FIXED_ON_RESUME, PretrainConfig, validate
from jaxspec.pretrain.run import pretrain
from jaxspec.run import check_run_dir
from jaxspec.run.placement import check_devices


def _parser():
    return run_parser(
        "jaxspec pretrain",
        "Generate the math corpus, train a tokenizer and a Qwen3 policy from scratch, and export it as an HF folder.",
        "configs/pretrain_tiny.yaml",
        "data, checkpoints, metrics, export",
    )


def main(argv: list[str] | None = None) -> int:
    """Runs the command; a bad config or run directory prints one error line and returns 2 before
    any compute. SIGTERM, Ctrl-C or the job's time limit (JAXSPEC_STOP_BY) checkpoints at the next
    step and returns EXIT_CHECKPOINTED (75)."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)

    def prepare() -> PretrainConfig:
        cfg = load_validated(PretrainConfig, validate, args)
        check_devices(cfg.mesh)
        check_run_dir(Path(args.run_dir), args.resume, cfg, FIXED_ON_RESUME)
        return cfg

    return run_command("jaxspec pretrain", prepare, lambda cfg: pretrain(cfg, args.run_dir, resume=args.resume))
