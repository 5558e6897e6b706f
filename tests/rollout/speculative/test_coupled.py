"""Coupled draws (`Sampling.coupled`): a sampled speculative rollout emits the autoregressive
rollout's tokens under the same key.

On the embedded tiny policy in float32 with its trained EAGLE-3 head, sampled at T = 1 (drafts
accepted and rejected, rows ending at eos at different lengths): EAGLE-3 chains in the staged loop and on 3 slots
give the coupled autoregressive rollout's tokens and log-probs. The control: with the default
draws the same EAGLE-3 rollout departs from the autoregressive one in at least half the rows. Every other
drafter, preemption and the exact law: tests/rollout/speculative/test_coupled_drafters.py (slow).
"""

import dataclasses

import jax
import numpy as np
import pytest

from jaxspec.rollout import Spec, generate
from tests.rollout.conftest import assert_same_rollout


@pytest.fixture(scope="module")
def coupled(tiny):
    """(cfg, params, head, rows, coupled T = 1 Sampling, its staged autoregressive rollout)."""
    cfg, params, head, rows, _, sampled = tiny
    sampling = dataclasses.replace(sampled, coupled=True)
    return cfg, params, head, rows, sampling, generate(cfg, params, rows, jax.random.key(5), sampling)


@pytest.mark.parametrize("slots", [None, 3], ids=["staged", "3-slots"])
def test_eagle3_chains_emit_the_autoregressive_tokens(coupled, slots):
    cfg, params, head, rows, sampling, ar = coupled
    out = generate(
        cfg, params, rows, jax.random.key(5), sampling, spec=Spec("eagle3", head, num_draft_tokens=3), slots=slots
    )
    assert 1.5 < out.stats["acceptance_length"] < 4.0, out.stats  # drafts accepted and rejected
    assert len(set(np.asarray(ar.lengths).tolist())) > 2  # rows end at different lengths (eos)
    assert_same_rollout(out, ar)


def test_the_default_draws_depart_from_the_autoregressive_rollout(coupled):
    cfg, params, head, rows, sampling, ar = coupled
    plain = dataclasses.replace(sampling, coupled=False)
    ar_plain = generate(cfg, params, rows, jax.random.key(5), plain)
    spec = generate(cfg, params, rows, jax.random.key(5), plain, spec=Spec("eagle3", head, num_draft_tokens=3))
    differ = np.any(np.asarray(spec.tokens) != np.asarray(ar_plain.tokens), axis=1)
    assert differ.sum() >= len(rows) // 2, differ


def test_stochastic_drafts_are_refused(coupled):
    cfg, params, head, rows, sampling, _ = coupled
    spec = Spec("eagle3", head, num_draft_tokens=3, draft_sampling="stochastic")
    with pytest.raises(ValueError, match="Sampling.coupled needs deterministic drafts"):
        generate(cfg, params, rows, jax.random.key(5), sampling, spec=spec)
    with pytest.raises(ValueError, match="Sampling.coupled must be True or False"):
        dataclasses.replace(sampling, coupled="yes")
