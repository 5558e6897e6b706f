"""Speculative rollouts on the slot engine (`generate(..., spec=Spec("eagle3", ...), slots=S)`).

On the embedded tiny policy and its trained EAGLE-3 head (acceptance well above 1, so accepted
runs, eos inside runs and truncation all occur): greedy autoregressive and greedy EAGLE-3 chains
give the staged engine's tokens for 1, 3 and 8 slots and through preemptions of a pool too small
for all rows; every drafter (EAGLE-3 chains and trees, a draft model, n-gram trees) drafts and
accepts on 3 slots exactly what it does in the staged loop; the draft depth follows the
occupancy (stage_draft_tokens); sampled EAGLE-3 rows are the same for any slot count. On the
6-token policy with a weak random head (rejections, residual samples and bonus tokens): the
sampled continuations of chains (T = 1; T = 0.7 with top_p 0.9), trees (T = 1) and trees of
stochastic drafts (T = 0.7 with top_p 0.9) follow the exact distribution (the chi-square test of
tests/rollout/test_distribution.py; its power is stated there), and a wrong temperature is
rejected.
"""

import jax
import numpy as np
import pytest

from jaxspec.draft import init_eagle3
from jaxspec.rollout import Spec, generate
from tests.rollout.conftest import TINY_MAX_NEW, assert_same_rollout
from tests.rollout.test_distribution import (
    NUCLEUS,
    T1,
    assert_exact_law,
    chi_square_pvalue,
    exact_continuations,
    slot_continuations,
)

pytestmark = pytest.mark.slow

CHAIN = dict(num_draft_tokens=3)
TREE = dict(num_draft_tokens=3, tree_width=2, tree_budget=4)


@pytest.mark.parametrize("count", [1, 3, 8])
def test_greedy_autoregressive_slots_equal_the_staged_engine(tiny, staged, count):
    cfg, params, _, rows, greedy, _ = tiny
    assert len(set(np.asarray(staged.lengths).tolist())) > 2 and int(staged.lengths.min()) < TINY_MAX_NEW  # eos rows
    assert_same_rollout(generate(cfg, params, rows, jax.random.key(0), greedy, slots=count), staged)


@pytest.mark.parametrize("count", [1, 8])
def test_greedy_eagle3_slots_equal_the_staged_engine(tiny, staged, count):
    cfg, params, head, rows, greedy, _ = tiny
    out = generate(cfg, params, rows, jax.random.key(0), greedy, spec=Spec("eagle3", head, **CHAIN), slots=count)
    assert_same_rollout(out, staged)
    assert out.stats["acceptance_length"] > 2.0, out.stats  # the head's drafts are accepted


def specs(tiny) -> dict:
    """Greedy-drafting specs of every drafter: the trained head (chains, trees), the policy with
    its weights perturbed as a draft model (often but not always agreeing), n-gram trees."""
    cfg, params, head, *_ = tiny
    noise = iter(jax.random.split(jax.random.key(9), len(jax.tree.leaves(params))))
    perturbed = jax.tree.map(lambda w: w + 0.02 * jax.random.normal(next(noise), w.shape, w.dtype), params)
    return {
        "eagle3-chain": Spec("eagle3", head, **CHAIN),
        "eagle3-tree": Spec("eagle3", head, **TREE),
        "draft_model-chain": Spec("draft_model", (cfg, perturbed), **CHAIN),
        "ngram-tree": Spec("ngram", num_draft_tokens=3, tree_width=2),
    }


@pytest.mark.parametrize("name", ["eagle3-chain", "eagle3-tree", "draft_model-chain", "ngram-tree"])
def test_slots_draft_exactly_what_the_staged_loop_drafts(tiny, staged, name):
    """Greedy drafts depend only on a row's own history, so 3 slots (no preemption) draft and
    accept exactly the tokens the staged loop does: the drafter's state per slot (prefilled in
    the prefill lanes, started with the row's context, prefix pages shared) is the staged one's.
    The tokens are the autoregressive ones."""
    cfg, params, _, rows, greedy, _ = tiny
    spec = specs(tiny)[name]
    want = generate(cfg, params, rows, jax.random.key(0), greedy, spec=spec)
    got = generate(cfg, params, rows, jax.random.key(0), greedy, spec=spec, slots=3, page_size=8)
    assert_same_rollout(got, staged)
    assert got.stats["prefix_pages_shared"] > 0 and got.stats["preemptions"] == 0
    assert 0 < want.stats["accepted_tokens"] < want.stats["drafted_tokens"], want.stats
    for count in ("accepted_tokens", "drafted_tokens", "verified_row_steps"):
        assert got.stats[count] == want.stats[count], (count, got.stats, want.stats)


