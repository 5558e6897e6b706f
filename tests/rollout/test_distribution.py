"""The rollout samples exactly the processed policy distribution: exact enumeration + chi-square.

Power: with the tiny policy's flat distributions, NUM_SAMPLES rollouts detect a temperature error
of about 14% at T = 1 with 90% power (`chi_square_power` from the exact laws). A 3% error is the
job of `test_a_3_percent_temperature_error_is_detected`: POWER_SAMPLES rollouts of a peaked
policy (weights std 0.7) from POWER_PROMPT, with >= 90% power by the same computation (asserted),
through a staged loop, the correct sampler passing and the 3% hotter one rejected.
"""

import itertools

import jax
import numpy as np
import pytest
from scipy import stats

from jaxspec.rollout import Sampling, generate
from jaxspec.rollout import stages as rollout_stages
from tests.kernels.trees import chi_square_power
from tests.rollout.conftest import random_params
from tests.rollout.reference import continuation_probs, full_forward, padded

PROMPT = (1, 2, 3)
MAX_NEW = 3
# One batch: fewer than half the rows end within 3 tokens, so a staged loop would never leave its
# first stage; staging is off rather than compiling loops that do not run (tests/rollout/test_stages.py;
# at T = 1: test_a_3_percent_temperature_error_is_detected).
NUM_SAMPLES = 8192
EOS = 5

T1 = dict(temperature=1.0, top_k=0, top_p=1.0)
NUCLEUS = dict(temperature=0.7, top_k=0, top_p=0.9)
TOP_K = dict(temperature=1.3, top_k=3, top_p=1.0)


def exact_continuations(cfg, params, setting, prompt=PROMPT) -> dict[tuple[int, ...], float]:
    """Probability of every continuation of `prompt` (up to MAX_NEW tokens, ending at the first eos).

    Conditionals come from teacher-forced full forwards over every 2-token extension and the numpy
    processed distribution.
    """
    vocab, p = cfg.vocab_size, len(prompt)
    pairs = list(itertools.product(range(vocab), repeat=2))
    logits = np.asarray(full_forward(cfg, params, padded([prompt + pair for pair in pairs], p + 2)))
    row = {pair: i for i, pair in enumerate(pairs)}
    return continuation_probs(logits, row, p, EOS, setting)


@pytest.fixture(scope="module")
def draw(tiny_vocab_policy):
    """draw(setting) -> (continuations, tokens, lengths, logprobs) of one generate call over
    NUM_SAMPLES copies of PROMPT; cached per setting."""
    cfg, params = tiny_vocab_policy
    cache = {}

    def draw(setting):
        key = tuple(sorted(setting.items()))
        if key not in cache:
            seqs, out = staged_continuations(cfg, params, setting)
            cache[key] = (seqs, *map(np.asarray, (out.tokens, out.lengths, out.logprobs)))
        return cache[key]

    return draw


def chi_square_pvalue(seqs, probs) -> float:
    """Goodness of fit of the sampled continuations; bins with expected count < 5 are pooled."""
    support = sorted(s for s, q in probs.items() if q > 0)
    expected = np.array([probs[s] for s in support])
    expected = expected / expected.sum() * len(seqs)
    counts = {}
    for s in seqs:
        counts[s] = counts.get(s, 0) + 1
    observed = np.array([counts.get(s, 0) for s in support], np.float64)
    small = expected < 5
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return stats.chisquare(observed, expected).pvalue


