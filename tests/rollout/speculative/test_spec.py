"""`Spec` is its settings (`SpecConfig`, plain hashable values) beside the draft's weights."""

import copy
import dataclasses

import numpy as np
import pytest

from jaxspec.rollout import Spec, SpecConfig


def test_settings_are_plain_hashable_values():
    spec = Spec("ngram", num_draft_tokens=np.int64(4), ngram_sizes=[2, 1], stage_draft_tokens=[np.int32(2), 4])
    want = SpecConfig(method="ngram", num_draft_tokens=4, ngram_sizes=(2, 1), stage_draft_tokens=(2, 4))
    assert spec.config == want and hash(spec.config) == hash(want)
    assert type(spec.config.num_draft_tokens) is int and type(spec.config.stage_draft_tokens[0]) is int
    assert spec.draft is None


def test_a_spec_from_a_config_keeps_every_setting():
    cfg = SpecConfig(
        method="eagle3",
        draft="random",
        num_draft_tokens=5,
        tree_width=2,
        tree_budget=6,
        draft_sampling="stochastic",
        ngram_sizes=(4,),
        stage_draft_tokens=(3, 5),
    )
    weights = ("dcfg", {"lm_head": np.zeros((2, 3))})
    spec = Spec.from_config(cfg, weights)
    assert spec.config == dataclasses.replace(cfg, draft=None) and spec.draft is weights


def test_method_none_is_no_spec():
    with pytest.raises(ValueError, match="Spec.method must be one of .*spec=None samples autoregressively"):
        Spec("none")


def test_a_spec_reads_as_its_settings():
    spec = Spec("ngram", num_draft_tokens=4, tree_width=2, tree_budget=5, stage_draft_tokens=(2, 4))
    assert (spec.method, spec.num_draft_tokens, spec.tree_budget, spec.num_tree_nodes) == ("ngram", 4, 5, 5)
    assert spec.stage_depths(3) == (2, 4, 4) and spec.draft is None
    assert not hasattr(spec, "width")  # what is no setting stays missing
    copy.deepcopy(spec)  # copies build the object before its fields
