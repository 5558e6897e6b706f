import jax
import numpy as np

from jaxspec.models import Sharding, make_mesh, shard_params
from jaxspec.rollout import Sampling, generate

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


def test_sharded_speculative_rollout_matches_unsharded(policy):
    """EAGLE-3 tree drafting on a (data, fsdp, tensor) mesh: the same tokens, log-probs and
    acceptance as on one device."""
    from jaxspec.draft import init_eagle3
    from jaxspec.rollout import Spec

    cfg, params = policy
    spec = Spec("eagle3", init_eagle3(cfg, jax.random.key(5), std=0.3), num_draft_tokens=3, tree_width=2,
                tree_budget=4)
    sharding = Sharding(make_mesh(data=2, fsdp=2, tensor=2))
    sampling = Sampling(temperature=0.0, max_new_tokens=6, eos_id=(13,))
    want = generate(cfg, params, PROMPTS, jax.random.key(0), sampling, spec=spec)
    got = generate(cfg, shard_params(sharding, params), PROMPTS, jax.random.key(0), sampling, spec=spec,
                   sharding=sharding)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-6)
    assert got.stats["accepted_tokens"] == want.stats["accepted_tokens"]
    assert got.tokens.sharding.spec[0] == ("data", "fsdp")
