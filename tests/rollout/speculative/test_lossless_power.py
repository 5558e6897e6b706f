"""Speculative rollouts detect small biases: the power of the exact-distribution tests.

The 28 cases of `test_lossless.py` guard every method and tree shape end to end, but the tiny policy's flat
distributions and the weak drafts make small errors nearly invisible to them: at its NUM_SAMPLES their
chi-square test has 90% power against a temperature error of about 14% at T = 1 (`chi_square_power`
from the exact laws) and little against acceptance errors. Small biases are the job of the
strong-draft tests of this module: POWER_SAMPLES rollouts of a peaked policy with
strong draft chains detect a 2% acceptance bias (greedy and sampled drafts) and a 3% temperature
error with >= 90% power (noncentral chi-square from the exact laws of the biased samplers,
asserted by `test_power_of_the_strong_draft_test`), and noise reused across tree levels at
p < 1e-90 (5 seeds of each draft kind; chains at T = 1) and p < 1e-20 (3 seeds; trees at T = 0.7,
top_p = 0.9); each biased sampler is run and rejected, and the correct runs go through staged loops.

Rollouts verify over vocabulary tiles of RACE_TEST_TILE tokens, as in `test_lossless.py`
(its autouse `race_tiles`).
"""

import contextlib
import itertools

import jax
import numpy as np
import pytest

from jaxspec.rollout import Sampling, Spec, generate, stages
from tests.kernels.biased_verifier import accept_more, biased_noise, reuse_across_levels
from tests.kernels.trees import chi_square_power
from tests.rollout.conftest import random_params
from tests.rollout.reference import continuation_probs, full_forward, padded, reference_probs, speculative_chain_law
from tests.rollout.speculative.test_lossless import EOS, MAX_NEW, NUCLEUS, PROMPT, SHAPES, T1, race_tiles  # noqa: F401
from tests.rollout.test_distribution import chi_square_pvalue

pytestmark = pytest.mark.slow

# Power: rollouts of a peaked policy (the tiny policy's architecture, weights std 0.7: its
# next-token distributions are far from uniform, so acceptance and temperature errors move a lot
# of mass) with strong draft chains of 2: the policy itself drafting its argmax, or a sharpened
# copy of it (final norm x 2, so q ~ p^2 exceeds p on the likely tokens) sampling drafts.
POWER_SAMPLES = 32768
POWER_DRAFTS = ("greedy", "stochastic")
SAMPLERS = ("correct", "accept+2%", "temperature+3%", "noise-reused")
ALPHA = 1e-3


def peaked_teacher_forced(cfg, params):
    """(logits [36, len(PROMPT) + 2, V] over PROMPT + every 2-token extension, row of each pair)."""
    pairs = list(itertools.product(range(cfg.vocab_size), repeat=2))
    logits = np.asarray(full_forward(cfg, params, padded([PROMPT + pair for pair in pairs], len(PROMPT) + 2)))
    return logits, {pair: i for i, pair in enumerate(pairs)}


@pytest.fixture(scope="module")
def peaked(tiny_vocab_policy):
    """(cfg, policy params, sharpened draft params, the exact continuation law (the policy's, by
    `continuation_probs`), policy(t) / draft(t): prefix of up to 2 new tokens -> processed
    distribution [V] at temperature t)."""
    cfg, _ = tiny_vocab_policy
    params = random_params(cfg, seed=1, std=0.7)
    sharp = dict(params, final_norm=params["final_norm"] * 2.0)
    (policy_logits, row), (draft_logits, _) = (peaked_teacher_forced(cfg, p) for p in (params, sharp))

    def at(logits, temperature):
        def probs(prefix):
            r = row[prefix + (0,) * (2 - len(prefix))]
            return reference_probs(logits[r, len(PROMPT) - 1 + len(prefix)], temperature, 0, 1.0)

        return probs

    exact = continuation_probs(policy_logits, row, len(PROMPT), EOS, T1)
    return cfg, params, sharp, exact, lambda t: at(policy_logits, t), lambda t: at(draft_logits, t)


def sampler_laws(peaked, drafts: str):
    """(the exact continuation law, the laws under a 2% acceptance bias and under T = 1.03)."""
    _, _, _, exact, policy, draft = peaked
    q = (lambda prefix: None) if drafts == "greedy" else draft(1.0)
    correct = speculative_chain_law(policy(1.0), q, MAX_NEW, EOS)  # lossless: the policy's own law
    assert max(abs(correct[seq] - p) for seq, p in exact.items()) < 1e-12
    return (
        exact,
        speculative_chain_law(policy(1.0), q, MAX_NEW, EOS, accept_scale=1.02),
        speculative_chain_law(policy(1.03), q, MAX_NEW, EOS),
    )


