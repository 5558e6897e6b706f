import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxspec.models import init_params
from jaxspec.models.blocks import logits_from_hidden
from jaxspec.models.config import ModelConfig
from jaxspec.rl.advantages import group_advantages
from jaxspec.rl.batch import pack_rows, training_rows
from jaxspec.rl.config import GRPOLossConfig
from jaxspec.rl.loss import loss_denominator, policy_loss, response_logprobs, router_aux_weight, sequence_forward
from jaxspec.rollout import Sampling, generate
from jaxspec.rollout.sampling import processed_logprobs


def test_group_advantages_by_hand():
    rewards = [1, 0, 0, 1, 1, 1, 1, 1, 0, 0.5, 1, 0.5]
    adv, informative = group_advantages(rewards, 4, "std", eps=0.0)
    a, b = 0.5 / math.sqrt(1 / 3), 0.5 / math.sqrt(1 / 6)  # unbiased std of each group
    np.testing.assert_allclose(adv, [a, -a, -a, a, 0, 0, 0, 0, -b, 0, b, 0], rtol=1e-6)
    assert informative.tolist() == [True, False, True]
    assert (adv[4:8] == 0).all()  # zero-variance group: exactly zero, no nan
    adv, _ = group_advantages(rewards, 4, "mean")
    np.testing.assert_allclose(adv, [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, -0.5, 0, 0.5, 0], rtol=1e-7)
    adv, _ = group_advantages([0.3, 0.3, 0.3], 3, "std", eps=1e-6)
    assert (adv == 0).all()
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages([1, 0, 1], 4)


def _case():
    """Row 0: A=+1, ratios 1.5 (clipped high), 1.1, 0.5; row 1: A=-1, ratios 0.5 (clipped low), 1.5, pad;
    row 2: a filtered group's row (A=0)."""
    ratios = np.array([[1.5, 1.1, 0.5], [0.5, 1.5, 1.0], [1.2, 0.9, 1.0]])
    logp = jnp.asarray(np.log(ratios) - 1.0, jnp.float32)
    old = jnp.full((3, 3), -1.0, jnp.float32)
    adv = jnp.asarray([1.0, -1.0, 0.0])
    mask = jnp.asarray([[1, 1, 1], [1, 1, 0], [0, 0, 0]], bool)
    return logp, old, adv, mask


def test_clipped_loss_token_and_sequence_aggregation():
    logp, old, adv, mask = _case()
    cfg = GRPOLossConfig(eps_low=0.2, eps_high=0.28, aggregation="token")
    loss, m = policy_loss(logp, old, adv, mask, cfg)
    # pg per token: row 0 [-1.28, -1.1, -0.5], row 1 [0.8, 1.5]
    assert float(loss) == pytest.approx(-0.58 / 5, abs=1e-6)
    assert float(m["pg_loss"]) == pytest.approx(-0.58 / 5, abs=1e-6)
    assert float(m["clip_high_frac"]) == pytest.approx(0.2) and float(m["clip_low_frac"]) == pytest.approx(0.2)
    assert float(m["tokens"]) == 5 and float(m["kl"]) == 0
    grad = jax.grad(lambda lp: policy_loss(lp, old, adv, mask, cfg)[0])(logp)
    # clipped tokens get no gradient; the others -A * r / (number of tokens)
    np.testing.assert_allclose(grad, [[0, -1.1 / 5, -0.5 / 5], [0, 1.5 / 5, 0], [0, 0, 0]], atol=1e-6)

    seq = GRPOLossConfig(eps_low=0.2, eps_high=0.28, aggregation="sequence")
    assert float(policy_loss(logp, old, adv, mask, seq)[0]) == pytest.approx((-2.88 / 3 + 2.3 / 2) / 2, abs=1e-6)
    grad = jax.grad(lambda lp: policy_loss(lp, old, adv, mask, seq)[0])(logp)
    np.testing.assert_allclose(grad, [[0, -1.1 / 6, -0.5 / 6], [0, 1.5 / 4, 0], [0, 0, 0]], atol=1e-6)

    # Without filtering the zero-advantage row counts in the token denominator: -0.58 / 8.
    unfiltered = mask.at[2].set(True)
    assert float(policy_loss(logp, old, adv, unfiltered, cfg)[0]) == pytest.approx(-0.58 / 8, abs=1e-6)
    # Symmetric clipping (GRPO/PPO): ratio 1.5 with A=-1 stays unclipped, 1.1 with eps 0.05 clips.
    sym = GRPOLossConfig(eps_low=0.05, eps_high=0.05)
    loss = policy_loss(logp, old, adv, mask, sym)[0]
    assert float(loss) == pytest.approx((-1.05 - 1.05 - 0.5 + 0.95 + 1.5) / 5, abs=1e-6)


