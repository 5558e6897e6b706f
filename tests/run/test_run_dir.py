"""The run-directory guard: a resumed run keeps its training settings; keys that jaxspec added after
the run started count as their defaults."""

import pytest
import yaml

from jaxspec.config_io import to_dict
from jaxspec.rl.config import FIXED_ON_RESUME, GRPOConfig, GRPOLossConfig, GRPOTrainConfig
from jaxspec.run import check_run_dir


def _saved_run(tmp_path, cfg: GRPOConfig, drop: tuple[str, ...] = ()):
    """A run directory holding a checkpoint and `cfg` as its config.yaml, without the dotted keys `drop`."""
    data = to_dict(cfg)
    for key in drop:
        section, name = key.split(".")
        del data[section][name]
    (tmp_path / "checkpoints" / "1").mkdir(parents=True)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    return tmp_path


def test_a_key_added_after_the_run_started_resumes_at_its_default(tmp_path):
    cfg = GRPOConfig(train=GRPOTrainConfig(steps=4))
    run_dir = _saved_run(tmp_path, cfg, drop=("loss.routing_replay", "data.tally"))
    check_run_dir(run_dir, True, cfg, FIXED_ON_RESUME)
    changed = GRPOConfig(train=GRPOTrainConfig(steps=4), loss=GRPOLossConfig(routing_replay=True))
    with pytest.raises(ValueError, match="--resume: loss.routing_replay is True but the run in .* used False"):
        check_run_dir(run_dir, True, changed, FIXED_ON_RESUME)


def test_a_changed_training_key_is_refused_and_a_resumable_one_is_not(tmp_path):
    cfg = GRPOConfig(train=GRPOTrainConfig(steps=4))
    run_dir = _saved_run(tmp_path, cfg)
    check_run_dir(run_dir, True, GRPOConfig(train=GRPOTrainConfig(steps=8)), FIXED_ON_RESUME)
    with pytest.raises(ValueError, match="--resume: loss.tis_cap is None but the run in .* used 2.0"):
        check_run_dir(
            run_dir,
            True,
            GRPOConfig(train=GRPOTrainConfig(steps=4), loss=GRPOLossConfig(tis_cap=None)),
            FIXED_ON_RESUME,
        )
    with pytest.raises(ValueError, match="already holds checkpoints; pass --resume"):
        check_run_dir(run_dir, False, cfg, FIXED_ON_RESUME)
