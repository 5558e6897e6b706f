"""Coupled draws (`Sampling.coupled`) with every deterministic drafter, and their law.

On the embedded tiny policy in float32 with its trained EAGLE-3 head, sampled at T = 1: EAGLE-3
trees, a draft model (the policy with perturbed weights), n-gram and suffix trees, hybrid trees,
adaptive depth, depth by occupancy and preemptions of a pool too small for all rows give the
coupled autoregressive rollout's tokens and log-probs, in the staged loop and on slots. On the
6-token policy with a weak random head: coupled chains, trees and hybrid trees on slots (T = 1 and
nucleus) and chains in the staged loop follow the exact law (the chi-square test of
tests/rollout/test_distribution.py, whose power is stated there), and a wrong temperature is
rejected.
"""

import dataclasses

import jax
import pytest

from jaxspec.draft import init_eagle3
from jaxspec.rollout import Spec, generate
from tests.rollout.conftest import assert_same_rollout
from tests.rollout.test_distribution import (
    NUCLEUS,
    T1,
    assert_exact_law,
    chi_square_pvalue,
    exact_continuations,
    slot_continuations,
    staged_continuations,
)

pytestmark = pytest.mark.slow

TREE = dict(num_draft_tokens=3, tree_width=2, tree_budget=4)


@pytest.fixture(scope="module")
def coupled(tiny):
    """(cfg, params, head, rows, coupled T = 1 Sampling, its staged autoregressive rollout)."""
    cfg, params, head, rows, _, sampled = tiny
    sampling = dataclasses.replace(sampled, coupled=True)
    return cfg, params, head, rows, sampling, generate(cfg, params, rows, jax.random.key(5), sampling)


def spec_of(tiny, name: str) -> Spec:
    cfg, params, head, *_ = tiny
    if name == "draft_model":
        noise = iter(jax.random.split(jax.random.key(9), len(jax.tree.leaves(params))))
        perturbed = jax.tree.map(lambda w: w + 0.02 * jax.random.normal(next(noise), w.shape, w.dtype), params)
        return Spec("draft_model", (cfg, perturbed), num_draft_tokens=3)
    return {
        "eagle3-tree": Spec("eagle3", head, **TREE),
        "ngram-tree": Spec("ngram", num_draft_tokens=3, tree_width=2),
        "suffix-tree": Spec("suffix", **TREE),
        "hybrid-tree": Spec("eagle3", head, suffix_branches=True, **TREE),
        "eagle3-adaptive": Spec("eagle3", head, num_draft_tokens=3, adaptive=True),
        "eagle3-by-occupancy": Spec("eagle3", head, num_draft_tokens=3, stage_draft_tokens=[1, 3]),
    }[name]


DRAFTERS = ["eagle3-tree", "draft_model", "ngram-tree", "suffix-tree", "hybrid-tree", "eagle3-adaptive"]


@pytest.mark.parametrize("slots", [None, 3], ids=["staged", "3-slots"])
@pytest.mark.parametrize("name", DRAFTERS)
def test_every_drafter_emits_the_autoregressive_tokens(tiny, coupled, name, slots):
    cfg, params, _, rows, sampling, ar = coupled
    out = generate(cfg, params, rows, jax.random.key(5), sampling, spec=spec_of(tiny, name), slots=slots)
    assert out.stats["accepted_tokens"] > 0, out.stats
    assert_same_rollout(out, ar)


def test_depth_by_occupancy_and_preemptions_keep_the_autoregressive_tokens(tiny, coupled):
    cfg, params, head, rows, sampling, ar = coupled
    by_occupancy = generate(
        cfg, params, rows, jax.random.key(5), sampling, spec=spec_of(tiny, "eagle3-by-occupancy"), slots=8
    )
    assert by_occupancy.stats["stage_rows"] == [8, 4] and min(by_occupancy.stats["stage_steps"]) > 0
    assert_same_rollout(by_occupancy, ar)
    spec = Spec("eagle3", head, num_draft_tokens=3)
    pool = dict(slots=4, kv_pages=24, page_size=4, decode_steps=8)  # a pool that preempts at this reach
    preempted = generate(cfg, params, rows, jax.random.key(5), sampling, spec=spec, **pool)
    assert preempted.stats["preemptions"] > 0
    assert_same_rollout(preempted, ar)


LAW = {  # name: (Spec settings, Sampling settings, engine)
    "chain-T1-slots": (dict(num_draft_tokens=2), T1, slot_continuations),
    "tree-nucleus-slots": (dict(num_draft_tokens=2, tree_width=2, tree_budget=3), NUCLEUS, slot_continuations),
    "hybrid-T1-slots": (
        dict(num_draft_tokens=2, tree_width=2, tree_budget=3, suffix_branches=True, suffix_group_rows=8),
        T1,
        slot_continuations,
    ),
    "chain-T1-staged": (dict(num_draft_tokens=2), T1, staged_continuations),
}


@pytest.fixture(scope="module")
def coupled_draws(tiny_vocab_policy):
    cfg, params = tiny_vocab_policy
    head = init_eagle3(cfg, jax.random.key(11), std=0.3)
    return {
        name: engine(cfg, params, dict(setting, coupled=True), Spec("eagle3", head, **shape))
        for name, (shape, setting, engine) in LAW.items()
    }


@pytest.mark.parametrize("name", list(LAW))
def test_coupled_samples_follow_the_exact_distribution(tiny_vocab_policy, coupled_draws, name):
    cfg, params = tiny_vocab_policy
    seqs, run = coupled_draws[name]
    assert 1.0 < run.stats["acceptance_length"] < 2.5, run.stats  # drafts both accepted and rejected
    assert_exact_law(seqs, run.logprobs, exact_continuations(cfg, params, LAW[name][1]))


def test_coupled_chi_square_rejects_a_wrong_temperature(tiny_vocab_policy, coupled_draws):
    cfg, params = tiny_vocab_policy
    wrong = exact_continuations(cfg, params, dict(T1, temperature=0.7))
    assert chi_square_pvalue(coupled_draws["chain-T1-slots"][0], wrong) < 1e-6
