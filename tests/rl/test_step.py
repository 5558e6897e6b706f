"""The compiled minibatch update: policy learning unaffected by the online draft, draft loss falls; the
router's load-balancing loss of a mixture-of-experts policy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxspec.draft import init_eagle3, split_buffers
from jaxspec.models import init_params
from jaxspec.models.moe import load_balancing_loss
from jaxspec.rl.batch import pack_rows, training_rows
from jaxspec.rl.config import GRPOLossConfig, OnlineDraftConfig, PolicyOptimConfig
from jaxspec.rl.loss import loss_denominator, policy_loss, reference_sampling, response_logprobs, sequence_forward
from jaxspec.rl.online_draft import OnlineDraft, draft_optimizer
from jaxspec.rl.step import policy_optimizer, score_fn, update_fn
from jaxspec.rollout import Sampling, generate


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _draft_case(cfg):
    """(params, sampling, a packed minibatch with seq_resp_mask) of 8 rollouts of a peaked policy."""
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.3)  # peaked next-token distributions to imitate
    sampling = Sampling(temperature=1.0, max_new_tokens=8, eos_id=cfg.eos_token_id)
    prompts = [[1, 3, 50, 60, 4]] * 4 + [[1, 3, 70, 4]] * 4
    out = generate(cfg, params, prompts, jax.random.PRNGKey(1), sampling=sampling)
    batch = training_rows(prompts, np.asarray(out.tokens), np.asarray(out.lengths), pad_id=0)
    batch = batch.replace(
        advantages=np.array([1, -1, 0.5, -0.5, 1, 1, -1, -1], np.float32),
        prox_logp=np.asarray(out.logprobs),
        loss_mask=batch.resp_mask,
    )
    return params, sampling, pack_rows(batch)


def test_online_draft_trains_without_touching_the_policy_gradient(tiny_policy):
    _, cfg, _ = tiny_policy
    params, sampling, batch = _draft_case(cfg)
    loss_cfg, optim = GRPOLossConfig(), PolicyOptimConfig(learning_rate=1e-2)
    dcfg, dparams = init_eagle3(cfg, jax.random.PRNGKey(2))
    weights, buffers = split_buffers(dparams)
    online = OnlineDraft(
        dcfg=dcfg, train=OnlineDraftConfig(online=True, loss_weight=1.0, learning_rate=1e-2, ttt_steps=1)
    )

    plain = update_fn(cfg, sampling, loss_cfg, optim, "float32", False, None)
    with_draft = update_fn(cfg, sampling, loss_cfg, optim, "float32", False, online)
    opt_state = policy_optimizer(optim).init(params)
    no_seq_mask = batch.replace(seq_resp_mask=None)
    p1, _, _, _, m1 = plain(_copy(params), _copy(opt_state), None, None, None, no_seq_mask)
    d_opt = draft_optimizer(online.train).init(weights)
    p2, s2, w2, d_opt2, m2 = with_draft(_copy(params), _copy(opt_state), _copy(weights), buffers, d_opt, batch)
    # The draft loss reads detached policy activations: the policy update is the same.
    assert float(m1["loss"]) == float(m2["loss"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-7), p1, p2)
    assert float(m2["draft_grad_norm"]) > 0 and np.isfinite(float(m2["draft_loss"]))
    assert not np.array_equal(np.asarray(w2["fc"]), np.asarray(weights["fc"]))

    losses = [float(m2["draft_loss"])]
    for _ in range(5):
        p2, s2, w2, d_opt2, m = with_draft(p2, s2, w2, buffers, d_opt2, batch)
        losses.append(float(m["draft_loss"]))
    assert losses[-1] < 0.92 * losses[0] and losses == sorted(losses, reverse=True), losses

    # A minibatch with no policy tokens (filtered groups) still trains the draft; the policy stays put
    # (the caller, which packed it, says so: an update without a draft has nothing to step).
    frozen = batch.replace(loss_mask=np.zeros_like(batch.loss_mask))
    with pytest.raises(ValueError, match="nothing to step"):
        plain(p1, s2, None, None, None, frozen.replace(seq_resp_mask=None), policy_steps=False)
    before, state_before, w_before = _copy(p2), _copy(s2), _copy(w2)
    p3, s3, w3, _, m = with_draft(p2, s2, w2, buffers, d_opt2, frozen, policy_steps=False)
    assert float(m["tokens"]) == 0
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), (before, state_before), (p3, s3))
    assert not np.array_equal(np.asarray(w3["fc"]), np.asarray(w_before["fc"]))


def test_draft_loss_weight_scales_the_head_update(tiny_policy):
    """λ = draft.loss_weight multiplies the head's clipped AdamW step: λ = 10 moves the head 10 times
    as far as λ = 1 (clipping and Adam would cancel a weight on the loss), λ = 0 not at all."""
    _, cfg, _ = tiny_policy
    params, sampling, batch = _draft_case(cfg)
    loss_cfg, optim = GRPOLossConfig(), PolicyOptimConfig(learning_rate=1e-3)
    dcfg, dparams = init_eagle3(cfg, jax.random.PRNGKey(2))
    weights, buffers = split_buffers(dparams)
    opt_state = policy_optimizer(optim).init(params)
    deltas = {}
    for weight in (0.0, 1.0, 10.0):
        train = OnlineDraftConfig(online=True, loss_weight=weight, learning_rate=1e-3, ttt_steps=1)
        update = update_fn(cfg, sampling, loss_cfg, optim, "float32", False, OnlineDraft(dcfg=dcfg, train=train))
        d_opt = draft_optimizer(train).init(weights)
        _, _, new, _, m = update(_copy(params), _copy(opt_state), _copy(weights), buffers, d_opt, batch)
        assert float(m["draft_grad_norm"]) > 0
        deltas[weight] = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), new, weights)
    for leaf in jax.tree.leaves(deltas[0.0]):
        assert not leaf.any()
    norm = {w: float(np.sqrt(sum((leaf**2).sum() for leaf in jax.tree.leaves(d)))) for w, d in deltas.items()}
    assert norm[1.0] > 0
    assert norm[10.0] == pytest.approx(10 * norm[1.0], rel=1e-3)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, 10 * b, rtol=1e-3, atol=1e-9), deltas[10.0], deltas[1.0])


def test_a_token_outside_the_nucleus_keeps_the_weights_finite(tiny_policy):
    """recompute_logprobs with top-k: a rollout token outside the trainer's nucleus (a bf16 rollout
    can sample one) gets old log-prob -inf. When the policy then moves it into the nucleus, its
    ratio would be inf; it is dropped from the loss and counted, through several minibatches and
    epochs, and the weights stay finite. The KL's temperature-only reference is finite on it."""
    _, cfg, _ = tiny_policy
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.3)
    sampling = Sampling(temperature=1.0, top_k=2, max_new_tokens=6, eos_id=cfg.eos_token_id)
    prompts = [[1, 3, 50, 60, 4]] * 4 + [[1, 3, 70, 4]] * 4
    out = generate(cfg, params, prompts, jax.random.PRNGKey(1), sampling=sampling)
    tokens, lengths = np.asarray(out.tokens).copy(), np.asarray(out.lengths)
    # Rollout 0's first token becomes the third most likely one: outside the top-2 nucleus.
    logits, _, _ = sequence_forward(cfg, params, jnp.asarray([prompts[0]]), jnp.ones((1, 5), jnp.int32))
    ranked = np.argsort(-np.asarray(logits[0, -1]))
    outsider = int(ranked[2])
    tokens[0, 0] = outsider
    batch = training_rows(prompts, tokens, lengths, pad_id=0)
    packed = pack_rows(batch)
    args = (packed.tokens, packed.segment_ids, packed.resp_index, packed.resp_tokens)
    prox_logp = np.asarray(score_fn(cfg, sampling, "float32", False)(params, *args))
    ref_logp = np.asarray(score_fn(cfg, reference_sampling(sampling), "float32", False)(params, *args))
    assert prox_logp[0, 0] == -np.inf and np.isfinite(ref_logp[batch.resp_mask]).all()
    # The policy that trains ranks the outsider first at that position: its current log-prob is finite.
    head = "embed" if cfg.tie_word_embeddings else "lm_head"
    moved = dict(params)
    moved[head] = (
        params[head]
        .at[(outsider if head == "embed" else (slice(None), outsider))]
        .set(params[head][(int(ranked[0]) if head == "embed" else (slice(None), int(ranked[0])))] * 1.5)
    )
    batch = batch.replace(
        advantages=np.array([1, -1, 0.5, -0.5, 1, 1, -1, -1], np.float32),
        prox_logp=prox_logp,
        ref_logp=ref_logp,
        loss_mask=batch.resp_mask,
        seq_resp_mask=None,
    )
    loss_cfg = GRPOLossConfig(kl_beta=0.1, minibatches=2, ppo_epochs=2)
    optim = PolicyOptimConfig(learning_rate=1e-2)
    update = update_fn(cfg, sampling, loss_cfg, optim, "float32", False, None)
    state, opt_state, counted = _copy(moved), policy_optimizer(optim).init(moved), []
    batch = batch.replace(loss_denominator=np.full(8, loss_denominator(batch.loss_mask, "token", 2), np.float32))
    for _epoch in range(2):
        for rows in (np.arange(4), np.arange(4, 8)):
            mb = pack_rows(batch.take(rows))
            state, opt_state, _, _, m = update(state, opt_state, None, None, None, mb)
            assert np.isfinite(float(m["loss"])) and np.isfinite(float(m["grad_norm"]))
            counted.append(float(m["nonfinite_tokens"]))
    current = np.asarray(score_fn(cfg, sampling, "float32", False)(moved, *args))
    assert np.isfinite(current[0, 0])  # the dangerous case: finite now, -inf when sampled
    first = batch.loss_mask[:4] & ~(np.isfinite(prox_logp) & np.isfinite(current))[:4]
    assert counted[0] == first.sum() >= 1 and counted[2] >= 1
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))


