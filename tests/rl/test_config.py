import dataclasses

import pytest

from jaxspec.rl.config import GRPOConfig, GRPOLossConfig, GRPOTrainConfig
from jaxspec.rl.validation import validate
from jaxspec.rollout import Spec, SpecConfig


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


@pytest.mark.parametrize(
    "settings, key",
    [
        (dict(draft_sampling="stochastic"), "draft_sampling"),
        (dict(num_draft_tokens=0), "num_draft_tokens"),
        (dict(tree_width=0), "tree_width"),
        (dict(tree_width=3, tree_budget=2), "tree_budget"),
        (dict(ngram_sizes=(2, 0)), "ngram_sizes"),
        (dict(num_draft_tokens=3, stage_draft_tokens=(3, 4)), "stage_draft_tokens"),
        (dict(stage_draft_tokens=()), "stage_draft_tokens"),
        (dict(method="suffix", draft_sampling="stochastic"), "draft_sampling"),
        (dict(method="suffix", suffix_max_match=0), "suffix_max_match"),
        (dict(method="suffix", suffix_candidates=0), "suffix_candidates"),
        (dict(method="suffix", suffix_group_rows=0), "suffix_group_rows"),
        (dict(method="suffix", suffix_history=-1), "suffix_history"),
        (dict(suffix_branches=True), "suffix_branches"),
        (dict(method="eagle3", suffix_branches="yes"), "suffix_branches"),
        (dict(method="eagle3", suffix_branches=True, draft_sampling="stochastic"), "draft_sampling"),
        (dict(adaptive="yes"), "adaptive"),
        (dict(verify_token_cost=-0.1), "verify_token_cost"),
        (dict(verify_token_cost=((64, 0.1), (1, 0.01))), "verify_token_cost"),  # rows not ascending
        (dict(verify_token_cost=((0, 0.1),)), "verify_token_cost"),
        (dict(verify_token_cost=((1, -0.1),)), "verify_token_cost"),
        (dict(verify_token_cost=()), "verify_token_cost"),
        (dict(draft_token_cost="cheap"), "draft_token_cost"),
        (dict(adaptive_decay=1.0), "adaptive_decay"),
        (dict(adaptive_probe=0), "adaptive_probe"),
        (dict(adaptive_probe=8, adaptive_probe_max=4), "adaptive_probe_max"),
    ],
)
def test_a_config_file_and_a_spec_refuse_the_same_settings(settings, key):
    """One check: speculation settings that `jaxspec train` refuses before any compute are those a
    `jaxspec.rollout.Spec` refuses, naming the same key (ngram with stochastic drafts included)."""
    settings = {"method": "ngram", **settings}
    cfg = GRPOConfig(train=GRPOTrainConfig(steps=1), spec=SpecConfig(**settings))
    with pytest.raises(ValueError, match=rf"^run\.yaml: spec\.{key}: "):
        validate(cfg, "run.yaml")
    with pytest.raises(ValueError, match=rf"^Spec\.{key} "):
        Spec(**settings)


def test_verify_token_cost_pairs_load_from_a_config_file():
    """spec.verify_token_cost as [rows, cost] pairs (YAML lists) loads as a tuple of pairs, passes
    validation and makes a Spec whose adaptive cost model reads them."""
    from jaxspec.config_io import from_dict
    from jaxspec.rollout.speculative.adaptive import cost_points

    data = {
        "train": {"steps": 1},
        "spec": {"method": "ngram", "adaptive": True, "verify_token_cost": [[1, 0], [64, 0.5]]},
    }
    cfg = from_dict(GRPOConfig, data, "run.yaml")
    assert cfg.spec.verify_token_cost == ((1, 0.0), (64, 0.5))
    validate(cfg, "run.yaml")
    spec = Spec.from_config(cfg.spec)
    assert cost_points(spec.verify_token_cost) == ((1, 0.0), (64, 0.5))
    assert cost_points(0.25) == ((1, 0.25),)
