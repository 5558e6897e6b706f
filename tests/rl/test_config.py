import dataclasses

import pytest

from jaxspec.rl.config import GRPOConfig, GRPOLossConfig, GRPOTrainConfig
from jaxspec.rl.validation import validate


@pytest.mark.parametrize(
    "loss, message",
    [
        (dict(tis_cap=0.5), "loss.tis_cap: the behaviour weight's cap must be >= 1"),
        (dict(filter_groups_max_rounds=3), "loss.filter_groups_max_rounds: over-sampling refills groups"),
        (dict(filter_groups=True, filter_groups_max_rounds=0), "loss.filter_groups_max_rounds: must be > 0"),
        (dict(clip_ratio_c=0.5), "loss.clip_ratio_c: must be > 1 or null, got 0.5"),
        (dict(overlong_buffer=-1), "loss.overlong_buffer: must be >= 0"),
        (dict(overlong_penalty=-1.0), "loss.overlong_penalty: must be >= 0"),
    ],
)
def test_algorithm_options_are_checked(loss, message):
    cfg = GRPOConfig(train=GRPOTrainConfig(steps=1), loss=GRPOLossConfig(**loss))
    with pytest.raises(ValueError, match=message):
        validate(cfg, "run.yaml")


def test_algorithm_options_accepted():
    loss = GRPOLossConfig(
        tis_cap=2.0,
        recompute_logprobs=True,
        filter_groups=True,
        filter_groups_max_rounds=3,
        clip_ratio_c=None,
        overlong_buffer=16,
        aggregation="seq-mean-token-sum-norm",
    )
    validate(dataclasses.replace(GRPOConfig(train=GRPOTrainConfig(steps=1)), loss=loss), "run.yaml")