def test_bfloat16_optimizer_state_halves_the_first_moment_and_trains_alike(tiny_policy):
    """optim.state_dtype=bfloat16 stores AdamW's first moment in bf16 (the second stays float32);
    three updates move the params as the float32 state does, up to bf16 rounding of the moment."""
    _, cfg, _ = tiny_policy
    params, sampling, batch = _draft_case(cfg)
    batch = batch.replace(seq_resp_mask=None)
    loss_cfg = GRPOLossConfig()
    moved = {}
    for dtype in ("float32", "bfloat16"):
        optim = PolicyOptimConfig(learning_rate=1e-3, state_dtype=dtype)
        opt_state = policy_optimizer(optim).init(params)
        adam = opt_state[1][0]
        assert {x.dtype for x in jax.tree.leaves(adam.mu)} == {jnp.dtype(dtype)}
        assert {x.dtype for x in jax.tree.leaves(adam.nu)} == {jnp.dtype("float32")}
        update = update_fn(cfg, sampling, loss_cfg, optim, "float32", False, None)
        p = _copy(params)
        for _ in range(3):
            p, opt_state, _, _, metrics = update(p, opt_state, None, None, None, batch)
            assert np.isfinite(float(metrics["loss"]))
        assert {x.dtype for x in jax.tree.leaves(opt_state[1][0].mu)} == {jnp.dtype(dtype)}
        moved[dtype] = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), p, params)
    ref, ours = (np.concatenate([x.ravel() for x in jax.tree.leaves(moved[d])]) for d in ("float32", "bfloat16"))
    assert np.linalg.norm(ref) > 0
    assert np.linalg.norm(ours - ref) < 1e-2 * np.linalg.norm(ref)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _reference(cfg, params, sampling, mb):
    """From plain forwards of one packed minibatch: (router logits [L, R, W, E], gradient of the
    default GRPO policy loss alone, gradient of the load-balancing loss over the non-padding tokens)."""

    def policy(p):
        hidden, _, _ = sequence_forward(cfg, p, mb.tokens, mb.segment_ids, head=False)
        logp, _ = response_logprobs(cfg, p, hidden, mb.resp_index, mb.resp_tokens, sampling)
        return policy_loss(logp, mb.prox_logp, mb.advantages, mb.loss_mask, GRPOLossConfig())[0]

    def router(p):
        return sequence_forward(cfg, p, mb.tokens, mb.segment_ids)[2]

    def aux(p):
        return load_balancing_loss(router(p), cfg.num_experts_per_tok, mb.segment_ids > 0)

    return router(params), jax.grad(policy)(params), jax.grad(aux)(params)


