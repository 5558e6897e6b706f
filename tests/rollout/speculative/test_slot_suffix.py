"""Group-suffix drafts, hybrid trees and adaptive depth on the slot engine (`generate(..., slots=S)`).

On the embedded tiny policy (12 rows, 6 prompts twice each, one GRPO group per prompt): greedy
suffix, hybrid (EAGLE-3 + suffix) and adaptive rollouts give the staged engine's tokens for 1, 3
and 12 slots and through preemptions of a pool too small for all rows. A row's siblings may have
progressed further on slots than in the staged loop (a sibling that ran earlier through a slot
is read as far as it has come), so proposals may differ there; where a row drafts from itself and
its prompt's earlier answers alone (one row per group) the sources are the staged loop's, and the
drafts and acceptance are equal too. An adaptive loop whose drafts are never accepted falls back
to autoregressive steps as the staged loop does, step for step. On a 2-group mesh, greedy hybrid
trees at an adaptive depth give the staged tokens. On the 6-token policy: the
sampled continuations of suffix trees and hybrid trees through 256 slots (T = 1) follow the exact
distribution (the chi-square test of tests/rollout/test_distribution.py; its power is stated
there).
"""

import jax
import numpy as np
import pytest

from jaxspec.draft import init_eagle3
from jaxspec.models import Sharding, make_mesh, shard_params
from jaxspec.rollout import Sampling, Spec, generate
from jaxspec.rollout.speculative.suffix import SuffixHistory
from tests.rollout.conftest import assert_same_rollout
from tests.rollout.test_distribution import (
    T1,
    assert_exact_law,
    chi_square_pvalue,
    exact_continuations,
    slot_continuations,
)

pytestmark = pytest.mark.slow

TREE = dict(num_draft_tokens=3, tree_width=2)


def spec_of(tiny, name: str, **settings) -> Spec:
    head = tiny[2]
    if name == "suffix":
        return Spec("suffix", settings.pop("history", None), **TREE, **settings)
    if name == "hybrid":
        history = settings.pop("history", None)
        return Spec("eagle3", (*head, history), **TREE, suffix_branches=True, **settings)
    return Spec("suffix", num_draft_tokens=3, adaptive=True, **settings)  # "adaptive"


@pytest.mark.parametrize(
    "name, layout",
    [
        ("suffix", dict(slots=1)),
        ("suffix", dict(slots=3, page_size=8)),
        ("suffix", dict(slots=12)),
        ("suffix", dict(slots=4, kv_pages=24, page_size=4, decode_steps=8)),
        ("hybrid", dict(slots=3, page_size=8)),
        ("hybrid", dict(slots=4, kv_pages=24, page_size=4, decode_steps=4)),
        ("adaptive", dict(slots=3, page_size=8, decode_steps=4)),
        ("adaptive", dict(slots=4, kv_pages=24, page_size=4)),
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}{n}" for k, n in v.items()),
)
def test_greedy_suffix_hybrid_and_adaptive_slots_equal_the_staged_engine(tiny, staged, name, layout):
    cfg, params, _, rows, greedy, _ = tiny
    out = generate(cfg, params, rows, jax.random.key(0), greedy, spec=spec_of(tiny, name), **layout)
    assert_same_rollout(out, staged)
    if "kv_pages" in layout:
        assert out.stats["preemptions"] > 0 and out.stats["peak_kv_pages"] <= layout["kv_pages"]
    assert out.stats["accepted_tokens"] > 0, out.stats
    assert sum(out.stats["depth_steps"]) == out.stats["steps"], out.stats
    if name == "adaptive":
        assert out.stats["fallback_steps"] > 0, out.stats  # the suffix drafts do not always pay


@pytest.fixture(scope="module")
def other_answers(tiny, staged):
    """A history of 2 earlier answers per row, one row per group: the row's own greedy answer cut
    at 10 tokens and another prompt's answer (so drafts are both accepted and rejected)."""
    tokens, lengths = np.asarray(staged.tokens), np.asarray(staged.lengths)
    rows = tokens.shape[0]
    other = (np.arange(rows) + 2) % rows
    history = np.stack([tokens, tokens[other]], axis=1)
    return SuffixHistory(history, np.stack([np.minimum(lengths, 10), lengths[other]], axis=1))


@pytest.mark.parametrize("name", ["suffix", "hybrid"])
def test_slots_draft_what_the_staged_loop_drafts_from_the_same_sources(tiny, staged, other_answers, name):
    """One row per group (suffix_group_rows 1): a row drafts from its own tokens and its earlier
    answers alone, which are the staged loop's on 3 slots, so the drafts and the acceptance are
    equal, the running split of a hybrid row included."""
    cfg, params, _, rows, greedy, _ = tiny
    spec = spec_of(tiny, name, history=other_answers, suffix_group_rows=1)
    want = generate(cfg, params, rows, jax.random.key(0), greedy, spec=spec)
    got = generate(cfg, params, rows, jax.random.key(0), greedy, spec=spec, slots=3, page_size=8)
    assert_same_rollout(got, staged)
    assert got.stats["preemptions"] == 0
    assert 0 < want.stats["accepted_tokens"] < want.stats["drafted_tokens"], want.stats
    for count in ("accepted_tokens", "drafted_tokens", "verified_row_steps"):
        assert got.stats[count] == want.stats[count], (count, got.stats, want.stats)


