import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import Sharding, make_mesh, shard_params
from jaxspec.models.sharding import gathered_param_shardings
from jaxspec.rollout import Sampling, generate
from jaxspec.run.placement import cast_floats

pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 11], [2, 40, 33, 17, 8, 60, 1], [5, 9, 11], [30] * 12, [1], [5, 9, 11], [44, 2], [1]]


def test_sharded_rollout_matches_unsharded(policy):
    cfg, params = policy
    sharding = Sharding(make_mesh(data=2, fsdp=2, tensor=2))
    sampling = Sampling(temperature=0.0, max_new_tokens=6, eos_id=(13,))
    want = generate(cfg, params, PROMPTS, jax.random.key(0), sampling)
    got = generate(cfg, shard_params(sharding, params), PROMPTS, jax.random.key(0), sampling, sharding=sharding)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-6)
    assert got.stats["steps"] == want.stats["steps"]
    assert got.tokens.sharding.spec[0] == ("data", "fsdp")  # rows stay split over the batch axes


def _speculative_on_one_device_and_on_a_mesh(policy, spec, sampling):
    """(sharded, unsharded) greedy speculative rollouts of PROMPTS with `spec`, after checking that
    they agree: tokens, lengths, log-probs, accepted drafts and stage steps; rows stay split over
    the mesh's batch axes."""
    cfg, params = policy
    sharding = Sharding(make_mesh(data=2, fsdp=2, tensor=2))
    want = generate(cfg, params, PROMPTS, jax.random.key(0), sampling, spec=spec)
    got = generate(
        cfg, shard_params(sharding, params), PROMPTS, jax.random.key(0), sampling, spec=spec, sharding=sharding
    )
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-6)
    assert got.stats["accepted_tokens"] == want.stats["accepted_tokens"]
    assert got.stats["stage_steps"] == want.stats["stage_steps"]
    assert got.tokens.sharding.spec[0] == ("data", "fsdp")
    return got, want


def test_sharded_speculative_rollout_matches_unsharded(policy):
    """EAGLE-3 tree drafting on a (data, fsdp, tensor) mesh: the same tokens, log-probs and
    acceptance as on one device."""
    from jaxspec.draft import init_eagle3
    from jaxspec.rollout import Spec

    spec = Spec(
        "eagle3", init_eagle3(policy[0], jax.random.key(5), std=0.3), num_draft_tokens=3, tree_width=2, tree_budget=4
    )
    _speculative_on_one_device_and_on_a_mesh(policy, spec, Sampling(temperature=0.0, max_new_tokens=6, eos_id=(13,)))


def test_sharded_staged_rollout_with_a_draft_depth_per_stage_matches_unsharded(policy, monkeypatch):
    """EAGLE-3 chains drafting 1 then 3 tokens as the loop moves from 8 to 4 rows, on a mesh: the
    same tokens, log-probs and acceptance as on one device. Token 3 ends five of the eight greedy
    rows after 4-5 tokens, so the loop moves into its 4-row stage."""
    from jaxspec.draft import init_eagle3
    from jaxspec.rollout import Spec, stages

    monkeypatch.setattr(stages, "MIN_STAGE_ROWS", 4)
    assert stages.batch_stages(len(PROMPTS), Sharding(make_mesh(data=2, fsdp=2, tensor=2))) == (8, 4)
    assert stages.batch_stages(len(PROMPTS)) == (8, 4)
    spec = Spec(
        "eagle3", init_eagle3(policy[0], jax.random.key(5), std=0.3), num_draft_tokens=3, stage_draft_tokens=(1, 3)
    )
    _, want = _speculative_on_one_device_and_on_a_mesh(
        policy, spec, Sampling(temperature=0.0, max_new_tokens=12, eos_id=(3,))
    )
    assert min(want.stats["stage_steps"]) > 0


@pytest.mark.parametrize("tensor", [1, 2])
def test_rollout_from_the_gathered_copy_matches_the_fsdp_sharded_one(policy, tensor):
    """rollout.gather_weights: the bf16 copy gathered over fsdp (split over tensor only) generates
    the same tokens and log-probs as the fsdp-sharded copy, greedy and sampled with one key, rows
    still split over the batch axes; every device holds the whole policy / tensor."""
    cfg, params = policy
    sharding = Sharding(make_mesh(data=1, fsdp=2, tensor=tensor, devices=jax.devices()[: 2 * tensor]))
    sharded = cast_floats(shard_params(sharding, params), jnp.bfloat16)
    gathered = cast_floats(sharded, jnp.bfloat16, gathered_param_shardings(sharding, sharded))
    for x, y in zip(jax.tree.leaves(sharded), jax.tree.leaves(gathered)):
        assert "fsdp" not in tuple(y.sharding.spec)
        parts = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
        whole_but_tensor = tuple(n // tensor if part == "tensor" else n for n, part in zip(x.shape, parts))
        assert {s.data.shape for s in y.addressable_shards} == {whole_but_tensor}
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert any("fsdp" in x.sharding.spec for x in jax.tree.leaves(sharded))  # the test compares two layouts
    for temperature in (0.0, 1.0):
        sampling = Sampling(temperature=temperature, max_new_tokens=6, eos_id=(13,))
        want = generate(cfg, sharded, PROMPTS, jax.random.key(3), sampling, sharding=sharding)
        got = generate(cfg, gathered, PROMPTS, jax.random.key(3), sampling, sharding=sharding)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.lengths, want.lengths)
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-6)
        assert got.tokens.sharding.spec[0] == "fsdp"  # rows stay split over the batch axes