def test_k3_kl_penalty():
    logp, old, adv, mask = _case()
    cfg = GRPOLossConfig(kl_beta=0.1)
    ref = logp + math.log(2.0)  # ref/pi = 2 on every token: k3 = 2 - ln 2 - 1
    loss, m = policy_loss(logp, old, adv, mask, cfg, ref_logp=ref)
    assert float(m["kl"]) == pytest.approx(1 - math.log(2), abs=1e-6)
    assert float(loss) == pytest.approx(-0.58 / 5 + 0.1 * (1 - math.log(2)), abs=1e-6)
    _, m = policy_loss(logp, old, adv, mask, cfg, ref_logp=logp - math.log(2.0))  # ref/pi = 1/2
    assert float(m["kl"]) == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)
    # d k3 / d logp = 1 - ref/pi = -1 per token, times beta / tokens
    grad = jax.grad(lambda lp: policy_loss(lp, old, jnp.zeros(3), mask, cfg, ref_logp=lp + math.log(2.0))[0])
    np.testing.assert_allclose(grad(logp), 0.0, atol=1e-7)  # ref moves with logp: constant ratio
    grad = jax.grad(lambda lp: policy_loss(lp, old, jnp.zeros(3), mask, cfg, ref_logp=ref)[0])(logp)
    np.testing.assert_allclose(grad, np.where(mask, -0.1 / 5, 0.0), atol=1e-7)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, old, adv, mask, cfg)


def test_trainer_logprobs_match_the_rollout(tiny_policy):
    """One full-sequence forward reproduces the log-probs `generate` reports, for a filtered p."""
    _, cfg, params = tiny_policy
    sampling = Sampling(temperature=0.7, top_k=40, top_p=0.9, max_new_tokens=10, eos_id=cfg.eos_token_id)
    prompts = [[1, 3, 50, 60, 4], [1, 3, 70, 4], [1, 3, 50, 60, 4]]
    out = generate(cfg, params, prompts, jax.random.PRNGKey(3), sampling=sampling)
    rows = training_rows(prompts, np.asarray(out.tokens), np.asarray(out.lengths), pad_id=0, width=48)
    packed = pack_rows(rows)
    assert packed.tokens.shape[0] == 1  # all three rollouts share one row
    hidden, _, _ = sequence_forward(cfg, params, packed.tokens, packed.segment_ids, head=False)
    logp, entropy = response_logprobs(cfg, params, hidden, packed.resp_index, packed.resp_tokens, sampling)
    valid = rows.resp_mask
    assert np.isfinite(np.asarray(logp)[valid]).all()
    np.testing.assert_allclose(np.asarray(logp)[valid], np.asarray(out.logprobs)[valid], atol=2e-6)
    assert (np.asarray(entropy)[valid] > 0).all()


def test_nonfinite_logprobs_are_masked_and_counted():
    """A token whose current, old, rollout or reference log-prob is -inf (outside a top-k/top-p
    nucleus) leaves the loss: same loss and gradient as with the token masked, all finite."""
    logp, old, adv, mask = _case()
    ref, rollout = logp + 0.1, old - 0.05
    cfg = GRPOLossConfig(kl_beta=0.1, tis_cap=2.0)
    bad = [(0, 0), (0, 2), (1, 0), (1, 1)]
    inf_old, inf_ref, inf_rollout, inf_cur = (
        x.at[i, j].set(-jnp.inf) for x, (i, j) in zip((old, ref, rollout, logp), bad)
    )
    clean = mask.at[tuple(np.array(bad).T)].set(False)

    def loss(cur, m, old_, ref_, rollout_):
        return policy_loss(cur, old_, adv, m, cfg, ref_logp=ref_, behaviour_logp=rollout_)

    want, want_m = loss(logp, clean, old, ref, rollout)
    # the current log-prob's -inf at (1, 1) comes from the forward: its gradient must stay finite
    got, got_m = loss(inf_cur, mask, inf_old, inf_ref, inf_rollout)
    assert float(got) == pytest.approx(float(want), abs=1e-7) and np.isfinite(float(got))
    assert float(got_m["nonfinite_tokens"]) == 4 and float(want_m["nonfinite_tokens"]) == 0
    assert float(got_m["tokens"]) == 1
    outside = jnp.zeros((3, 3), bool).at[bad[3]].set(True)
    grad = jax.grad(lambda lp: loss(jnp.where(outside, -jnp.inf, lp), mask, inf_old, inf_ref, inf_rollout)[0])(logp)
    want_grad = jax.grad(lambda lp: loss(lp, clean, old, ref, rollout)[0])(logp)
    assert np.isfinite(np.asarray(grad)).all()
    np.testing.assert_allclose(grad, want_grad, atol=1e-7)


