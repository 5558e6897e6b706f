"""Decode steps as wide as the decoding slots (`jaxspec.rollout.slot_width`).

The step widths halve from S down to MIN_WIDTH; a step runs on the narrowest that holds every
decoding slot, and the slots it leaves out keep their state. On the embedded tiny policy and
EAGLE-3 head, rows whose lengths spread from 5 to 40 tokens: narrowed steps (widths 8, 4, 2, 1)
give the same sampled rows as full-width steps for autoregressive decoding, EAGLE-3 chains and
trees and n-gram drafts, and they do run narrowed (the per-width step counts); a step that gives
the narrowed forward the wrong slots is caught by the same comparison (negative control). The
chi-square tests of the slot engine (tests/rollout/test_slots.py, 256 slots) run through narrowed
steps too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.assets import tiny_eagle3_path, tiny_policy_path
from jaxspec.draft import load_eagle3
from jaxspec.models import load_hf
from jaxspec.rollout import Sampling, Spec, generate, slot_width

pytestmark = pytest.mark.slow

SAMPLED = Sampling(temperature=1.0, max_new_tokens=40, eos_id=2)
SLOTS = 8


def test_step_widths_halve_down_to_the_narrowest():
    assert slot_width.step_widths(256) == (256, 128, 64, 32, 16)
    assert slot_width.step_widths(24) == (24, 12)
    assert slot_width.step_widths(12) == (12,)  # 6 is below MIN_WIDTH
    assert slot_width.step_widths(256, groups=2) == (256,)  # a mesh keeps the full width


def test_a_step_sees_the_decoding_slots_first_and_the_others_keep_their_carry():
    widths = (8, 4, 2)

    def step(inputs, carry, shared):
        return inputs * 10, carry + inputs, shared + inputs.shape[0]

    inputs = jnp.arange(8, dtype=jnp.int32) + 1
    carry = jnp.full((8,), 100, jnp.int32)
    for active_slots, width in (([1, 6], 2), ([0, 3, 5], 4), ([0, 1, 2, 3, 4], 8)):
        active = jnp.zeros(8, bool).at[jnp.asarray(active_slots)].set(True)
        assert int(slot_width.width_index(widths, jnp.sum(active))) == widths.index(width)
        out, new_carry, shared = slot_width.at_width(width, active, step, inputs, carry, 0)
        assert int(shared) == width  # the step ran at this width
        out, new_carry = np.asarray(out), np.asarray(new_carry)
        for s in active_slots:  # every decoding slot went through the step
            assert out[s] == 10 * (s + 1) and new_carry[s] == 100 + s + 1
        ran = out != 0
        assert ran.sum() == width  # the step saw `width` slots: the decoding ones, then the first others
        assert np.all(new_carry[~ran] == 100)  # slots it did not see keep their carry


@pytest.fixture(scope="module")
def policy_and_head():
    cfg, params = load_hf(tiny_policy_path(), dtype="float32")
    return cfg, params, load_eagle3(tiny_eagle3_path(), dtype="float32", policy=cfg)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [list(rng.integers(3, 500, rng.integers(2, 9))) for _ in range(12)]


def specs(head) -> dict:
    return {
        "ar": None,
        "eagle3 chain": Spec(method="eagle3", draft=head, num_draft_tokens=3),
        "eagle3 tree": Spec(method="eagle3", draft=head, num_draft_tokens=3, tree_width=2, tree_budget=6),
        "ngram": Spec(method="ngram", num_draft_tokens=2),
    }


def rollouts(policy_and_head, prompts, name: str, min_width: int, monkeypatch):
    cfg, params, head = policy_and_head
    monkeypatch.setattr(slot_width, "MIN_WIDTH", min_width)
    spec = specs(head)[name]
    return generate(cfg, params, prompts, jax.random.key(3), SAMPLED, spec=spec, slots=SLOTS)


def assert_same_rows(full, narrow):
    np.testing.assert_array_equal(np.asarray(narrow.lengths), np.asarray(full.lengths))
    np.testing.assert_array_equal(np.asarray(narrow.tokens), np.asarray(full.tokens))
    np.testing.assert_allclose(np.asarray(narrow.logprobs), np.asarray(full.logprobs), atol=1e-5)


@pytest.mark.parametrize("name", ["ar", "eagle3 chain", "eagle3 tree", "ngram"])
def test_narrowed_steps_draw_the_full_width_rows(policy_and_head, prompts, name, monkeypatch):
    full = rollouts(policy_and_head, prompts, name, SLOTS + 1, monkeypatch)
    narrow = rollouts(policy_and_head, prompts, name, 1, monkeypatch)
    assert full.stats["step_widths"] == [SLOTS] and narrow.stats["step_widths"] == [8, 4, 2, 1]
    assert sum(n > 0 for n in narrow.stats["width_steps"][1:]) >= 2  # steps ran at narrower widths
    assert sum(narrow.stats["width_steps"]) == sum(full.stats["width_steps"])
    assert_same_rows(full, narrow)
    if name != "ar":
        assert narrow.stats["acceptance_length"] == full.stats["acceptance_length"] > 1.0


def test_a_narrowed_step_on_the_wrong_slots_is_caught(policy_and_head, prompts, monkeypatch):
    full = rollouts(policy_and_head, prompts, "eagle3 chain", SLOTS + 1, monkeypatch)
    decoding_first = slot_width.decoding_first  # the step runs on the slots that do not decode
    monkeypatch.setattr(slot_width, "decoding_first", lambda active: decoding_first(~active))
    jax.clear_caches()  # the loop is traced again, with the wrong order
    narrow = rollouts(policy_and_head, prompts, "eagle3 chain", 1, monkeypatch)
    with pytest.raises(AssertionError):
        assert_same_rows(full, narrow)
