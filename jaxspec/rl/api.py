"""`jaxspec.rl.train`: GRPO from Python (a notebook, a script), the same run as `jaxspec train`.

import jaxspec.rl
metrics = jaxspec.rl.train("configs/grpo_tiny.yaml", "runs/nb", overrides={"train.steps": 4})
metrics = jaxspec.rl.train("configs/grpo_tiny.yaml", "runs/nb", overrides={"train.steps": 8}, resume=True)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from jaxspec.config_io import from_dict, load_config, set_dotted, to_dict
from jaxspec.rl import driver
from jaxspec.rl.config import GRPOConfig
from jaxspec.rl.validation import validate


def run_config(config: str | os.PathLike | GRPOConfig, overrides: Mapping[str, Any] | None = None) -> GRPOConfig:
    """The checked run config: `config` (a YAML path or a GRPOConfig) with `overrides` applied.

    overrides: {"dotted.key": value} with Python values, e.g. {"train.steps": 4, "eval.every": 2,
    "spec.num_draft_tokens": 2}; the keys and types are checked as the YAML file's are.
    Raises ValueError naming the key (or FileNotFoundError for a missing file).
    """
    if isinstance(config, GRPOConfig):
        cfg, source = config, "<GRPOConfig>"
    else:
        cfg, source = load_config(GRPOConfig, config), str(config)
    if overrides:
        data = to_dict(cfg)
        for key, value in overrides.items():
            set_dotted(data, key, value, f"override {key!r}")
        cfg = from_dict(GRPOConfig, data, source=f"{source} with overrides")
    validate(cfg, source)
    return cfg


def train(
    config: str | os.PathLike | GRPOConfig,
    run_dir: str | os.PathLike,
    *,
    overrides: Mapping[str, Any] | None = None,
    resume: bool = False,
    on_step: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Runs (resume=True: continues from its latest checkpoint) GRPO into `run_dir`; what
    `jaxspec train --config CONFIG --run-dir RUN_DIR [--resume] key=value ...` runs.

    config: a YAML path or a GRPOConfig; overrides: {"dotted.key": value} (see `run_config`).
    on_step: called with each step's metrics record as it is logged (live plots); the record
        with "step" 0 is the validation before training.
    Returns the run's metrics records, one dict per logged step, from its start (a resumed run's
    earlier steps included): `<run_dir>/metrics.jsonl`. Keys as in `jaxspec.rl.metrics`:
    reward_mean, accuracy, acceptance_length, time_step_s, time_<phase>_s, eval_accuracy, ...
    Raises ValueError / FileNotFoundError for a bad config, input file or run directory before
    any compute, `jaxspec.rewards.RewardError` for a reward that cannot grade (`jaxspec.exits` maps
    each error to the CLI's exit status). A SIGTERM (or JAXSPEC_STOP_BY's time limit) during the run
    checkpoints and returns the steps done so far.
    """
    cfg = run_config(config, overrides)
    run_dir = Path(run_dir)
    driver.train(cfg, run_dir, resume=resume, on_step=on_step)
    metrics_file = run_dir / "metrics.jsonl"
    if not metrics_file.is_file():
        return []
    return [json.loads(line) for line in metrics_file.read_text(encoding="utf-8").splitlines() if line.strip()]
