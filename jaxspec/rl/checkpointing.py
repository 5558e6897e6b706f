"""The run directory and the checkpointed training state of a GRPO run.

State pytree (orbax `CheckpointManager`, atomic: a checkpoint directory appears only once complete):
    params, opt_state                 float32 policy and its optimizer state
    draft_params                      the EAGLE-3 head / draft model (when spec uses one)
    draft_opt_state                   (when draft.online)
    ref_params                        frozen reference policy (when loss.kl_beta > 0)
    step, position, updates           int32: RL steps done, prompts consumed, optimizer updates
    key                               the run's PRNG key (uint32 [2]); step s uses fold_in(key, s)
    rollout, rollout_version          rollout.mode async: the rollout mesh's weights copy that the batch
                                      in flight was generated with, and its version (steps done then)
"""

from __future__ import annotations

from pathlib import Path

import yaml

from jaxspec.config_io import to_dict
from jaxspec.run import Checkpointer
from jaxspec.rl.config import RESUMABLE_KEYS, GRPOConfig

__all__ = ["Checkpointer", "check_run_dir", "save_config"]


def _flatten(tree, prefix: str = "") -> dict:
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}{key}."))
    return out


def check_run_dir(cfg: GRPOConfig, run_dir: Path, resume: bool) -> None:
    """Refuses to overwrite a run without --resume, or to resume with settings that change training.

    Only RESUMABLE_KEYS (loop length, checkpoint cadence, logging) may differ from the run's
    saved config.yaml.
    """
    checkpoints = run_dir / "checkpoints"
    if not resume and checkpoints.is_dir() and any(checkpoints.iterdir()):
        raise ValueError(f"{run_dir} already holds checkpoints; pass --resume or choose a new --run-dir")
    saved_file = run_dir / "config.yaml"
    if resume and saved_file.exists():
        saved = _flatten(yaml.safe_load(saved_file.read_text(encoding="utf-8")) or {})
        current = _flatten(to_dict(cfg))
        changed = sorted(k for k in set(saved) | set(current)
                         if k not in RESUMABLE_KEYS and saved.get(k) != current.get(k))
        if changed:
            key = changed[0]
            raise ValueError(f"--resume: {key} is {current.get(key)!r} but the run in {run_dir} used "
                             f"{saved.get(key)!r}; only {sorted(RESUMABLE_KEYS)} may change on resume")


def save_config(cfg: GRPOConfig, run_dir: Path) -> None:
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")
