"""Earlier responses per prompt for the suffix drafter: the latest `size` of each prompt, in a
fixed shape; a GRPO run with spec.method suffix or spec.suffix_branches keeps them across steps."""

import numpy as np
import pytest

from jaxspec.config_io import load_config
from jaxspec.rl import driver
from jaxspec.rl.config import GRPOConfig
from jaxspec.rl.loop import rollout_source
from jaxspec.rl.response_history import ResponseHistory
from tests.rl.runs import LIGHT, read_metrics, write_config


def test_the_latest_responses_of_each_prompt_are_kept():
    history = ResponseHistory(size=2, max_new_tokens=4)
    empty = history.of([7, 3])
    assert empty.tokens.shape == (2, 2, 4) and not empty.lengths.any()
    # Groups of 2 rows for prompts 7 and 3, then one more group for prompt 7.
    history.add([7, 3], np.array([[1, 2, 0, 0], [3, 0, 0, 0], [4, 4, 4, 4], [5, 6, 0, 0]]), np.array([2, 1, 4, 2]))
    history.add([7], np.array([[8, 9, 9, 0], [2, 0, 0, 0]]), np.array([3, 1]))
    kept = history.of([3, 7, 5])
    assert kept.lengths.tolist() == [[4, 2], [3, 1], [0, 0]]
    assert kept.tokens[0].tolist() == [[4, 4, 4, 4], [5, 6, 0, 0]]
    assert kept.tokens[1].tolist() == [[8, 9, 9, 0], [2, 0, 0, 0]]
    none = ResponseHistory(size=0, max_new_tokens=4)
    none.add([1], np.ones((2, 4), np.int32), np.array([4, 4]))
    assert none.of([1]).tokens.shape == (1, 0, 4)


@pytest.mark.parametrize(
    "method",
    [
        ["spec.method=suffix", "spec.draft=null"],
        ["spec.method=eagle3", "spec.draft=random", "spec.suffix_branches=true"],  # hybrid trees
    ],
    ids=["suffix", "hybrid"],
)
def test_a_suffix_drafting_run_drafts_from_the_responses_of_earlier_steps(tiny_policy, tmp_path, method):
    """Two steps over 4 prompts (the second step meets them again): the run keeps each prompt's 2
    latest responses, drafts from its groups' rows and that history, and records the iterations
    per draft depth."""
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=2, eval_every=0, checkpoint_every=2)
    generators = []

    def source(setup):
        generators.append(setup.generator)
        return rollout_source(setup)

    options = [*LIGHT, "data.num_train=4", *method, "spec.suffix_history=2"]
    driver.train(load_config(GRPOConfig, config, options), tmp_path / "run", make_rollouts=source)
    history = generators[0].history
    kept = history.of(sorted(history._responses))
    assert kept.lengths.shape == (4, 2) and (kept.lengths > 0).all()
    records = read_metrics(tmp_path / "run")
    # (The tiny policy's responses are too varied for the drafts to be accepted; see the rollout
    # tests for what the history buys.)
    assert len(records) == 2 and all(r["drafted_tokens"] > 0 for r in records), records
    assert all(sum(r["decode_steps_per_depth"]) == r["decode_steps"] for r in records), records
