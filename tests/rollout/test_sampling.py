import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxspec.rollout import Sampling, processed_logprobs
from jaxspec.rollout.sampling import choose_tokens, sample
from tests.rollout.reference import reference_probs

SETTINGS = [
    dict(temperature=1.0, top_k=0, top_p=1.0),
    dict(temperature=0.7, top_k=0, top_p=0.9),
    dict(temperature=1.3, top_k=5, top_p=1.0),
    dict(temperature=0.5, top_k=7, top_p=0.8),
    dict(temperature=2.0, top_k=40, top_p=0.6),  # top_k >= V keeps everything
    dict(temperature=1.0, top_k=1, top_p=1.0),
    dict(temperature=0.0, top_k=3, top_p=0.5),  # greedy: the unfiltered T=1 view
]


@pytest.mark.parametrize("setting", SETTINGS, ids=str)
def test_processed_logprobs_match_numpy_definition(setting):
    logits = 3.0 * jax.random.normal(jax.random.key(0), (64, 33), jnp.float32)
    got = np.asarray(processed_logprobs(logits, Sampling(max_new_tokens=1, **setting)))
    for row, got_row in zip(np.asarray(logits), got):
        want = reference_probs(row, **setting)
        np.testing.assert_array_equal(np.isfinite(got_row), want > 0)
        np.testing.assert_allclose(np.exp(got_row), want, rtol=2e-5, atol=1e-7)


def test_processed_logprobs_keeps_ties_with_kth_largest_and_shape():
    logits = jnp.array([[[2.0, 1.0, 1.0, 0.0]]])
    got = processed_logprobs(logits, Sampling(top_k=2))
    assert got.shape == (1, 1, 4) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.exp(got[0, 0]), np.exp([2, 1, 1, -np.inf]) / np.exp([2, 1, 1]).sum(), rtol=1e-6)


def test_top_p_keeps_smallest_prefix_reaching_mass():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.log(jnp.asarray(probs, jnp.float32))

    def kept(top_p):
        return np.isfinite(np.asarray(processed_logprobs(logits, Sampling(top_p=top_p)))).sum()

    assert kept(0.1) == 1  # the most likely token always stays
    assert kept(0.79) == 2
    assert kept(0.81) == 3
    assert kept(1.0) == 4


def test_sample_matches_distribution_chi_square():
    probs = np.array([0.05, 0.4, 0.0, 0.25, 0.3])
    logprobs = jnp.log(jnp.asarray(probs, jnp.float32))
    draws = np.asarray(sample(jax.random.key(3), jnp.broadcast_to(logprobs, (20000, 5))))
    counts = np.bincount(draws, minlength=5)
    assert counts[2] == 0
    keep = probs > 0
    assert stats.chisquare(counts[keep], probs[keep] * counts.sum()).pvalue > 1e-3
    wrong = np.array([0.1, 0.35, 0.25, 0.3])
    assert stats.chisquare(counts[keep], wrong * counts.sum()).pvalue < 1e-6


def test_choose_tokens_greedy_reports_unscaled_logprob():
    logits = jnp.array([[0.0, 3.0, 1.0], [2.0, -1.0, 0.5]])
    tokens, logprobs = choose_tokens(jax.random.key(0), logits, Sampling(temperature=0.0, top_p=0.5))
    np.testing.assert_array_equal(tokens, [1, 0])
    np.testing.assert_allclose(logprobs, jax.nn.log_softmax(logits)[jnp.arange(2), tokens], rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(max_new_tokens=True), "max_new_tokens"),
        (dict(eos_id=-3), "eos_id"),
        (dict(eos_id=(1, "2")), "eos_id"),
    ],
)
def test_invalid_sampling_fields_raise(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Sampling(**kwargs)


def test_eos_resolution():
    assert Sampling(eos_id=None).eos_ids((4, 9)) == (4, 9)
    assert Sampling(eos_id=None).eos_ids(2) == (2,)
    assert Sampling(eos_id=None).eos_ids(None) == ()
    assert Sampling(eos_id=[3, 1]).eos_ids(2) == (3, 1)
    assert Sampling(eos_id=()).eos_ids(2) == ()
    assert hash(Sampling(eos_id=[3, 1])) == hash(Sampling(eos_id=(3, 1)))
    numpy_ints = Sampling(max_new_tokens=np.int64(4), top_k=np.int32(2), eos_id=[np.int64(3)])
    assert numpy_ints == Sampling(max_new_tokens=4, top_k=2, eos_id=(3,))
    assert type(numpy_ints.max_new_tokens) is int and type(numpy_ints.eos_id[0]) is int