def test_dual_clip_bounds_negative_advantage_tokens():
    """A < 0 and ratio 5: PPO's loss is 5|A|; dual-clip (clip_ratio_c 3) caps it at 3|A| with no gradient."""
    logp = jnp.log(jnp.asarray([[5.0, 2.0, 5.0]]))
    old, mask = jnp.zeros((1, 3)), jnp.ones((1, 3), bool)
    for adv, want_c, want_plain in ((-1.0, (3 + 2 + 3) / 3, (5 + 2 + 5) / 3), (1.0, -1.28, -1.28)):
        loss, m = policy_loss(logp, old, jnp.asarray([adv]), mask, GRPOLossConfig(clip_ratio_c=3.0))
        assert float(loss) == pytest.approx(want_c, abs=1e-5)
        assert float(m["dual_clip_frac"]) == pytest.approx(2 / 3 if adv < 0 else 0.0)
        plain = policy_loss(logp, old, jnp.asarray([adv]), mask, GRPOLossConfig(clip_ratio_c=None))[0]
        assert float(plain) == pytest.approx(want_plain, abs=1e-5)
    grad = jax.grad(lambda lp: policy_loss(lp, old, jnp.asarray([-1.0]), mask, GRPOLossConfig())[0])(logp)
    np.testing.assert_allclose(grad, [[0.0, 2.0 / 3, 0.0]], atol=1e-6)


def test_behaviour_weight_scales_tokens_up_to_the_cap():
    """The decoupled objective: each token's clipped loss times min(exp(prox - behaviour), tis_cap),
    not differentiated; its mean, max and capped fraction are reported; null leaves it uncapped; a
    cap of 0 (no behaviour policy) refuses behaviour log-probs."""
    logp, prox, adv, mask = _case()
    behaviour = prox - jnp.log(jnp.asarray([[0.5, 1.0, 4.0], [2.0, 8.0, 1.0], [1.0, 1.0, 1.0]]))
    weights = np.array([[0.5, 1.0, 3.0], [2.0, 3.0, 1.0], [1.0, 1.0, 1.0]])  # capped at 3
    cfg = GRPOLossConfig(tis_cap=3.0)
    loss, m = policy_loss(logp, prox, adv, mask, cfg, behaviour_logp=behaviour)
    pg = np.array([[-1.28, -1.1, -0.5], [0.8, 1.5, 0.0], [0, 0, 0]])
    counted = np.asarray(mask)
    assert float(loss) == pytest.approx((pg * weights)[counted].sum() / 5, abs=1e-6)
    assert float(m["behaviour_weight_mean"]) == pytest.approx(weights[counted].mean(), abs=1e-6)
    assert float(m["behaviour_weight_max"]) == pytest.approx(3.0)
    assert float(m["behaviour_weight_capped_frac"]) == pytest.approx(2 / 5)
    grad = jax.grad(lambda lp: policy_loss(lp, prox, adv, mask, cfg, behaviour_logp=behaviour)[0])(logp)
    plain = jax.grad(lambda lp: policy_loss(lp, prox, adv, mask, GRPOLossConfig())[0])(logp)
    np.testing.assert_allclose(grad, np.asarray(plain) * weights, atol=1e-6)
    _, m = policy_loss(logp, prox, adv, mask, GRPOLossConfig(tis_cap=None), behaviour_logp=behaviour)
    assert float(m["behaviour_weight_max"]) == pytest.approx(8.0) and float(m["behaviour_weight_capped_frac"]) == 0
    _, m = policy_loss(logp, prox, adv, mask, cfg)  # no behaviour log-probs: the ratio's anchor is the behaviour
    assert float(m["behaviour_weight_mean"]) == 1 and float(m["behaviour_weight_max"]) == 1
    with pytest.raises(ValueError, match="tis_cap 0 drops the behaviour policy"):
        policy_loss(logp, prox, adv, mask, GRPOLossConfig(tis_cap=0.0), behaviour_logp=behaviour)