def _moe_case(cfg):
    """(params, sampling, a packed minibatch with padding) of 8 random rollouts of a MoE policy."""
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.3)
    sampling = Sampling(temperature=1.0, max_new_tokens=8, eos_id=cfg.eos_token_id)
    rng = np.random.default_rng(0)
    prompts = [[1, 3, 50, 60, 4]] * 4 + [[1, 3, 70, 4]] * 4
    batch = training_rows(prompts, rng.integers(5, cfg.vocab_size, (8, 8)), rng.integers(1, 9, 8), pad_id=0)
    batch = batch.replace(
        advantages=np.array([1, -1, 0.5, -0.5, 1, 1, -1, -1], np.float32),
        prox_logp=rng.uniform(-7, -5, (8, 8)).astype(np.float32),
        loss_mask=batch.resp_mask,
        seq_resp_mask=None,
    )
    mb = pack_rows(batch)
    assert (mb.segment_ids == 0).any()  # padding, which the router loss must leave out
    return params, sampling, mb


def test_moe_update_adds_the_weighted_router_loss_of_the_real_tokens(tiny_moe_policy):
    """loss = policy loss + c x the load-balancing loss of the router logits of a plain forward over
    the non-padding tokens, and the gradient carries that term."""
    _, cfg, _ = tiny_moe_policy
    params, sampling, mb = _moe_case(cfg)
    optim = PolicyOptimConfig(learning_rate=1e-3)
    opt_state = policy_optimizer(optim).init(params)
    router, policy_grad, aux_grad = _reference(cfg, params, sampling, mb)
    aux = float(load_balancing_loss(router, cfg.num_experts_per_tok, mb.segment_ids > 0))
    assert abs(aux - float(load_balancing_loss(router, cfg.num_experts_per_tok))) > 1e-3  # padding would show
    metrics = {}
    for coef in (0.0, 3.0):
        update = update_fn(cfg, sampling, GRPOLossConfig(router_aux_coef=coef), optim, "float32", False, None)
        metrics[coef] = m = update(_copy(params), _copy(opt_state), None, None, None, mb)[-1]
        assert float(m["router_aux_loss"]) == pytest.approx(aux, rel=1e-6)
        assert float(m["loss"]) == pytest.approx(float(m["pg_loss"]) + coef * aux, rel=1e-6, abs=1e-7)
        grad = jax.tree.map(lambda g, a: g + coef * a, policy_grad, aux_grad)
        assert float(m["grad_norm"]) == pytest.approx(float(optax.tree.norm(grad)), rel=1e-5)
    assert float(metrics[3.0]["pg_loss"]) == float(metrics[0.0]["pg_loss"])
    assert float(metrics[3.0]["grad_norm"]) > 1.01 * float(metrics[0.0]["grad_norm"])


