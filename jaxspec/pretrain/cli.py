"""`jaxspec pretrain --config PATH --run-dir DIR [--resume] [dotted.key=value ...]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxspec.config_io import load_config
from jaxspec.pretrain.config import PretrainConfig, validate
from jaxspec.pretrain.run import check_run_dir, pretrain


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxspec pretrain",
        description="Generate the math corpus, train a tokenizer and a Qwen3 policy from scratch, "
                    "and export it as an HF folder.")
    parser.add_argument("--config", required=True, help="YAML config (see configs/tiny.yaml)")
    parser.add_argument("--run-dir", required=True, help="directory for data, checkpoints, metrics, export")
    parser.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.steps=100")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command; a bad config or run directory prints one error line and returns 2."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(PretrainConfig, args.config, args.overrides)
        validate(cfg, args.config)
        check_run_dir(cfg, Path(args.run_dir), args.resume)
    except (ValueError, FileNotFoundError) as err:
        print(f"jaxspec pretrain: error: {err}", file=sys.stderr)
        return 2
    pretrain(cfg, args.run_dir, resume=args.resume)
    return 0
