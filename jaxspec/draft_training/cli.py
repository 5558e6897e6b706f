"""`jaxspec draft train --config PATH --run-dir DIR [--resume] [dotted.key=value ...]`."""

from __future__ import annotations

import sys
from pathlib import Path

from jaxspec.config_io import load_validated, run_command, run_parser
from jaxspec.draft_training.config import FIXED_ON_RESUME, DraftTrainConfig, validate
from jaxspec.draft_training.train import train_head
from jaxspec.run import check_run_dir
from jaxspec.run.placement import check_devices

VERBS = {"train": "train an EAGLE-3 head on the policy's own rollouts; export it in the public layout"}


def _train_parser():
    return run_parser(
        "jaxspec draft train",
        "Train an EAGLE-3 draft head against a frozen policy that generates "
        "its own training data, and export it in the public EAGLE-3 layout.",
        "configs/head_tiny.yaml",
        "checkpoints, metrics and the export",
    )


def _usage() -> str:
    return "usage: jaxspec draft <verb> [args]\n\nverbs:\n" + "\n".join(
        f"  {verb:<8}{doc}" for verb, doc in VERBS.items()
    )


def main(argv: list[str] | None = None) -> int:
    """Runs `jaxspec draft <verb>`; a bad config or run directory prints one error line and returns 2
    before any compute. SIGTERM, Ctrl-C or the job's time limit (JAXSPEC_STOP_BY) checkpoints at
    the next step and returns EXIT_CHECKPOINTED (75)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] not in VERBS:
        print(f"jaxspec draft: unknown verb {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    args = _train_parser().parse_args(argv[1:])

    def prepare() -> DraftTrainConfig:
        cfg = load_validated(DraftTrainConfig, validate, args)
        check_devices(cfg.mesh)
        cfg.policy_path()
        check_run_dir(Path(args.run_dir), args.resume, cfg, FIXED_ON_RESUME)
        return cfg

    return run_command("jaxspec draft train", prepare, lambda cfg: train_head(cfg, args.run_dir, resume=args.resume))