def test_an_adaptive_slot_loop_whose_drafts_fail_falls_back_as_the_staged_loop_does(policy):
    """A draft model that drafts the policy's least likely token is never accepted: on 3 slots
    (every row admitted at once, as the staged batch) the loop chooses the staged loop's depth at
    every step from the same rates, so the depth counts and fallback steps are equal (those of
    tests/rollout/speculative/test_adaptive.py)."""
    cfg, params = policy
    prompts = [[5, 9, 11], [2, 40, 33, 17, 8, 60, 1], [3] * 5 + list(range(10, 25))]
    sampling = Sampling(temperature=0.0, max_new_tokens=40)
    contrary = dict(params, lm_head=-params["lm_head"])
    settings = dict(num_draft_tokens=3, adaptive=True, verify_token_cost=0.1, adaptive_decay=0.5, adaptive_probe=8)
    spec = Spec("draft_model", (cfg, contrary), **settings)
    ar = generate(cfg, params, prompts, jax.random.key(0), sampling)
    want = generate(cfg, params, prompts, jax.random.key(1), sampling, spec=spec)
    got = generate(cfg, params, prompts, jax.random.key(1), sampling, spec=spec, slots=3)
    assert_same_rollout(got, ar)
    # 1 step at depth 3, then probes after 7 and 15 autoregressive steps (the run doubles)
    assert got.stats["accepted_tokens"] == 0 and got.stats["depth_steps"] == [36, 2, 0, 1], got.stats
    for count in ("depth_steps", "fallback_steps", "steps", "drafted_tokens"):
        assert got.stats[count] == want.stats[count], (count, got.stats, want.stats)


def test_hybrid_adaptive_slots_on_a_mesh_equal_the_staged_engine(tiny, staged):
    """On a 2 x 2 (data x tensor) mesh the rows, slots and pages split into 2 groups; the suffix
    branches read the call-wide pool of both groups' rows and every group takes the depth chosen
    from the acceptance of all: greedy hybrid trees at an adaptive depth give the staged tokens."""
    cfg, params, _, rows, greedy, _ = tiny
    sharding = Sharding(make_mesh(data=2, fsdp=1, tensor=2, devices=jax.devices()[:4]))
    spec = spec_of(tiny, "hybrid", adaptive=True)
    out = generate(
        cfg, shard_params(sharding, params), rows, jax.random.key(0), greedy, spec=spec, slots=8, sharding=sharding
    )
    assert out.stats["groups"] == 2
    assert_same_rollout(out, staged)
    assert out.stats["accepted_tokens"] > 0 and sum(out.stats["depth_steps"]) == out.stats["steps"], out.stats


@pytest.fixture(scope="module")
def suffix_draws(tiny_vocab_policy):
    """{name: (continuations, RolloutOutput)} of NUM_SAMPLES copies of PROMPT through 256 slots at
    T = 1, drafted by suffix trees (groups of 8 rows) and hybrid trees (with a weak random head)."""
    cfg, params = tiny_vocab_policy
    head = init_eagle3(cfg, jax.random.key(11), std=0.3)
    shape = dict(num_draft_tokens=2, tree_width=2, tree_budget=3, suffix_group_rows=8)
    specs = {
        "suffix-tree": Spec("suffix", **shape),
        "hybrid-tree": Spec("eagle3", head, suffix_branches=True, **shape),
    }
    return {name: slot_continuations(cfg, params, T1, spec) for name, spec in specs.items()}


@pytest.mark.parametrize("name", ["suffix-tree", "hybrid-tree"])
def test_suffix_and_hybrid_slot_samples_follow_the_exact_distribution(tiny_vocab_policy, suffix_draws, name):
    cfg, params = tiny_vocab_policy
    seqs, run = suffix_draws[name]
    assert 1.0 < run.stats["acceptance_length"] < 2.5, run.stats  # drafts both accepted and rejected
    assert_exact_law(seqs, run.logprobs, exact_continuations(cfg, params, T1))


def test_suffix_slot_chi_square_rejects_a_wrong_temperature(tiny_vocab_policy, suffix_draws):
    cfg, params = tiny_vocab_policy
    wrong = exact_continuations(cfg, params, dict(T1, temperature=0.7))
    assert chi_square_pvalue(suffix_draws["hybrid-tree"][0], wrong) < 1e-6