def _bandit_gradients(staleness: int, cfg: GRPOLossConfig, weigh_behaviour: bool, samples: int = 200_000):
    """An 8-armed bandit whose softmax policy drifted by `staleness` updates since the behaviour
    policy that sampled `samples` one-token rollouts: (per-sample policy_loss gradients [samples, 8]
    w.r.t. the logits at the proximal (current) weights, the exact on-policy gradient [8])."""
    keys = jax.random.split(jax.random.key(7), 3)
    logits = jax.random.normal(keys[0], (8,))
    drift = 0.35 * jax.random.normal(keys[1], (staleness, 8))  # each update moves the logits ~1 nat in total
    behaviour_logits, prox_logits = logits, logits + drift.sum(axis=0)
    reward = jnp.linspace(0.0, 1.0, 8)
    arms = jax.random.categorical(keys[2], behaviour_logits, shape=(samples,))
    advantage = reward[arms] - 0.5  # a constant baseline leaves the expected gradient unchanged
    prox = jax.nn.log_softmax(prox_logits)[arms]
    behaviour = jax.nn.log_softmax(behaviour_logits)[arms]

    def sample_loss(theta, arm, prox_lp, behaviour_lp, adv):
        logp = jax.nn.log_softmax(theta)[arm]
        return policy_loss(
            logp[None, None],
            prox_lp[None, None],
            adv[None],
            jnp.ones((1, 1), bool),
            cfg,
            behaviour_logp=behaviour_lp[None, None] if weigh_behaviour else None,
        )[0]

    per_sample = jax.vmap(jax.grad(sample_loss), (None, 0, 0, 0, 0))(prox_logits, arms, prox, behaviour, advantage)
    probs = jax.nn.softmax(prox_logits)
    on_policy = -jnp.sum(probs[:, None] * (reward - 0.5)[:, None] * (jnp.eye(8) - probs[None, :]), axis=0)
    return np.asarray(per_sample, np.float64), np.asarray(on_policy, np.float64)


@pytest.mark.parametrize("staleness", [1, 2, 3])
def test_decoupled_gradient_of_stale_rollouts_is_the_on_policy_gradient(staleness):
    """Rollouts sampled by a policy `staleness` updates old, trained at the proximal (current)
    weights: the mean of the decoupled loss's per-token gradients (ratio anchored at the proximal
    policy, each token weighted by pi_prox / pi_behaviour, uncapped) equals the exact on-policy
    gradient within 5 standard errors per component (false failure < 1e-5 for the 8 components).
    The standard error is under 3% of the gradient's norm, so a bias of ~15% is detected. Negative
    control: the combination that drops the behaviour policy (recomputed anchor, no weight) is off
    by many standard errors."""
    per_sample, on_policy = _bandit_gradients(staleness, GRPOLossConfig(tis_cap=None), weigh_behaviour=True)
    mean, se = per_sample.mean(axis=0), per_sample.std(axis=0) / np.sqrt(len(per_sample))
    assert se.max() < 0.03 * np.linalg.norm(on_policy)
    assert (np.abs(mean - on_policy) < 5 * se).all(), (mean, on_policy, se)
    dropped, _ = _bandit_gradients(staleness, GRPOLossConfig(tis_cap=0.0), weigh_behaviour=False)
    dropped_se = dropped.std(axis=0) / np.sqrt(len(dropped))
    assert (np.abs(dropped.mean(axis=0) - on_policy) > 10 * dropped_se).any()


