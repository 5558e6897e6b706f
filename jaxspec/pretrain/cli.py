"""`jaxspec pretrain --config PATH --run-dir DIR [--resume] [dotted.key=value ...]`."""

from __future__ import annotations

import sys
from pathlib import Path

from jaxspec.config_io import load_config, naming_overrides, run_parser
from jaxspec.placement import check_devices
from jaxspec.pretrain.config import PretrainConfig, validate
from jaxspec.pretrain.run import check_run_dir, pretrain
from jaxspec.run import EXIT_CHECKPOINTED


def _parser():
    return run_parser("jaxspec pretrain", "Generate the math corpus, train a tokenizer and a Qwen3 policy from "
                      "scratch, and export it as an HF folder.", "configs/tiny.yaml",
                      "data, checkpoints, metrics, export")


def main(argv: list[str] | None = None) -> int:
    """Runs the command; a bad config or run directory prints one error line and returns 2.
    SIGTERM or Ctrl-C checkpoints at the next step and returns EXIT_CHECKPOINTED (75)."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(PretrainConfig, args.config, args.overrides)
        with naming_overrides(args.config, args.overrides):
            validate(cfg, args.config)
        check_devices(cfg.mesh)
        check_run_dir(cfg, Path(args.run_dir), args.resume)
    except (ValueError, FileNotFoundError) as err:
        print(f"jaxspec pretrain: error: {err}", file=sys.stderr)
        return 2
    result = pretrain(cfg, args.run_dir, resume=args.resume)
    return EXIT_CHECKPOINTED if result["preempted"] else 0
