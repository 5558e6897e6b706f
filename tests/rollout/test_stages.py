"""Staged decode loops: as rows finish, the running rows move into smaller batches
(`jaxspec.rollout.stages`) and every row's output is unchanged, autoregressive and speculative."""

import jax
import numpy as np
import pytest

from jaxspec.draft import init_eagle3
from jaxspec.rollout import Sampling, Spec, generate, stages
from tests.rollout.reference import greedy_reference

pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 11], [2, 40, 33, 17, 8, 60, 1], [3] * 5 + list(range(10, 25))]
BATCH = [PROMPTS[i] for i in (0, 1, 2, 0, 1, 2, 0, 1)]
MAX_NEW = 24
PAD = 7  # the policy fixture's pad_token_id


def _first_new(tokens, start):
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.fixture(scope="module")
def reference_and_eos(policy):
    """Greedy continuations of every prompt and two eos ids that end prompts 0 and 1 at different
    steps while prompt 2 runs to MAX_NEW: 6 of the 8 rows finish early, at two different times."""
    cfg, params = policy
    reference = greedy_reference(cfg, params, PROMPTS, MAX_NEW)
    row0, row1, row2 = (reference[i][0] for i in range(3))
    eos_a = next(row0[i] for i in range(4, MAX_NEW) if row0[i] not in row0[:i] + row2)
    eos_b = next(row1[i] for i in range(8, MAX_NEW) if row1[i] not in row1[:i] + row2 + [eos_a])
    return reference, (eos_a, eos_b)


@pytest.fixture
def small_stages(monkeypatch):
    monkeypatch.setattr(stages, "MIN_STAGE_ROWS", 2)
    assert stages.batch_stages(len(BATCH)) == (8, 4, 2)


METHODS = [
    "ar",
    "eagle3-chain",
    "ngram-tree",
    "draft_model-chain",
    # a draft depth per stage: shallower and deeper than the first stage's
    "eagle3-chain-depth-per-stage",
    "ngram-tree-depth-per-stage",
    "draft_model-chain-depth-per-stage",
    # adaptive depth with a draft never accepted: runs of autoregressive iterations, ended by the stage
    "draft_model-chain-adaptive-fallback",
]


@pytest.mark.parametrize("method", METHODS)
def test_staged_greedy_rollouts_equal_the_reference(policy, reference_and_eos, small_stages, method):
    cfg, params = policy
    reference, eos = reference_and_eos
    head = init_eagle3(cfg, jax.random.key(5), std=0.3)
    spec = {
        "ar": None,
        "eagle3-chain": Spec("eagle3", head, num_draft_tokens=3),
        "ngram-tree": Spec("ngram", num_draft_tokens=3, tree_width=2),
        "draft_model-chain": Spec("draft_model", (cfg, params), num_draft_tokens=3),
        "eagle3-chain-depth-per-stage": Spec("eagle3", head, num_draft_tokens=4, stage_draft_tokens=(2, 4, 1)),
        "ngram-tree-depth-per-stage": Spec("ngram", num_draft_tokens=3, tree_width=2, stage_draft_tokens=(1, 3)),
        "draft_model-chain-depth-per-stage": Spec(
            "draft_model", (cfg, params), num_draft_tokens=5, stage_draft_tokens=(5, 2)
        ),
        # The policy with its logits negated drafts its least likely token: never accepted at T = 0.
        "draft_model-chain-adaptive-fallback": Spec(
            "draft_model", (cfg, dict(params, lm_head=-params["lm_head"])), num_draft_tokens=3, adaptive=True
        ),
    }[method]
    out = generate(
        cfg, params, BATCH, jax.random.key(0), Sampling(temperature=0.0, max_new_tokens=MAX_NEW, eos_id=eos), spec=spec
    )
    tokens, lengths, logprobs = map(np.asarray, (out.tokens, out.lengths, out.logprobs))
    for r, prompt in enumerate(BATCH):
        full, full_lp = reference[PROMPTS.index(prompt)]
        stop = next((k + 1 for k, t in enumerate(full) if t in eos), MAX_NEW)
        assert lengths[r] == stop, (r, lengths)
        assert tokens[r, :stop].tolist() == full[:stop]
        assert np.all(tokens[r, stop:] == PAD) and np.all(logprobs[r, stop:] == 0)
        np.testing.assert_allclose(logprobs[r, :stop], full_lp[:stop], rtol=1e-5, atol=1e-5)
    finish = sorted(set(lengths.tolist()))
    assert (lengths < MAX_NEW).sum() == 6 and len(finish) == 3, "both stage changes are exercised"
    assert out.stats["generated_tokens"] == lengths.sum()
    assert out.stats["stage_rows"] == [8, 4, 2]
    assert sum(out.stats["stage_steps"]) == out.stats["steps"]
    if spec is not None:
        depths = spec.stage_depths(3)
        assert out.stats["acceptance_rate_per_position"].shape == (max(depths),)
        # A draft identical to the policy accepts every draft: each stage's steps emit its depth + 1.
        if method.startswith("draft_model") and not method.endswith("fallback"):
            assert out.stats["acceptance_length"] > min(depths) + 0.5
    if spec is None or method.endswith("fallback"):  # one token per iteration; iterations counted across stages
        assert out.stats["steps"] == MAX_NEW - 1
        # 8 rows until the second group finishes (2 left), then straight past the 4-row stage
        last_early = int(lengths[lengths < MAX_NEW].max())
        assert out.stats["stage_steps"] == [last_early - 1, 0, MAX_NEW - last_early]


def test_stages_halve_down_to_the_floor():
    assert stages.batch_stages(256) == (256, 128, 64)
    assert stages.batch_stages(64) == (64, 32)
    assert stages.batch_stages(48) == (48,)
    assert stages.batch_stages(100, min_rows=10) == (100, 50, 25)
    assert stages.batch_stages(96, min_rows=4) == (96, 48, 24)
