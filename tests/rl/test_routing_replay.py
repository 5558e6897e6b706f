"""Routing replay (R3) in the trainer: in float32 on small_moe-shaped tiny weights, replayed trainer
log-probs equal the rollout's and the recorded experts are the trainer's own choice; with perturbed
weights the log-prob pass and the update keep the rollout's experts; the records' packing, the
disagreement measure, and `jaxspec train` with a mixture-of-experts policy, replay on and off, on
one device, on a 2-device mesh and with async rollouts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models.moe import expert_id_dtype
from jaxspec.models.transformer import forward_router
from jaxspec.rl.batch import Rollouts, pack_rows, row_width, training_rows
from jaxspec.rl.compilation import packed_inputs
from jaxspec.rl.config import GRPOLossConfig, PolicyOptimConfig
from jaxspec.rl.loss import policy_loss
from jaxspec.rl.routing import differing_layers, disagreement_metrics, experts_to_width, replays_routing
from jaxspec.rl.step import score_fn, update_fn
from jaxspec.rollout import generate, processed_logprobs
from jaxspec.run.placement import MeshConfig, Placement
from tests.rl.runs import read_metrics, train_cli, write_config
from tests.rollout.conftest import random_params
from tests.rollout.test_recorded_experts import BATCH, CFG, SAMPLING, specs

pytestmark = pytest.mark.slow

PROMPTS = BATCH[::4]  # 16 rows, 2 of each of 8 prompts of 1 to 20 tokens
LOGPROB_TOL = 1e-5


@pytest.fixture(scope="module")
def policy():
    return random_params(CFG, seed=3, std=0.2)


@pytest.fixture(scope="module")
def perturbed(policy):
    """The policy after a step's worth of change: every weight moved by 5% of its scale."""
    leaves, treedef = jax.tree.flatten(policy)
    keys = jax.random.split(jax.random.key(9), len(leaves))
    return treedef.unflatten([w + 0.05 * jnp.std(w) * jax.random.normal(k, w.shape) for w, k in zip(leaves, keys)])


@pytest.fixture(scope="module", params=["autoregressive", "eagle3-tree"])
def rollout(request, policy):
    """(RolloutOutput, training rows with the record) of 16 rows, autoregressive or an EAGLE-3 tree."""
    out = generate(
        CFG, policy, PROMPTS, jax.random.key(4), SAMPLING, spec=specs(policy)[request.param], record_experts=True
    )
    width = row_width(20, SAMPLING.max_new_tokens)
    rows = training_rows(PROMPTS, np.asarray(out.tokens), np.asarray(out.lengths), CFG.pad_token_id, width)
    return out, rows.replace(experts=experts_to_width(np.asarray(out.experts), width))


def _scored(rows):
    packed = pack_rows(rows.response_rows())
    return packed, (packed.tokens, packed.segment_ids, packed.resp_index, packed.resp_tokens, packed.experts)


def _replayed_reference(params, rows) -> np.ndarray:
    """float32 [B, N] log p of the response tokens from an unpacked forward of the right-padded rows
    that replays each row's record (column for column)."""
    logits, _, _ = jax.jit(forward_router, static_argnums=0)(
        CFG, params, jnp.asarray(rows.tokens), mask=jnp.asarray(rows.attn_mask), experts=jnp.asarray(rows.experts)
    )
    logp = processed_logprobs(jnp.take_along_axis(logits, jnp.asarray(rows.resp_index)[:, :, None], axis=1), SAMPLING)
    return np.asarray(jnp.take_along_axis(logp, jnp.asarray(rows.resp_tokens)[:, :, None], axis=2)[:, :, 0])


def test_replayed_trainer_logprobs_equal_the_rollouts_and_perturbed_weights_keep_its_experts(
    policy, perturbed, rollout
):
    out, rows = rollout
    mask = rows.resp_mask
    _, args = _scored(rows)
    replay, own = (score_fn(CFG, SAMPLING, "float32", False, routing_replay=r) for r in (True, False))
    logp, differing = map(np.asarray, replay(policy, *args))
    np.testing.assert_allclose(logp[mask], np.asarray(out.logprobs)[mask], rtol=0, atol=LOGPROB_TOL)
    assert differing[mask].sum() == 0  # the record is the trainer's own choice on the same weights
    # Perturbed weights: the trainer's router picks other experts for many tokens, yet the replayed
    # pass runs the rollout's (an unpacked forward that replays the record agrees), unlike its own routing.
    replayed, moved = map(np.asarray, replay(perturbed, *args))
    routed, moved_own = map(np.asarray, own(perturbed, *args))
    assert disagreement_metrics(moved, mask, 2)["expert_disagreement"] > 0.02
    assert disagreement_metrics(moved_own, mask, 2)["expert_disagreement_tokens"] > 0.05
    reference = _replayed_reference(perturbed, rows)
    np.testing.assert_allclose(replayed[mask], reference[mask], rtol=0, atol=LOGPROB_TOL)
    finite = mask & np.isfinite(routed) & np.isfinite(reference)  # top-k sampling: -inf outside the nucleus
    assert np.abs(routed[finite] - reference[finite]).max() > 100 * LOGPROB_TOL