def test_greedy_eagle3_through_preemptions_equals_the_staged_engine(tiny, staged):
    cfg, params, head, rows, greedy, _ = tiny
    out = generate(
        cfg,
        params,
        rows,
        jax.random.key(0),
        greedy,
        spec=Spec("eagle3", head, **CHAIN),
        slots=4,
        kv_pages=24,
        page_size=4,
        decode_steps=8,  # the pool preempts at this reach (each iteration's pages are taken at its start)
    )
    assert out.stats["preemptions"] > 0 and out.stats["peak_kv_pages"] <= 24
    assert_same_rollout(out, staged)


def test_draft_depth_follows_occupancy(tiny, staged):
    """stage_draft_tokens [1, 3] on 8 slots: depth 1 while more than 4 slots decode, then 3; both
    run, and the tokens are the autoregressive ones."""
    cfg, params, head, rows, greedy, _ = tiny
    spec = Spec("eagle3", head, num_draft_tokens=3, stage_draft_tokens=[1, 3])
    out = generate(cfg, params, rows, jax.random.key(0), greedy, spec=spec, slots=8)
    assert_same_rollout(out, staged)
    assert out.stats["stage_rows"] == [8, 4] and min(out.stats["stage_steps"]) > 0, out.stats
    assert out.stats["acceptance_rate_per_position"].shape == (3,)


def test_sampled_eagle3_rows_do_not_depend_on_the_slot_count(tiny):
    cfg, params, head, rows, _, sampled = tiny
    spec = Spec("eagle3", head, **CHAIN)
    one, four = (generate(cfg, params, rows, jax.random.key(4), sampled, spec=spec, slots=n) for n in (1, 4))
    assert one.stats["acceptance_length"] > 1.5
    np.testing.assert_array_equal(four.tokens, one.tokens)
    np.testing.assert_allclose(four.logprobs, one.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [CHAIN, dict(TREE, draft_sampling="stochastic")], ids=["chain", "stochastic-tree"])
def test_sampled_eagle3_slots_run_the_verification_kernels(tiny, shape, monkeypatch):
    """The slot engine verifies every slot in one call of the Triton kernels with one key per row
    (jax-triton's kernels cannot be vmapped): in Triton's interpreter the sampled rollout equals the
    jnp reference's from the same key."""
    pytest.importorskip("triton")
    pytest.importorskip("torch")
    cfg, params, head, rows, _, sampled = tiny
    spec = Spec("eagle3", head, **shape)
    results = {}
    for impl in ("reference", "triton-interpret"):
        monkeypatch.setenv("JAXSPEC_TREE_VERIFY_IMPL", impl)
        jax.clear_caches()  # the rollout's programs read the variable when traced
        results[impl] = generate(cfg, params, rows[:6], jax.random.key(3), sampled, spec=spec, slots=4)
    jax.clear_caches()  # later tests trace their rollouts afresh, with the variable unset
    assert results["reference"].stats["acceptance_length"] > 1.5
    assert_same_rollout(results["triton-interpret"], results["reference"])


DRAWS = {  # name: (Spec settings, Sampling settings)
    "chain-T1": (dict(num_draft_tokens=2), T1),
    "chain-nucleus": (dict(num_draft_tokens=2), NUCLEUS),
    "tree-T1": (dict(num_draft_tokens=2, tree_width=2, tree_budget=3), T1),
    "stochastic-tree-nucleus": (
        dict(num_draft_tokens=2, tree_width=2, tree_budget=3, draft_sampling="stochastic"),
        NUCLEUS,
    ),
}


@pytest.fixture(scope="module")
def slot_draws(tiny_vocab_policy):
    """{name: (continuations, RolloutOutput)} of NUM_SAMPLES copies of PROMPT through 256 slots for
    every entry of DRAWS, drafted by a weak random EAGLE-3 head."""
    cfg, params = tiny_vocab_policy
    head = init_eagle3(cfg, jax.random.key(11), std=0.3)
    return {
        name: slot_continuations(cfg, params, setting, Spec("eagle3", head, **shape))
        for name, (shape, setting) in DRAWS.items()
    }


@pytest.mark.parametrize("name", list(DRAWS))
def test_eagle3_slot_samples_follow_the_exact_distribution(tiny_vocab_policy, slot_draws, name):
    cfg, params = tiny_vocab_policy
    probs = exact_continuations(cfg, params, DRAWS[name][1])
    seqs, run = slot_draws[name]
    assert 1.0 < run.stats["acceptance_length"] < 2.5, run.stats  # drafts both accepted and rejected
    assert_exact_law(seqs, run.logprobs, probs)


def test_eagle3_slot_chi_square_rejects_a_wrong_temperature(tiny_vocab_policy, slot_draws):
    cfg, params = tiny_vocab_policy
    wrong = exact_continuations(cfg, params, dict(T1, temperature=0.7))
    assert chi_square_pvalue(slot_draws["chain-T1"][0], wrong) < 1e-6
