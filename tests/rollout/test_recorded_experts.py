"""Rollouts of a mixture-of-experts policy that record their routing (R3): at every position a row's
tokens went through, the recorded experts are those a full forward over prompt + response routes to,
and a forward that replays them gives the rollout's log-probs; for autoregressive and speculative
tree rollouts (the accepted path's experts follow its KV's compaction), rows of different prompt
lengths, rows that move into the loop's smaller stage, and rows split over two devices."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.draft import init_eagle3
from jaxspec.models import ModelConfig, Sharding, make_mesh, shard_params
from jaxspec.models.moe import top_experts
from jaxspec.models.transformer import forward_router
from jaxspec.rollout import Sampling, Spec, generate, processed_logprobs
from tests.rollout.conftest import random_params
from tests.rollout.reference import padded

pytestmark = pytest.mark.slow

# small_moe's routing (16 experts, top-2, renormalised) on tiny weights; layer 1 of 3 is dense.
CFG = ModelConfig(
    family="qwen3_moe",
    vocab_size=61,
    hidden_size=48,
    intermediate_size=96,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=12,
    max_position_embeddings=96,
    pad_token_id=7,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    norm_topk_prob=True,
    mlp_only_layers=(1,),
)
# 8 prompts of 1 to 20 tokens, each 8 times: 64 rows, so the loop runs stages of 64 then 32 rows.
PROMPTS = [[5], [9, 11], [2, 40, 33], [17, 8, 60, 1, 4], [3] * 7, list(range(10, 21)), [44, 2] * 7, list(range(30, 50))]
BATCH = [p for p in PROMPTS for _ in range(8)]
SAMPLING = Sampling(temperature=1.0, top_k=8, max_new_tokens=16, eos_id=(42, 2))  # most rows stop early
LOGPROB_TOL = 1e-5
_forward = jax.jit(forward_router, static_argnums=0)


@pytest.fixture(scope="module")
def policy():
    assert CFG.sparse_layers == (0, 2)
    return random_params(CFG, seed=3, std=0.2)


def specs(params) -> dict:
    head = init_eagle3(CFG, jax.random.key(5), std=0.3)
    return {
        "autoregressive": None,
        "eagle3-tree": Spec("eagle3", head, num_draft_tokens=3, tree_width=2),
        # the policy drafting for itself: long accepted runs, through second children at T = 1
        "draft_model-tree": Spec("draft_model", (CFG, params), num_draft_tokens=3, tree_width=2, tree_budget=4),
    }


def check_record(params, prompts: list, out) -> None:
    """The rollout's record equals the full forward's routing at every position the rollout ran
    through the policy, and replaying it reproduces the rollout's log-probs."""
    tokens, lengths, experts = np.asarray(out.tokens), np.asarray(out.lengths), np.asarray(out.experts)
    num_rows, max_new = tokens.shape
    assert experts.dtype == np.uint8 and experts.shape[0] == num_rows and experts.shape[2:] == (2, 2)
    assert experts.shape[1] == 32 + max_new  # the prompt bucket of 20 tokens + N
    sequences = [list(p) + tokens[b, : lengths[b]].tolist() for b, p in enumerate(prompts)]
    width = max(map(len, sequences))
    mask = jnp.arange(width)[None, :] < jnp.asarray([len(s) for s in sequences])[:, None]
    _, _, router = _forward(CFG, params, padded(sequences, width), mask=mask)
    own = np.asarray(jnp.moveaxis(top_experts(router, 2), 0, 2))  # [B, T, L_sparse, k]
    logits, _, _ = _forward(CFG, params, padded(sequences, width), mask=mask, experts=jnp.asarray(experts[:, :width]))
    logp = np.asarray(processed_logprobs(logits, SAMPLING))
    for b, prompt in enumerate(prompts):
        fed = len(prompt) + lengths[b] - 1  # the last emitted token never goes through the policy
        np.testing.assert_array_equal(experts[b, :fed], own[b, :fed], err_msg=f"row {b}")
        positions = len(prompt) - 1 + np.arange(lengths[b])
        replayed = logp[b, positions, tokens[b, : lengths[b]]]
        np.testing.assert_allclose(
            replayed, np.asarray(out.logprobs)[b, : lengths[b]], rtol=0, atol=LOGPROB_TOL, err_msg=f"row {b}"
        )


@pytest.mark.parametrize("name", ["autoregressive", "eagle3-tree", "draft_model-tree"])
def test_recorded_experts_are_the_policys_routing_of_the_rollout(policy, name):
    out = generate(CFG, policy, BATCH, jax.random.key(1), SAMPLING, spec=specs(policy)[name], record_experts=True)
    lengths = np.asarray(out.lengths)
    assert out.stats["stage_rows"] == [64, 32] and out.stats["stage_steps"][1] > 0, "rows move into stage 2"
    assert lengths.min() < 8 and lengths.max() == SAMPLING.max_new_tokens
    if name == "draft_model-tree":
        assert out.stats["acceptance_length"] > 1.5
    check_record(policy, BATCH, out)


def test_recorded_experts_follow_rows_split_over_two_devices(policy):
    sharding = Sharding(make_mesh(data=2, fsdp=1, devices=jax.devices()[:2]))
    spec = specs(policy)["eagle3-tree"]
    out = generate(
        CFG,
        shard_params(sharding, policy),
        BATCH,
        jax.random.key(2),
        SAMPLING,
        spec=spec,
        sharding=sharding,
        record_experts=True,
    )
    assert out.experts.sharding.spec[0] == "data"
    check_record(policy, BATCH, out)


def test_only_a_rollout_that_asks_records_and_only_a_mixture_of_experts_policy(policy):
    short = dataclasses.replace(SAMPLING, max_new_tokens=4)
    assert generate(CFG, policy, BATCH[:2], jax.random.key(3), short).experts is None
    dense = dataclasses.replace(
        CFG, family="qwen3", num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, mlp_only_layers=()
    )
    with pytest.raises(ValueError, match="record_experts: the policy is dense"):
        generate(dense, random_params(dense, seed=4, std=0.2), BATCH[:2], jax.random.key(3), short, record_experts=True)
