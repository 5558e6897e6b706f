"""Speculative rollouts of a mixture-of-experts policy: the dense policy's loop and exactness tests,
run on random Qwen3-MoE policies (every layer or every other layer sparse).

The tests of `test_loop` and `test_lossless` are called here with this module's `policy` and
`tiny_vocab_policy` fixtures, which override the dense ones of tests/rollout/conftest.py for the
imported module-scoped fixtures too.
"""

import dataclasses

import jax
import numpy as np
import pytest

from jaxspec.draft import init_eagle3
from jaxspec.models import ModelConfig, Sharding, make_mesh, moe, shard_params
from jaxspec.rollout import Spec, generate
from tests.rollout.conftest import random_params
from tests.rollout.speculative import test_loop as loop_tests
from tests.rollout.speculative import test_lossless as lossless
from tests.rollout.speculative.test_loop import autoregressive, eos_and_reference, greedy_sampling, speculative  # noqa: F401
from tests.rollout.speculative.test_lossless import drafts, race_tiles, reference, sampled, teacher_forced  # noqa: F401

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def policy():
    """The dense `policy` fixture's shapes with 8 experts (2 per token, renormalised) in both layers."""
    cfg = ModelConfig(
        family="qwen3_moe",
        vocab_size=61,
        hidden_size=48,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=12,
        max_position_embeddings=96,
        pad_token_id=7,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        norm_topk_prob=True,
    )
    assert cfg.sparse_layers == (0, 1)
    return cfg, random_params(cfg, seed=2, std=0.2)


@pytest.fixture(scope="module")
def tiny_vocab_policy():
    """Vocabulary 6 with eos 5 (as the dense one); layer 1 of 2 routes over 4 experts, 2 per token.
    Seed 4: eos ends more than 100 of the sampled continuations under nucleus sampling, the
    coverage the exactness test asks for (seed 1 gives 51)."""
    cfg = ModelConfig(
        family="qwen3_moe",
        vocab_size=6,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        eos_token_id=5,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        decoder_sparse_step=2,
    )
    assert cfg.sparse_layers == (1,)
    return cfg, random_params(cfg, seed=4, std=0.2)


@pytest.mark.parametrize("name", ["draft_model-self-chain", "eagle3-chain", "ngram-tree"])
def test_moe_greedy_speculation_equals_greedy_autoregressive(speculative, autoregressive, eos_and_reference, name):  # noqa: F811
    loop_tests.test_greedy_speculation_equals_greedy_autoregressive(
        speculative, autoregressive, eos_and_reference, name
    )


def test_moe_draft_identical_to_the_policy_accepts_everything(speculative):  # noqa: F811
    loop_tests.test_a_draft_identical_to_the_policy_accepts_everything(speculative)


# One case per method and tree shape (the dense module runs all 20).
MOE_CASES = [
    ("eagle3", "chain", "stochastic", lossless.T1),
    ("draft_model", "tree", "greedy", lossless.NUCLEUS),
    ("ngram", "tree", "greedy", lossless.T1),
]


@pytest.mark.parametrize("case", MOE_CASES, ids=lossless.case_id)
def test_moe_speculative_samples_follow_exact_distribution(
    tiny_vocab_policy,
    teacher_forced,  # noqa: F811
    reference,  # noqa: F811
    sampled,  # noqa: F811
    case,
):
    lossless.test_speculative_samples_follow_exact_distribution(
        tiny_vocab_policy, teacher_forced, reference, sampled, case
    )


def test_moe_rollouts_with_experts_split_over_the_mesh(policy, greedy_sampling):  # noqa: F811
    """AR and EAGLE-3 greedy rollouts with the experts split over 4 devices (rows over 2) equal
    the one-device rollouts."""
    cfg, params = policy
    sharding = Sharding(make_mesh(data=2, fsdp=1, expert=4))
    sharded = shard_params(sharding, params)
    assert sharded["layers"][0]["experts_up"].sharding.spec[0] == "expert"
    spec = Spec("eagle3", init_eagle3(cfg, jax.random.key(5), std=0.3), num_draft_tokens=3)
    for kwargs in ({}, {"spec": spec}):
        want = generate(cfg, params, loop_tests.BATCH, jax.random.key(0), greedy_sampling, **kwargs)
        got = generate(cfg, sharded, loop_tests.BATCH, jax.random.key(0), greedy_sampling, sharding=sharding, **kwargs)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.lengths, want.lengths)
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-6)


def test_moe_rollouts_with_the_grouped_matmul_kernel_are_token_identical(policy, greedy_sampling, monkeypatch):  # noqa: F811
    """A greedy EAGLE-3 rollout (prefill, verification and decode steps) and a sampled AR rollout
    give the same tokens with the grouped-matmul kernel (in Triton's interpreter) as with ragged_dot."""
    pytest.importorskip("torch", reason="Triton's interpreter runs on torch CPU tensors (the test extra has torch)")
    cfg, params = policy
    traced = []

    kernels = moe.kernels()  # (needs triton)
    kernel = kernels.grouped_matmul_triton

    def counting_kernel(*args, **kwargs):
        traced.append(kwargs["interpret"])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(kernels, "grouped_matmul_triton", counting_kernel)
    spec = Spec("eagle3", init_eagle3(cfg, jax.random.key(5), std=0.3), num_draft_tokens=3)
    at_t1 = dataclasses.replace(greedy_sampling, temperature=1.0)
    runs = [(greedy_sampling, {"spec": spec}), (at_t1, {})]
    results = {}
    for impl in ("ragged_dot", "triton-interpret"):  # ragged_dot: also what "auto" picks on CPU
        monkeypatch.setenv(moe.IMPL_ENV, impl)
        if impl == "triton-interpret":
            jax.clear_caches()  # the rollout's programs read the variable when traced
        results[impl] = [
            generate(cfg, params, loop_tests.BATCH, jax.random.key(1), sampling, **kwargs) for sampling, kwargs in runs
        ]
    jax.clear_caches()  # later tests trace their rollouts afresh, with the variable unset
    assert traced and all(traced)  # the kernel ran in the second rollouts only
    for want, got in zip(results["ragged_dot"], results["triton-interpret"], strict=True):
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.lengths, want.lengths)
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-6)