def test_dr_grpo_constant_length_normaliser():
    """seq-mean-token-sum-norm: each sequence's token sum / N (= max_new_tokens), mean over sequences."""
    logp, old, adv, mask = _case()
    loss = policy_loss(logp, old, adv, mask, GRPOLossConfig(aggregation="seq-mean-token-sum-norm"))[0]
    assert float(loss) == pytest.approx((-2.88 / 3 + 2.3 / 3) / 2, abs=1e-6)
    grad = jax.grad(
        lambda lp: policy_loss(lp, old, adv, mask, GRPOLossConfig(aggregation="seq-mean-token-sum-norm"))[0]
    )
    np.testing.assert_allclose(grad(logp), [[0, -1.1 / 6, -0.5 / 6], [0, 1.5 / 6, 0], [0, 0, 0]], atol=1e-6)
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(logp, old, adv, mask, GRPOLossConfig(aggregation="mean"))


@pytest.mark.parametrize("aggregation", ["token", "sequence", "seq-mean-token-sum-norm"])
def test_step_level_normaliser_over_minibatches(aggregation):
    """With the step's count (`loss_denominator`), the minibatch losses average to the loss of the
    whole step, whatever the minibatches' own token counts."""
    rng = np.random.default_rng(0)
    logp = jnp.asarray(rng.normal(-1, 0.1, (8, 5)), jnp.float32)
    old = jnp.asarray(rng.normal(-1, 0.1, (8, 5)), jnp.float32)
    adv = jnp.asarray(rng.normal(0, 1, 8), jnp.float32)
    lengths = np.array([5, 1, 1, 1, 5, 5, 4, 0])
    mask = np.arange(5)[None, :] < lengths[:, None]
    cfg = GRPOLossConfig(aggregation=aggregation)
    whole = float(policy_loss(logp, old, adv, mask, cfg)[0])
    denominator = loss_denominator(mask, aggregation, 2)
    halves = [
        float(policy_loss(logp[s], old[s], adv[s], mask[s], cfg, denominator=denominator)[0])
        for s in (slice(0, 4), slice(4, 8))
    ]
    assert np.mean(halves) == pytest.approx(whole, rel=1e-5)
    own = [float(policy_loss(logp[s], old[s], adv[s], mask[s], cfg)[0]) for s in (slice(0, 4), slice(4, 8))]
    if aggregation == "token":  # per-minibatch means weigh the 8 tokens of the first half like the 14 of the second
        assert abs(np.mean(own) - whole) > 1e-3
    assert loss_denominator(mask, aggregation, 1) == (mask.sum() if aggregation == "token" else 7)


def test_router_aux_weight_defaults_to_the_policys_coefficient(tiny_policy, tiny_moe_policy):
    moe, dense = tiny_moe_policy[1], tiny_policy[1]
    assert router_aux_weight(GRPOLossConfig(), moe) == moe.router_aux_loss_coef == 0.05
    assert router_aux_weight(GRPOLossConfig(router_aux_coef=0.3), moe) == 0.3
    assert router_aux_weight(GRPOLossConfig(router_aux_coef=0.0), moe) == 0.0
    assert (
        router_aux_weight(GRPOLossConfig(), dense)
        == router_aux_weight(GRPOLossConfig(router_aux_coef=0.0), dense)
        == 0.0
    )
    with pytest.raises(ValueError, match=r"loss.router_aux_coef: the policy is dense .* got 0.01"):
        router_aux_weight(GRPOLossConfig(router_aux_coef=0.01), dense)


def _head_case(tie: bool):
    """(cfg, params, packed rows of 6 random rollouts of up to 7 new tokens, resp_tokens [6, 7]: half the
    tokens the policy's most likely ones, so that top-k / top-p keep them, half random)."""
    cfg = ModelConfig(
        family="qwen3",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
    )
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.3)
    rng = np.random.default_rng(0)
    prompts = [[1, 3, 50, 60, 4], [1, 3, 70, 4], [1, 5, 4]] * 2
    rows = training_rows(prompts, rng.integers(5, 96, (6, 7)), rng.integers(1, 8, 6), pad_id=0)
    packed = pack_rows(rows)
    logits = sequence_forward(cfg, params, packed.tokens, packed.segment_ids)[0]
    likely = np.asarray(jnp.argmax(logits.reshape(-1, 96)[packed.resp_index], axis=-1))
    tokens = np.where(rng.random((6, 7)) < 0.5, likely, rng.integers(0, 96, (6, 7))).astype(np.int32)
    return cfg, params, packed, jnp.asarray(tokens)