@pytest.mark.parametrize("drafts", POWER_DRAFTS)
def test_power_of_the_strong_draft_test(peaked, drafts):
    """The chi-square test of POWER_SAMPLES rollouts detects a 2% acceptance bias and a 3%
    temperature error with >= 90% power (noncentral chi-square from the exact laws of the biased
    samplers, `speculative_chain_law`). Noise reused across levels is far easier: at 5 seeds the
    p-values were below 1e-300 (greedy drafts) and 1e-90 (sampled drafts)."""
    exact, accept_biased, hot = sampler_laws(peaked, drafts)
    assert chi_square_power(exact, accept_biased, POWER_SAMPLES, ALPHA) >= 0.9
    assert chi_square_power(exact, hot, POWER_SAMPLES, ALPHA) >= 0.9


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("drafts", POWER_DRAFTS)
def test_strong_draft_rollouts_detect_small_biases(peaked, drafts, sampler):
    """The correct sampler passes, through staged loops at T = 1 (most rows finish after one step,
    so the loop moves into its halved batches); each biased sampler (`tests.kernels.biased_verifier`,
    or the temperature) is rejected at p < ALPHA. Biased runs skip staging (one compiled loop)."""
    cfg, params, sharp, exact, _, _ = peaked
    spec = Spec(
        "draft_model", (cfg, params if drafts == "greedy" else sharp), draft_sampling=drafts, num_draft_tokens=2
    )
    temperature = 1.03 if sampler == "temperature+3%" else 1.0
    noise = {"accept+2%": accept_more(0.02), "noise-reused": reuse_across_levels}.get(sampler)
    with pytest.MonkeyPatch.context() as patch, biased_noise(noise) if noise else contextlib.nullcontext():
        if sampler != "correct":
            patch.setattr(stages, "MIN_STAGE_ROWS", POWER_SAMPLES)
        out = generate(
            cfg,
            params,
            [list(PROMPT)] * POWER_SAMPLES,
            jax.random.key(3),
            Sampling(max_new_tokens=MAX_NEW, temperature=temperature),
            spec=spec,
        )
    tokens, lengths = np.asarray(out.tokens).tolist(), np.asarray(out.lengths).tolist()
    pvalue = chi_square_pvalue([tuple(r[:n]) for r, n in zip(tokens, lengths)], exact)
    if sampler == "correct":
        assert pvalue > ALPHA
        assert len(out.stats["stage_steps"]) == 3 and sum(out.stats["stage_steps"][1:]) > 0, out.stats
    else:
        assert pvalue < ALPHA


@pytest.mark.parametrize("sampler", ["correct", "noise-reused"])
@pytest.mark.parametrize("drafts", POWER_DRAFTS)
def test_strong_draft_trees_under_nucleus_sampling(peaked, drafts, sampler):
    """Trees (2 wide, 2 deep, 3 nodes) of the strong drafts at T = 0.7, top_p = 0.9: the correct
    sampler passes through staged loops, noise reused across levels is rejected (p-values below
    1e-110 for greedy and 1e-20 for sampled drafts at each of 3 seeds)."""
    cfg, params, sharp, _, _, _ = peaked
    probs = continuation_probs(*peaked_teacher_forced(cfg, params), len(PROMPT), EOS, NUCLEUS)
    spec = Spec("draft_model", (cfg, params if drafts == "greedy" else sharp), draft_sampling=drafts, **SHAPES["tree"])
    with (
        pytest.MonkeyPatch.context() as patch,
        biased_noise(reuse_across_levels) if sampler != "correct" else contextlib.nullcontext(),
    ):
        if sampler != "correct":
            patch.setattr(stages, "MIN_STAGE_ROWS", POWER_SAMPLES)
        out = generate(
            cfg,
            params,
            [list(PROMPT)] * POWER_SAMPLES,
            jax.random.key(4),
            Sampling(max_new_tokens=MAX_NEW, **NUCLEUS),
            spec=spec,
        )
    tokens, lengths = np.asarray(out.tokens).tolist(), np.asarray(out.lengths).tolist()
    pvalue = chi_square_pvalue([tuple(r[:n]) for r, n in zip(tokens, lengths)], probs)
    if sampler == "correct":
        assert pvalue > ALPHA
        assert sum(out.stats["stage_steps"][1:]) > 0, out.stats
    else:
        assert pvalue < ALPHA