def test_the_update_replays_the_rollouts_experts_and_trains_the_router(policy, perturbed, rollout):
    """loss.routing_replay: the minibatch update's loss and gradient are those of the GRPO loss over
    an unpacked forward that replays the record; the router's gradient is not zero."""
    out, rows = rollout
    advantages = np.random.default_rng(0).standard_normal(len(PROMPTS)).astype(np.float32)
    behaviour_logp, loss_mask = np.asarray(out.logprobs), rows.resp_mask
    rows = rows.replace(advantages=advantages, prox_logp=behaviour_logp, loss_mask=loss_mask, seq_resp_mask=None)
    loss_cfg = GRPOLossConfig(routing_replay=True, router_aux_coef=0.0)
    update = update_fn(CFG, SAMPLING, loss_cfg, PolicyOptimConfig(), "float32", False, None)
    grads, _, metrics = update.gradients(perturbed, None, None, pack_rows(rows))

    def reference_loss(params, replayed):
        logits, _, _ = forward_router(
            CFG,
            params,
            jnp.asarray(rows.tokens),
            mask=jnp.asarray(rows.attn_mask),
            experts=jnp.asarray(rows.experts) if replayed else None,
        )
        logits = jnp.take_along_axis(logits, jnp.asarray(rows.resp_index)[:, :, None], axis=1)
        logp = jnp.take_along_axis(
            processed_logprobs(logits, SAMPLING), jnp.asarray(rows.resp_tokens)[:, :, None], axis=2
        )[:, :, 0]
        return policy_loss(logp, behaviour_logp, advantages, loss_mask, loss_cfg)[0]

    reference = jax.jit(jax.value_and_grad(reference_loss), static_argnums=1)
    (want_loss, want_grads), (own_loss, _) = (reference(perturbed, r) for r in (True, False))
    assert float(metrics["loss"]) == pytest.approx(float(want_loss), rel=1e-5, abs=1e-7)
    assert abs(float(own_loss) - float(want_loss)) > 1e-4  # the test tells replay from the router's own routing
    for layer in (0, 2):
        for name in ("router", "experts_up", "q"):
            got, want = grads["layers"][layer][name], want_grads["layers"][layer][name]
            assert float(jnp.max(jnp.abs(want))) > 0, (layer, name)
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(want))))
    with pytest.raises(ValueError, match="loss.routing_replay: the minibatch holds no recorded experts"):
        update.gradients(perturbed, None, None, pack_rows(rows.replace(experts=None)))


def test_differing_layers_compare_top_k_sets_at_the_predicting_positions():
    """A layer counts when its top-k *set* differs (order does not matter), at resp_index's positions."""
    logits = np.full((2, 1, 4, 5), -5.0, np.float32)  # [L_sparse, R, W, E], top-2 of 5
    picks = {(0, 0): (1, 3), (0, 1): (0, 2), (0, 2): (4, 1), (1, 0): (2, 3), (1, 1): (0, 2), (1, 2): (0, 1)}
    for (layer, position), (first, second) in picks.items():
        logits[layer, 0, position, [first, second]] = (3.0, 2.0)
    recorded = np.zeros((1, 4, 2, 2), np.uint8)
    recorded[0, 0] = [[3, 1], [2, 3]]  # the same sets in another order: agree
    recorded[0, 1] = [[0, 2], [0, 4]]  # layer 1 differs
    recorded[0, 2] = [[0, 1], [1, 2]]  # both differ
    counts = np.asarray(differing_layers(jnp.asarray(logits), jnp.asarray(recorded), jnp.asarray([[0, 1, 2]]), 2))
    assert counts.tolist() == [[0, 1, 2]]
    assert disagreement_metrics(counts, np.array([[True, True, True]]), 2) == pytest.approx(
        {"expert_disagreement": 3 / 6, "expert_disagreement_tokens": 2 / 3}
    )
    assert disagreement_metrics(counts, np.array([[True, False, False]]), 2)["expert_disagreement"] == 0.0