def _unchunked_logprobs(cfg, params, hidden, resp_index, resp_tokens, sampling):
    """The reference: float32 logits [R, W, V] of every position, gathered to [S, N, V]."""
    logits = logits_from_hidden(cfg, params, hidden)
    logp_all = processed_logprobs(logits.reshape(-1, logits.shape[-1])[resp_index], sampling)
    logp = jnp.take_along_axis(logp_all, resp_tokens[:, :, None], axis=2)[:, :, 0]
    probs = jnp.where(jnp.isfinite(logp_all), jnp.exp(logp_all) * logp_all, 0.0)
    return logp, -probs.sum(-1)


SAMPLINGS = [
    Sampling(temperature=1.0),
    Sampling(temperature=0.7, top_k=5),
    Sampling(temperature=1.0, top_p=0.8),
    Sampling(temperature=0.9, top_k=20, top_p=0.9),
]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["t1", "t0.7-topk", "topp", "topk-topp"])
def test_chunked_logprobs_equal_the_unchunked_head(sampling):
    """response_logprobs from the final hidden states, in chunks that divide S * N = 42 or leave a padded
    tail (and one chunk larger than all positions), equals log p and entropy from the logits of every
    position; the head=False forward is the logits' input."""
    cfg, params, packed, resp_tokens = _head_case(tie=False)
    hidden, _, _ = sequence_forward(cfg, params, packed.tokens, packed.segment_ids, head=False)
    np.testing.assert_array_equal(
        logits_from_hidden(cfg, params, hidden), sequence_forward(cfg, params, packed.tokens, packed.segment_ids)[0]
    )
    want_logp, want_entropy = _unchunked_logprobs(cfg, params, hidden, packed.resp_index, resp_tokens, sampling)
    assert np.isfinite(np.asarray(want_logp)).sum() >= 21
    if sampling.top_k or sampling.top_p < 1:
        assert np.isneginf(np.asarray(want_logp)).any()  # the filter excludes some of the random tokens
    for chunk in (1, 7, 16, 42, 1000):
        logp, entropy = response_logprobs(
            cfg, params, hidden, packed.resp_index, resp_tokens, sampling, chunk_size=chunk
        )
        assert logp.shape == entropy.shape == (6, 7)
        np.testing.assert_allclose(logp, want_logp, rtol=0, atol=1e-5, err_msg=f"chunk {chunk}")
        np.testing.assert_allclose(entropy, want_entropy, rtol=0, atol=1e-5, err_msg=f"chunk {chunk}")
    with pytest.raises(ValueError, match="chunk_size"):
        response_logprobs(cfg, params, hidden, packed.resp_index, resp_tokens, sampling, chunk_size=0)


@pytest.mark.parametrize("tie", [False, True], ids=["lm_head", "tied"])
def test_chunked_logprobs_have_the_unchunked_gradient(tie):
    """The gradient w.r.t. every param (through the head and the forward) of a weighted sum of the
    chunked log-probs equals the unchunked one's; the entropy carries no gradient."""
    cfg, params, packed, resp_tokens = _head_case(tie)
    sampling = SAMPLINGS[-1]
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(6, 7)), jnp.float32)

    def objective(logprobs):
        def f(p):
            hidden, _, _ = sequence_forward(cfg, p, packed.tokens, packed.segment_ids, head=False)
            logp, entropy = logprobs(p, hidden)
            return jnp.sum(jnp.where(jnp.isfinite(logp), logp, 0.0) * weights) + entropy.sum()

        return jax.jit(jax.grad(f))(params)

    def unchunked(p, hidden):  # the entropy is not differentiated: a constant in the reference
        logp, entropy = _unchunked_logprobs(cfg, p, hidden, packed.resp_index, resp_tokens, sampling)
        return logp, jax.lax.stop_gradient(entropy)

    want = objective(unchunked)
    for chunk in (16, 42):
        got = objective(
            functools.partial(
                response_logprobs,
                cfg,
                resp_index=packed.resp_index,
                resp_tokens=resp_tokens,
                sampling=sampling,
                chunk_size=chunk,
            )
        )
        assert float(optax.tree.norm(want)) > 0
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


