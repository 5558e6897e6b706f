"""The run directory's config and the checkpointed training state of a GRPO run (the run directory's
guard: `jaxspec.run.check_run_dir` with `jaxspec.rl.config.FIXED_ON_RESUME`).

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
from jaxspec.distributed import is_main, say
from jaxspec.rl.config import RESUMABLE_KEYS, GRPOConfig
from jaxspec.run import Checkpointer
from jaxspec.run.run_dir import flatten

__all__ = ["Checkpointer", "record_config", "save_config"]


def save_config(cfg: GRPOConfig, run_dir: Path) -> None:
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")


def record_config(cfg: GRPOConfig, run_dir: Path, restored_step: int | None) -> None:
    """Writes the run's config.yaml (process 0). Resuming from `restored_step`, first says which
    RESUMABLE_KEYS differ from the saved config ("--resume: train.steps 14 -> 20 ..."), and refuses
    (ValueError, config.yaml unchanged) a train.steps below the steps the run has done."""
    saved_file = run_dir / "config.yaml"
    if restored_step is not None:
        if cfg.train.steps < restored_step:
            raise ValueError(
                f"--resume: train.steps={cfg.train.steps} but the run in {run_dir} has done "
                f"{restored_step} steps; give train.steps >= {restored_step} ({saved_file.name} is "
                f"unchanged)"
            )
        if saved_file.exists():
            saved, current = (
                flatten(yaml.safe_load(saved_file.read_text(encoding="utf-8")) or {}),
                flatten(to_dict(cfg)),
            )
            changed = [
                f"{key} {saved[key]!r} -> {current.get(key)!r}"
                for key in sorted(RESUMABLE_KEYS)
                if key in saved and saved[key] != current.get(key)
            ]
            if changed:
                say(
                    f"--resume: {', '.join(changed)} (the run has done {restored_step} steps; {saved_file.name} "
                    f"updated)"
                )
    if is_main():
        save_config(cfg, run_dir)