def assert_exact_law(seqs, logprobs, probs) -> None:
    """Sampled continuations `seqs` follow `probs` (`exact_continuations`): each has positive
    probability, the chi-square test accepts them (p > 1e-3), and each row's log-probs float32
    [R, N] sum to its continuation's exact log-probability."""
    assert all(probs[s] > 0 for s in seqs), "sampled a continuation the processed distribution excludes"
    assert chi_square_pvalue(seqs, probs) > 1e-3
    total = np.array([np.log(probs[s]) for s in seqs])
    np.testing.assert_allclose(np.asarray(logprobs).sum(axis=1), total, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("setting", [T1, NUCLEUS, TOP_K], ids=["T1", "T0.7-top_p0.9", "T1.3-top_k3"])
def test_samples_follow_exact_distribution(tiny_vocab_policy, draw, setting):
    cfg, params = tiny_vocab_policy
    probs = exact_continuations(cfg, params, setting)
    seqs, tokens, lengths, logprobs = draw(setting)
    if setting is not T1:
        assert any(q == 0 for q in probs.values()), "filtering should exclude some continuations"
    assert sum(len(s) < MAX_NEW for s in seqs) > 100, "eos-terminated continuations should be exercised"
    assert_exact_law(seqs, logprobs, probs)
    # Log-probs and tokens are 0 and pad past each row's length.
    past = np.arange(MAX_NEW)[None, :] >= lengths[:, None]
    assert np.all(logprobs[past] == 0) and np.all(tokens[past] == 0)


def test_chi_square_rejects_wrong_temperature(tiny_vocab_policy, draw):
    cfg, params = tiny_vocab_policy
    seqs = draw(T1)[0]
    wrong = exact_continuations(cfg, params, dict(temperature=0.7, top_k=0, top_p=1.0))
    assert chi_square_pvalue(seqs, wrong) < 1e-6


POWER_SAMPLES = 32768
POWER_PROMPT = (2, 1, 3, 1, 4, 2, 3, 2, 1)
# The peaked policy ends this prompt at once (eos with p > 0.9999): as many of these rows in the
# batch make the loop move the running rows into its halved batch after the first token.
FILLER_PROMPT = (0, 2, 2, 2, 1, 0, 0, 4, 0)


@pytest.mark.parametrize("temperature", [1.0, 1.03], ids=["correct", "3%-hotter"])
def test_a_3_percent_temperature_error_is_detected(tiny_vocab_policy, temperature):
    cfg, _ = tiny_vocab_policy
    params = random_params(cfg, seed=1, std=0.7)
    probs = exact_continuations(cfg, params, T1, POWER_PROMPT)
    hot = exact_continuations(cfg, params, dict(T1, temperature=1.03), POWER_PROMPT)
    assert chi_square_power(probs, hot, POWER_SAMPLES, 1e-3) >= 0.9
    out = generate(
        cfg,
        params,
        [list(POWER_PROMPT)] * POWER_SAMPLES + [list(FILLER_PROMPT)] * POWER_SAMPLES,
        jax.random.key(5),
        Sampling(max_new_tokens=MAX_NEW, temperature=temperature),
    )
    tokens, lengths = (np.asarray(x)[:POWER_SAMPLES].tolist() for x in (out.tokens, out.lengths))
    pvalue = chi_square_pvalue([tuple(r[:n]) for r, n in zip(tokens, lengths)], probs)
    if temperature == 1.0:
        assert pvalue > 1e-3
        assert sum(out.stats["stage_steps"][1:]) > 0, out.stats  # the exact law held through a staged loop
    else:
        assert pvalue < 1e-3


def staged_continuations(
    cfg, params, setting: dict, spec=None, prompt=PROMPT, samples: int = NUM_SAMPLES, max_new: int = MAX_NEW, seed=7
):
    """(continuations, RolloutOutput) of `samples` copies of `prompt`, `max_new` new tokens sampled
    with `setting` (Sampling's keywords) by the staged engine in one stage (see NUM_SAMPLES), under
    the one key of `seed`."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rollout_stages, "MIN_STAGE_ROWS", samples)
        run = generate(
            cfg,
            params,
            [list(prompt)] * samples,
            jax.random.key(seed),
            Sampling(max_new_tokens=max_new, **setting),
            spec=spec,
        )
    tokens, lengths = np.asarray(run.tokens), np.asarray(run.lengths)
    return [tuple(tokens[i, : lengths[i]].tolist()) for i in range(samples)], run


def slot_continuations(cfg, params, setting: dict, spec=None):
    """(continuations, RolloutOutput) of NUM_SAMPLES copies of PROMPT, 3 new tokens sampled with
    `setting` (Sampling's keywords) through 256 slots, one key."""
    sampling = Sampling(max_new_tokens=3, **setting)
    run = generate(cfg, params, [list(PROMPT)] * NUM_SAMPLES, jax.random.key(7), sampling, spec=spec, slots=256)
    tokens, lengths = np.asarray(run.tokens), np.asarray(run.lengths)
    return [tuple(tokens[i, : lengths[i]].tolist()) for i in range(NUM_SAMPLES)], run
