"""jaxspec.bench.spec_configs: the parsing of `jaxspec bench spec`'s options (the command itself runs in
tests/bench/test_spec.py, slow tier)."""

import argparse

import pytest

from jaxspec.bench.spec_configs import configurations, parse_args, slot_count, stage_tree, verify_token_cost


def test_verify_token_cost_option_takes_a_number_or_pairs():
    assert verify_token_cost("0.2") == 0.2
    assert verify_token_cost("1:0.01,64:0.1") == ((1, 0.01), (64, 0.1))
    with pytest.raises(argparse.ArgumentTypeError, match="rows:cost pairs"):
        verify_token_cost("64=0.1")


def test_slots_option_parses_as_jaxspec_generate_does():
    assert slot_count("16") == 16 and slot_count("auto") == "auto"
    for bad in ("0", "-2", "many"):
        with pytest.raises(
            argparse.ArgumentTypeError, match=rf"--slots must be a positive integer or 'auto', got '{bad}'"
        ):
            slot_count(bad)


def test_options_that_contradict_each_other_are_refused():
    base = ["--policy", "p", "--draft", "d"]
    assert parse_args([*base, "--coupled", "--slots", "4"], "").coupled
    with pytest.raises(ValueError, match="--coupled needs deterministic drafts"):
        parse_args([*base, "--coupled", "--stochastic"], "")
    with pytest.raises(ValueError, match="--staged-ar-only needs --slots"):
        parse_args([*base, "--staged-ar-only"], "")


def test_stage_trees_option_gives_a_tree_per_value_drafting_a_depth_per_stage():
    assert stage_tree("3,16:2,3,5") == (3, 16, (2, 3, 5))
    for bad in ("3:2,3", "3,16", "3,16:two"):
        with pytest.raises(argparse.ArgumentTypeError, match="width,budget:depth,depth"):
            stage_tree(bad)
    args = parse_args(["--policy", "p", "--draft", "d", "--k", "--trees", "--stage-trees", "3,16:2,3,5"], "")
    runs = dict(configurations(args))
    spec = runs["eagle3 tree w=3 n=16 d=2/3/5 by stage"]
    assert spec == {
        "method": "eagle3",
        "num_draft_tokens": 5,
        "stage_draft_tokens": (2, 3, 5),
        "tree_width": 3,
        "tree_budget": 16,
    }