def test_the_trainer_forward_runs_large_expert_calls_through_the_kernels_on_gpus(tiny_moe_policy, monkeypatch):
    """sequence_forward asks for moe_impl auto: on a GPU (faked) a packed batch of 4 x 8192 tokens
    (4 experts x top-2: 262144 experts x rows) takes the grouped-matmul kernels, forward and
    gradient; on this CPU it keeps ragged_dot."""
    from jaxspec.models import moe

    cfg, params = tiny_moe_policy[1], tiny_moe_policy[2]
    tokens = jax.ShapeDtypeStruct((4, 8192), jnp.int32)

    def jaxpr() -> str:
        def loss(p, t):
            return sequence_forward(cfg, p, t, jnp.ones_like(t), head=False)[0].astype(jnp.float32).sum()

        return str(jax.make_jaxpr(jax.grad(loss))(params, tokens))

    assert "pallas_call" not in jaxpr()
    monkeypatch.setattr(moe, "on_gpu", lambda: True)
    gpu = jaxpr()
    assert "grouped_matmul" in gpu and "grouped_transposed_matmul" in gpu  # forward / dX, and dW


@pytest.mark.parametrize("head", [False, True])
def test_remat_saves_no_compute_dtype_copy_of_the_weights(head, capsys):
    """The trainer's bf16 forward over float32 master weights casts each layer's weights inside its
    rematerialised layer function, so the backward pass keeps the master weights (arguments, alive
    anyway) and no bf16 copy of the layers (2 bytes per parameter per device: 8.2 GB for Qwen3-8B
    over fsdp=2). A cast of the whole tree before the forward saved every layer's bf16 weights.
    (head=True, pretraining's path, keeps the bf16 LM head for the logits' backward; the trainer's
    head=False applies it in rematerialised chunks, `response_logprobs`.) The outputs are those of
    the forward on the cast weights, bit for bit."""
    import re

    from jax.ad_checkpoint import print_saved_residuals

    cfg = ModelConfig(
        family="qwen3",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    params = init_params(cfg, jax.random.key(0), jnp.float32)
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, cfg.vocab_size)
    segments = jnp.ones((2, 32), jnp.int32).at[1, 20:].set(2)

    def loss(p):
        out, _, _ = sequence_forward(cfg, p, tokens, segments, (), jnp.bfloat16, True, None, head=head)
        return out.astype(jnp.float32).sum()

    weight_shapes = {"bf16[" + ",".join(map(str, x.shape)) + "]" for x in jax.tree.leaves(params["layers"])}
    capsys.readouterr()
    print_saved_residuals(loss, params)  # one line per residual: "bf16[64,128] output of ..."
    saved = [line for line in capsys.readouterr().out.splitlines() if "from the argument" not in line]
    copies = [line for line in saved if re.match(r"\S+", line)[0] in weight_shapes]
    assert not copies, f"bf16 weight copies saved for the backward pass: {copies}"
    assert any(line.startswith("bf16[2,32,64]") for line in saved), "the activations were not found among them"

    cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    ours = sequence_forward(cfg, params, tokens, segments, (1,), jnp.bfloat16, True, None, head=head)
    reference = sequence_forward(cfg, cast, tokens, segments, (1,), jnp.bfloat16, True, None, head=head)
    for a, b in zip(ours[:2], reference[:2]):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("mesh_shape", [None, (1, 2, 1), (2, 2, 2)], ids=["one-device", "fsdp2", "data2-fsdp2-tensor2"])
