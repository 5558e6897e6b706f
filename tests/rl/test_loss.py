"""The GRPO / DAPO / Dr.GRPO policy loss (`jaxspec.rl.loss.policy_loss`): clipping, aggregation and its
step-level normaliser, the k3 KL penalty, the behaviour weights of stale rollouts, non-finite and far-apart
log-probs, and the router's load-balancing weight."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.rl.config import GRPOLossConfig
from jaxspec.rl.loss import loss_denominator, policy_loss, router_aux_weight


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
