"""The run directory and the checkpointed training state of a GRPO run.

State pytree (orbax `CheckpointManager`, atomic: a checkpoint directory appears only once complete):
    params, opt_state                 float32 policy and its optimizer state
    draft_params                      the EAGLE-3 head / draft model (when spec uses one)
    draft_opt_state                   (when draft.online; see `jaxspec.rl.online_draft`)
    ref_params                        frozen reference policy (when loss.kl_beta > 0)
    step, position, updates           int32: RL steps done, prompts consumed, optimizer updates
    key                               the run's PRNG key (uint32 [2]); step s uses fold_in(key, s)
    rollout, rollout_version          rollout.mode async, max_staleness k >= 1: slot "i" (0..k-1) holds
                                      the rollout mesh's weights copy of the batch of step step+1+i,
                                      rollout_version int32 [k] their versions (steps done then)
"""

from __future__ import annotations

from pathlib import Path

import yaml

from jaxspec.config_io import to_dict
from jaxspec.run import Checkpointer
from jaxspec.run import check_run_dir as run_dir_guard
from jaxspec.rl.config import RESUMABLE_KEYS, GRPOConfig

__all__ = ["Checkpointer", "check_run_dir", "save_config"]


def check_run_dir(cfg: GRPOConfig, run_dir: Path, resume: bool) -> None:
    """`jaxspec.run.check_run_dir`: only RESUMABLE_KEYS (loop length, checkpoint cadence, logging)
    may differ from the run's saved config.yaml."""
    run_dir_guard(run_dir, resume, to_dict(cfg), lambda key: key not in RESUMABLE_KEYS,
                  f"only {sorted(RESUMABLE_KEYS)} may change on resume")


def save_config(cfg: GRPOConfig, run_dir: Path) -> None:
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")