def test_moe_update_with_router_coefficient_zero_is_the_policy_loss_update(tiny_moe_policy):
    """loss.router_aux_coef 0: the AdamW step on the policy-loss gradient alone (up to float32
    reassociation between the two compiled programs)."""
    _, cfg, _ = tiny_moe_policy
    params, sampling, mb = _moe_case(cfg)
    loss_cfg, optim = GRPOLossConfig(router_aux_coef=0.0), PolicyOptimConfig(learning_rate=1e-3)
    opt = policy_optimizer(optim)
    opt_state = opt.init(params)
    updates, want_state = opt.update(_reference(cfg, params, sampling, mb)[1], opt_state, params)
    want = optax.apply_updates(params, updates)
    got, got_state, *_ = update_fn(cfg, sampling, loss_cfg, optim, "float32", False, None)(
        _copy(params), _copy(opt_state), None, None, None, mb
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-7),
        (got, got_state),
        (want, want_state),
    )
    moved = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params))
    )
    assert moved > 1e-4  # the tolerance is far below one step


def test_router_coefficient_on_a_dense_policy_is_refused(tiny_policy):
    _, cfg, _ = tiny_policy
    sampling = Sampling(temperature=1.0, max_new_tokens=8, eos_id=cfg.eos_token_id)
    with pytest.raises(ValueError, match="loss.router_aux_coef: the policy is dense"):
        update_fn(cfg, sampling, GRPOLossConfig(router_aux_coef=0.01), PolicyOptimConfig(), "float32", False, None)