def test_records_are_packed_taken_and_concatenated_with_their_rows():
    prompts = [[5, 6, 7], [8], [9, 9, 9, 9]]
    tokens = np.array([[9, 2, 0, 0], [10, 11, 12, 13], [14, 0, 0, 0]])
    rows = training_rows(prompts, tokens, np.array([2, 4, 1]), pad_id=0, width=10)
    record = np.random.default_rng(1).integers(0, 16, (3, 16 + 4, 2, 2)).astype(np.uint8)  # [B, P + N, L, k]
    rows = rows.replace(experts=experts_to_width(record, 10))
    np.testing.assert_array_equal(rows.experts, record[:, :10])
    packed = pack_rows(rows.response_rows())
    # Sequences 0 and 1 share row 0 (columns 0-4, 5-9), sequence 2 takes row 1; padding holds expert 0.
    np.testing.assert_array_equal(packed.experts[0], np.concatenate([record[0, :5], record[1, :5]]))
    np.testing.assert_array_equal(packed.experts[1], np.concatenate([record[2, :5], np.zeros((5, 2, 2))]))
    np.testing.assert_array_equal(rows.take(np.array([2, 0])).experts, record[[2, 0], :10])
    rollouts = Rollouts(
        prompts=prompts,
        records=[{}] * 3,
        tokens=tokens,
        lengths=np.array([2, 4, 1]),
        logprobs=np.zeros((3, 4), np.float32),
        scores=np.zeros(3),
        rewards=np.zeros(3),
        stats={},
        generated_tokens=7,
        experts=record,
    )
    kept = Rollouts.concatenate([rollouts, rollouts.take(np.array([1]))]).take(np.array([3, 0]))
    np.testing.assert_array_equal(kept.experts, record[[1, 0]])
    np.testing.assert_array_equal(experts_to_width(record, 24)[:, 20:], 0)


@pytest.mark.parametrize("loss", [None, GRPOLossConfig(routing_replay=True), GRPOLossConfig()])
def test_precompiled_inputs_hold_the_records_the_step_packs(loss):
    """The abstract rows the trainer is compiled for have the fields, shapes and dtypes of those the
    step packs from rollouts that record their experts: the scoring rows (loss None) hold the
    record, a minibatch holds it with loss.routing_replay (the step drops it otherwise)."""
    prompts, new = [[5, 6, 7], [8], [9, 9], [4]], 4
    rows = training_rows(prompts, np.full((4, new), 3), np.array([2, 4, 1, 3]), pad_id=0, width=10)
    rows = rows.replace(experts=np.zeros((4, 10, 2, 2), expert_id_dtype(CFG.num_experts)))
    if loss is None:
        packed = pack_rows(rows.response_rows())
    else:
        logp = np.zeros((4, new), np.float32)
        packed = pack_rows(
            rows.replace(
                advantages=np.ones(4, np.float32),
                prox_logp=logp,
                loss_mask=rows.resp_mask,
                loss_denominator=np.full(4, 8.0, np.float32),
                seq_resp_mask=None,
                experts=rows.experts if loss.routing_replay else None,
            )
        )
    expected = packed_inputs(Placement(MeshConfig()), packed.tokens.shape[0], 4, 10, new, loss, model=CFG)
    assert jax.tree.structure(packed) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(packed), jax.tree.leaves(expected)):
        assert (got.shape, got.dtype) == (want.shape, want.dtype)
    assert (expected.experts is None) == (loss is not None and not loss.routing_replay)


def test_replay_is_refused_for_a_dense_policy():
    dense = dataclasses.replace(
        CFG, family="qwen3", num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, mlp_only_layers=()
    )
    with pytest.raises(ValueError, match="loss.routing_replay: the policy is dense"):
        replays_routing(GRPOLossConfig(routing_replay=True), dense)
    assert not replays_routing(GRPOLossConfig(), dense)


MOE_RUN = [
    "spec.method=ngram",
    "spec.draft=null",
    "spec.tree_width=2",
    "draft.online=false",
    "loss.kl_beta=0",
    "loss.ppo_epochs=1",
    "loss.recompute_logprobs=true",
]


@pytest.mark.parametrize(
    "options",
    [
        ["loss.routing_replay=true"],
        ["loss.routing_replay=false"],
        ["loss.routing_replay=true", "mesh.data=2", "rollout.sub_batch=16"],
        ["loss.routing_replay=true", "rollout.mode=async", "mesh.rollout_devices=2"],
        ["loss.routing_replay=true", "rollout.slots=4"],
    ],
    ids=["replay", "no-replay", "mesh-sub-batches", "async", "slots"],
)
def test_moe_grpo_logs_expert_disagreement(tiny_moe_policy, tmp_path, options):
    """`jaxspec train` on a mixture-of-experts policy with speculative (n-gram tree) rollouts: each step
    logs the trainer's disagreement with the rollout's experts next to the log-prob mismatch; in
    float32 the trainer at the rollout's weights routes as the rollout did, on the staged engine and
    on the slot engine (rollout.slots). Async rollouts train on
    weights one update older: the router has moved and the disagreement shows it."""
    config = write_config(tmp_path / "run.yaml", tiny_moe_policy[0], steps=2, eval_every=0, checkpoint_every=2)
    assert train_cli("--config", config, "--run-dir", tmp_path / "run", *MOE_RUN, *options) == 0
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    stale = "rollout.mode=async" in options
    for r in records:
        assert 0 <= r["expert_disagreement"] <= r["expert_disagreement_tokens"] <= 1
        if not stale or r["staleness"] == 0:
            assert r["expert_disagreement"] == 0.0 and r["logprob_mismatch_max"] < 1e-4
    if stale:
        assert records[1]["staleness"] == 1 and records[1]["expert_disagreement"] > 0