def test_draft_targets_in_chunks_equal_the_targets_of_every_position(mesh_shape):
    """The online head's targets built a few columns of the packed rows at a time (chunks that
    divide the width, leave a padded tail, or exceed it) equal `eagle3_targets` of the logits of
    every position: the draft-vocabulary softmax and the argmax over the whole vocabulary, which
    here often falls outside the draft vocabulary (40 of the 96 tokens, the most frequent of random
    counts)."""
    from jaxspec.draft import eagle3_targets, init_eagle3
    from jaxspec.models import Sharding, make_mesh, shard_params
    from jaxspec.rl.loss import draft_targets

    cfg, params, packed, _ = _head_case(tie=False)
    counts = np.random.default_rng(3).integers(0, 1000, cfg.vocab_size)
    _, dparams = init_eagle3(cfg, jax.random.PRNGKey(1), 40, counts)
    hidden, _, _ = sequence_forward(cfg, params, packed.tokens, packed.segment_ids, head=False)
    want = eagle3_targets(dparams, logits_from_hidden(cfg, params, hidden))
    in_vocab = np.asarray(dparams["t2d"])[np.asarray(want.top)]
    assert in_vocab.any() and not in_vocab.all()
    sharding = None
    if mesh_shape is not None:
        sharding = Sharding(make_mesh(*mesh_shape, devices=jax.devices()[: np.prod(mesh_shape)]))
        params = shard_params(sharding, params)
    rows, width = packed.tokens.shape
    assert width % 3  # 3 columns a chunk leave a padded tail
    for chunk in (rows, rows * 3, rows * width, 10_000):
        fn = jax.jit(lambda p, h, d: draft_targets(cfg, p, h, d, chunk_size=chunk, sharding=sharding))
        got = fn(params, hidden, dparams)
        assert got.soft.shape == (rows, width, 40) and got.top.shape == (rows, width)
        np.testing.assert_allclose(got.soft, want.soft, rtol=0, atol=1e-6, err_msg=f"chunk {chunk}")
        np.testing.assert_array_equal(got.top, want.top, err_msg=f"chunk {chunk}")
    with pytest.raises(ValueError, match="chunk_size"):
        draft_targets(cfg, params, hidden, dparams, chunk_size=0)


def test_a_100_nat_log_ratio_gap_gives_finite_gradients():
    """Log-ratios are clamped before exp: a current, proximal, behaviour or reference log-prob 100
    nats apart (exp overflows float32 past ~88) leaves the loss and its gradient finite; within the
    clamp nothing changes."""
    logp, prox, adv, mask = _case()
    cfg = GRPOLossConfig(kl_beta=0.1, tis_cap=None)
    far = jnp.zeros((3, 3)).at[0, 1].set(100.0).at[1, 1].set(-100.0)

    def loss(lp, prox_, behaviour, ref):
        return policy_loss(lp, prox_, adv, mask, cfg, ref_logp=ref, behaviour_logp=behaviour)[0]

    for args in ((logp + far, prox, prox, logp), (logp, prox, prox - far, logp), (logp, prox, prox, logp + far)):
        value, grad = jax.value_and_grad(loss)(*args)
        assert np.isfinite(float(value)) and np.isfinite(np.asarray(grad)).all(), args
    near = jnp.zeros((3, 3)).at[0, 1].set(3.0)
    want = policy_loss(logp, prox, adv, mask, GRPOLossConfig(tis_cap=None), behaviour_logp=prox - near)[0]
    pg = np.array([[-1.28, -1.1 * math.exp(3.0), -0.5], [0.8, 1.5, 0.0]])
    assert float(want) == pytest.approx(pg[np.asarray(mask)[:2]].sum() / 5, rel=1e-5)


def test_a_step_with_fewer_tokens_than_minibatches_keeps_the_whole_step_gradient():
    """2 loss tokens over 4 minibatches: the step's denominator per minibatch is 0.5, and the
    minibatches' gradients sum to the gradient of the whole step's loss (a clamp at 1 would halve it)."""
    rng = np.random.default_rng(1)
    logp = jnp.asarray(rng.normal(-1, 0.05, (4, 3)), jnp.float32)
    prox = jnp.asarray(rng.normal(-1, 0.05, (4, 3)), jnp.float32)
    adv = jnp.asarray([1.0, -1.0, 0.5, 2.0])
    mask = np.zeros((4, 3), bool)
    mask[0, 1] = mask[3, 0] = True
    cfg = GRPOLossConfig()
    denominator = loss_denominator(mask, "token", 4)
    assert denominator == 0.5
    whole = jax.grad(lambda lp: policy_loss(lp, prox, adv, mask, cfg)[0])(logp)
    parts = sum(
        jax.grad(
            lambda lp: policy_loss(
                lp[i : i + 1],
                prox[i : i + 1],
                adv[i : i + 1],
                mask[i : i + 1],
                cfg,
                denominator=jnp.float32(denominator),
            )[0]
        )(logp)
        for i in range(4)
    )
    np.testing.assert_allclose(np.asarray(parts) / 4, whole, rtol=1e-6)
