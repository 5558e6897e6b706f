"""The slot engine records a mixture-of-experts policy's routing as the staged engine does: greedy
autoregressive, EAGLE-3 and draft-model tree rollouts on 1 or 3 slots give the staged engine's record at every
position the rollout ran through the policy, also for rows preempted and resumed (their re-prefill
records their positions again) and for rows that took their prompt's prefix pages from the
prefix cache (the shared prompt positions' experts come from the row that prefilled them)."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxspec.models import Sharding, make_mesh, shard_params
from jaxspec.rollout import Sampling, generate
from tests.rollout.test_recorded_experts import (
    CFG,
    PROMPTS,
    policy,  # noqa: F401  (fixture)
    specs,
)

pytestmark = pytest.mark.slow

# 5 prompts of 3 to 20 tokens, 3 rows each: with pages of 4 positions the later rows of a prompt of
# 5 or more tokens take its first pages from the prefix cache.
BATCH = [p for p in PROMPTS[2:7] for _ in range(3)]
GREEDY = Sampling(temperature=0.0, max_new_tokens=10, eos_id=(42,))
LAYOUTS = {
    "1-slot": dict(slots=1, page_size=4),
    "3-slots": dict(slots=3, page_size=4),
    # a pool of one row's longest sequence (with EAGLE-3's lookahead): rows are preempted and resumed
    "3-slots-preempting": dict(slots=3, page_size=4, kv_pages=8, decode_steps=2),
}


@pytest.fixture(scope="module")
def staged(policy):  # noqa: F811
    return {
        name: generate(CFG, policy, BATCH, jax.random.key(0), GREEDY, spec=specs(policy)[name], record_experts=True)
        for name in ("autoregressive", "eagle3-tree", "draft_model-tree")
    }


def assert_same_record(out, expected) -> None:
    """The rollouts' tokens are equal and so are their records at every position [0, p_b +
    lengths[b] - 1) of each row (those the policy ran)."""
    np.testing.assert_array_equal(out.tokens, expected.tokens)
    np.testing.assert_array_equal(out.lengths, expected.lengths)
    got, want = np.asarray(out.experts), np.asarray(expected.experts)
    assert got.shape == want.shape and got.dtype == want.dtype
    for b, prompt in enumerate(BATCH[: len(want)]):
        ran = len(prompt) + int(expected.lengths[b]) - 1
        np.testing.assert_array_equal(got[b, :ran], want[b, :ran], err_msg=f"row {b}")


CASES = [(name, layout) for name in ("autoregressive", "eagle3-tree") for layout in LAYOUTS]
# the random EAGLE-3 head's drafts are all rejected; the policy drafting for itself accepts whole
# paths, whose experts move with their KV
CASES.append(("draft_model-tree", "3-slots-preempting"))


@pytest.mark.parametrize(("name", "layout"), CASES)
def test_slot_record_equals_the_staged_engines(policy, staged, name, layout):  # noqa: F811
    out = generate(
        CFG,
        policy,
        BATCH,
        jax.random.key(0),
        GREEDY,
        spec=specs(policy)[name],
        record_experts=True,
        **LAYOUTS[layout],
    )
    assert out.stats["prefix_pages_shared"] > 0
    assert (out.stats["preemptions"] > 0) == ("kv_pages" in LAYOUTS[layout])
    if name == "draft_model-tree":
        assert out.stats["acceptance_length"] > 1.5
    assert_same_record(out, staged[name])
    # negative control: the record one position off differs from the staged engine's
    shifted = out._replace(experts=np.roll(np.asarray(out.experts), 1, axis=1))
    with pytest.raises(AssertionError, match="row"):
        assert_same_record(shifted, staged[name])


def test_only_a_slot_rollout_that_asks_records(policy):  # noqa: F811
    short = dataclasses.replace(GREEDY, max_new_tokens=3)
    assert generate(CFG, policy, BATCH[:2], jax.random.key(0), short, slots=2).experts is None


def test_slot_record_of_rows_split_over_two_devices(policy, staged):  # noqa: F811
    """On a mesh of 2 groups each group records its own rows; the record is the one-device one."""
    sharding = Sharding(make_mesh(data=2, fsdp=1, devices=jax.devices()[:2]))
    params = shard_params(sharding, policy)
    out = generate(
        CFG, params, BATCH[:12], jax.random.key(0), GREEDY, record_experts=True, slots=4, page_size=4, sharding=sharding
    )
    assert out.stats["groups"] == 2 and out.stats["prefix_pages_shared"] > 0
    expected = staged["autoregressive"]
    assert_same_record(
        out, expected._replace(**{f: getattr(expected, f)[:12] for f in ("tokens", "lengths", "experts")})
    )
