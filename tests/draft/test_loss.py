"""Training-time-test loss: attention pattern, loss bookkeeping, and that training works."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.draft import eagle3_loss, fuse, init_eagle3, split_buffers, to_target_ids, ttt_attention, ttt_forward
from jaxspec.draft.loss import _flash_ttt_attention
from jaxspec.draft_training.config import HeadLossConfig, HeadOptimConfig
from jaxspec.draft_training.train import eval_step, train_step
from jaxspec.models import ModelConfig, forward_hidden
from jaxspec.models.attention import attention
from jaxspec.optim import make_optimizer
from jaxspec.rollout import Sampling, generate
from tests.draft.conftest import random_head
from tests.models.hf_reference import random_params, random_tokens

STEPS = 3
B, T = 2, 12

loss_jit = jax.jit(eagle3_loss, static_argnums=(0, 7, 8))
forward_jit = jax.jit(forward_hidden, static_argnums=(0, 3))


def _ttt_mask(step: int, seq: int) -> np.ndarray:
    """bool [T, (step + 1) * T] by definition, keys laid out step by step: query t sees the
    step-0 keys s <= t and, of each step 1..step, the key at its own position t."""
    mask = np.zeros((seq, (step + 1) * seq), bool)
    for t in range(seq):
        for j in range(step + 1):
            for s in range(seq):
                mask[t, j * seq + s] = s <= t if j == 0 else s == t
    return mask


@pytest.mark.parametrize("step", [0, 1, 3])
def test_ttt_attention_equals_dense_attention_under_the_ttt_mask(step):
    """Both forms of TTT attention (the factored scores, and one attention call over all (step + 1)
    * T keys as cuDNN runs it) equal grouped-query attention under the TTT mask; with packed
    sequences, each sees only its own segment."""
    b, t, nq, nk, d = 2, 6, 4, 2, 8
    keys = jax.random.split(jax.random.PRNGKey(step), 5)
    q = jax.random.normal(keys[0], (b, t, nq, d))
    ks = [jax.random.normal(keys[1], (b, t, nk, d))] + [
        jax.random.normal(jax.random.fold_in(keys[2], j), (b, t, nk, d)) for j in range(step)
    ]
    vs = [jax.random.normal(keys[3], (b, t, nk, d))] + [
        jax.random.normal(jax.random.fold_in(keys[4], j), (b, t, nk, d)) for j in range(step)
    ]
    segments = jnp.asarray([[1, 1, 1, 1, 1, 1], [1, 1, 2, 2, 2, 3]], jnp.int32)
    mask = np.broadcast_to(_ttt_mask(step, t), (b, t, (step + 1) * t)).copy()
    same = np.asarray(segments)[:, :, None] == np.asarray(segments)[:, None, :]
    mask[:, :, :t] &= same
    dense = attention(q, jnp.concatenate(ks, axis=1), jnp.concatenate(vs, axis=1), jnp.asarray(mask))
    stack = lambda xs: jnp.stack(xs, axis=2) if xs else jnp.zeros((b, t, 0, nk, d))  # noqa: E731
    args = (q, ks[0], vs[0], stack(ks[1:]), stack(vs[1:]), segments)
    np.testing.assert_allclose(ttt_attention(*args, "xla"), dense, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_flash_ttt_attention(*args, "xla"), dense, rtol=1e-5, atol=1e-5)


def test_loss_and_metrics_match_a_loop_over_positions(policy, head):
    """eagle3_loss against the definition evaluated position by position from the TTT logits."""
    cfg, params = policy
    dcfg, dparams = head
    b, t = B, T
    tokens = jnp.asarray(random_tokens(4, (b, t), cfg.vocab_size))
    loss_mask = np.zeros((b, t), bool)
    loss_mask[0, 3:12] = True
    loss_mask[1, 5:9] = True
    policy_logits, aux = forward_jit(cfg, params, tokens, dcfg.aux_layer_ids)
    loss, metrics = loss_jit(
        dcfg, dparams, params["embed"], aux, policy_logits, tokens, jnp.asarray(loss_mask), STEPS, 0.8
    )
    draft, _ = jax.jit(ttt_forward, static_argnums=(0, 5))(
        dcfg, dparams, params["embed"], fuse(dcfg, dparams, aux), tokens, STEPS
    )
    draft, policy_logits = np.asarray(draft, np.float64), np.asarray(policy_logits, np.float64)
    t2d = np.asarray(dparams["t2d"])
    kept = np.flatnonzero(t2d)  # policy id of each draft id

    expected_total = 0.0
    for i in range(STEPS):
        terms, agree, positions = [], 0, 0
        for row in range(b):
            for pos in range(t):
                target = pos + 2 + i  # token this entry predicts
                if target >= t or not loss_mask[row, target]:
                    continue
                policy = policy_logits[row, target - 1]
                positions += 1
                agree += kept[np.argmax(draft[i, row, pos])] == np.argmax(policy)
                if not t2d[np.argmax(policy)]:
                    continue
                p = np.exp(policy[kept] - policy[kept].max())
                p /= p.sum()
                log_q = draft[i, row, pos] - np.log(np.sum(np.exp(draft[i, row, pos])))
                terms.append(-np.sum(p * log_q))
        step_loss = np.mean(terms) if terms else 0.0
        expected_total += 0.8**i * step_loss
        np.testing.assert_allclose(metrics["step_loss"][i], step_loss, rtol=1e-5)
        np.testing.assert_allclose(metrics["counted"][i], len(terms))
        np.testing.assert_allclose(metrics["positions"][i], positions)
        np.testing.assert_allclose(metrics["top1_agreement"][i], agree / positions, rtol=1e-6)
    np.testing.assert_allclose(loss, expected_total, rtol=1e-5)


def test_no_gradient_reaches_the_policy_inputs(policy, head):
    cfg, params = policy
    dcfg, dparams = head
    tokens = jnp.asarray(random_tokens(5, (B, T), cfg.vocab_size))
    logits, aux = forward_jit(cfg, params, tokens, dcfg.aux_layer_ids)
    mask = jnp.ones((B, T), bool)
    grads = jax.jit(
        jax.grad(lambda e, a, l: eagle3_loss(dcfg, dparams, e, a, l, tokens, mask, num_steps=2)[0], argnums=(0, 1, 2))
    )(params["embed"], aux, logits)
    for g in grads:
        assert not np.any(np.asarray(g))


@pytest.fixture(scope="module")
def peaked_policy(policy):
    """The test policy with its LM head scaled by 3: next-token distributions far from uniform, so
    the soft cross-entropy can fall well below its starting value."""
    cfg, params = policy
    return cfg, {**params, "lm_head": params["lm_head"] * 3.0}


@pytest.fixture(scope="module")
def rollouts(peaked_policy):
    """48 training and 16 held-out sequences the policy samples (temperature 1) after random
    4-token prompts: tokens [64, 28], loss on the 24 response tokens."""
    cfg, params = peaked_policy
    prompts = random_tokens(6, (64, 4), cfg.vocab_size).tolist()
    out = generate(cfg, params, prompts, jax.random.key(7), Sampling(temperature=1.0, max_new_tokens=24, eos_id=()))
    tokens = np.concatenate([np.asarray(prompts, np.int32), np.asarray(out.tokens)], axis=1)
    loss_mask = np.zeros(tokens.shape, bool)
    loss_mask[:, 4:] = True
    batch = {"tokens": tokens, "loss_mask": loss_mask, "attn_mask": np.ones(tokens.shape, bool)}
    train = {k: jnp.asarray(v[:48]) for k, v in batch.items()}
    held_out = {k: jnp.asarray(v[48:]) for k, v in batch.items()}
    return train, held_out


def test_training_lowers_the_loss_and_beats_a_random_head(peaked_policy, rollouts):
    """40 AdamW steps on minibatches of 16: the loss falls and held-out top-1 agreement at every
    unrolled position beats the untrained head's."""
    cfg, params = peaked_policy
    train, held_out = rollouts
    counts = np.bincount(np.asarray(train["tokens"]).ravel(), minlength=cfg.vocab_size)
    dcfg, dparams = init_eagle3(cfg, jax.random.key(8), draft_vocab_size=48, token_counts=counts)
    optim, loss = HeadOptimConfig(learning_rate=1e-2, warmup_steps=0, min_lr_ratio=1.0), HeadLossConfig(num_steps=STEPS)
    weights, buffers = split_buffers(dparams)
    _, before = eval_step(cfg, dcfg, loss, dparams, params, held_out)

    opt_state = make_optimizer(optim, 40)[0].init(weights)
    losses = []
    for i in range(40):
        rows = slice(16 * (i % 3), 16 * (i % 3 + 1))
        weights, opt_state, out = train_step(
            cfg, dcfg, optim, 40, loss, weights, opt_state, buffers, params, {k: v[rows] for k, v in train.items()}
        )
        losses.append(float(out["loss"]))
    _, after = eval_step(cfg, dcfg, loss, {**weights, **buffers}, params, held_out)
    before, after = np.asarray(before["top1_agreement"]), np.asarray(after["top1_agreement"])
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses
    assert np.all(after > before + 0.1), (before, after)
    # The agreement is the mapped draft argmax against the policy argmax, both in policy ids.
    assert to_target_ids(dparams, jnp.arange(48)).max() < cfg.vocab_size


def test_packed_sequences_give_the_loss_of_separate_rows(policy, head):
    """Sequences packed into one row (segment ids) score exactly as one sequence per row."""
    cfg, params = policy
    dcfg, dparams = head
    lengths = [9, 6, 7]
    seqs = [np.asarray(random_tokens(10 + i, (1, n), cfg.vocab_size))[0] for i, n in enumerate(lengths)]
    masks = [np.arange(n) >= 3 for n in lengths]  # the first 3 tokens are the prompt
    t = max(lengths)
    tokens = np.zeros((3, t), np.int32)
    loss_mask = np.zeros((3, t), bool)
    for i, (seq, mask) in enumerate(zip(seqs, masks)):
        tokens[i, : len(seq)], loss_mask[i, : len(seq)] = seq, mask
    attn = jnp.asarray(np.arange(t)[None, :] < np.array(lengths)[:, None])
    logits, aux = forward_jit(cfg, params, jnp.asarray(tokens), dcfg.aux_layer_ids, mask=attn)
    separate = loss_jit(
        dcfg, dparams, params["embed"], aux, logits, jnp.asarray(tokens), jnp.asarray(loss_mask), STEPS, 0.8
    )

    width = sum(lengths) + 2  # two padding slots at the end
    packed_tokens = np.zeros((1, width), np.int32)
    packed_mask = np.zeros((1, width), bool)
    segment_ids = np.zeros((1, width), np.int32)
    packed_tokens[0, : sum(lengths)] = np.concatenate(seqs)
    packed_mask[0, : sum(lengths)] = np.concatenate(masks)
    segment_ids[0, : sum(lengths)] = np.repeat([1, 2, 3], lengths)
    logits, aux = jax.jit(forward_hidden, static_argnums=(0, 3))(
        cfg, params, jnp.asarray(packed_tokens), dcfg.aux_layer_ids, segment_ids=jnp.asarray(segment_ids)
    )
    packed = jax.jit(eagle3_loss, static_argnums=(0, 7, 8))(
        dcfg,
        dparams,
        params["embed"],
        aux,
        logits,
        jnp.asarray(packed_tokens),
        jnp.asarray(packed_mask),
        STEPS,
        0.8,
        jnp.asarray(segment_ids),
    )
    np.testing.assert_allclose(packed[0], separate[0], rtol=2e-5)
    for key in ("step_loss", "top1_agreement", "positions", "counted"):
        np.testing.assert_allclose(packed[1][key], separate[1][key], rtol=2e-5, err_msg=key)


def test_the_loss_reads_the_logits_only_through_their_targets(policy, head):
    """eagle3_loss of precomputed `eagle3_targets` equals it of the logits, value, metrics and
    gradient; a target of the wrong shape is named."""
    from jaxspec.draft import Eagle3Targets, eagle3_targets, merge_buffers

    cfg, params = policy
    dcfg, dparams = head
    tokens = jnp.asarray(random_tokens(6, (B, T), cfg.vocab_size))
    logits, aux = forward_jit(cfg, params, tokens, dcfg.aux_layer_ids)
    mask = jnp.ones((B, T), bool).at[:, :3].set(False)
    targets = eagle3_targets(dparams, logits)

    def loss(d, target):
        return eagle3_loss(dcfg, d, params["embed"], aux, target, tokens, mask, num_steps=2)

    (want, want_metrics), (got, got_metrics) = loss(dparams, logits), loss(dparams, targets)
    assert float(got) == float(want) and float(want) > 0
    jax.tree.map(np.testing.assert_array_equal, got_metrics, want_metrics)
    weights, buffers = split_buffers(dparams)
    grads = [jax.grad(lambda w, t=t: loss(merge_buffers(w, buffers), t)[0])(weights) for t in (logits, targets)]
    jax.tree.map(np.testing.assert_array_equal, *grads)
    with pytest.raises(ValueError, match="targets.top has shape"):
        loss(dparams, Eagle3Targets(targets.soft, targets.top[:, :-1]))


def test_remat_recomputes_each_step_to_the_same_loss_and_gradient_in_less_memory():
    """remat=True (each unrolled step checkpointed) gives the loss, metrics and head gradient of
    remat=False, and XLA's plan for the gradient holds fewer temporaries: on a layer whose MLP is
    wide (intermediate 1024 against hidden 32, as an 8B policy's 12288 against 4096) the steps' MLP
    activations are recomputed, not kept (XLA's CPU plan: 39.1 against 43.5 MB)."""
    cfg = ModelConfig(
        family="qwen3",
        vocab_size=61,
        hidden_size=32,
        intermediate_size=1024,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=128,
    )
    params = random_params(cfg, jax.random.key(3))
    dcfg, dparams = random_head(cfg, seed=5)
    weights, buffers = split_buffers(dparams)
    b, t = 4, 96
    tokens = jnp.asarray(random_tokens(9, (b, t), cfg.vocab_size))
    logits, aux = forward_jit(cfg, params, tokens, dcfg.aux_layer_ids)
    mask = jnp.ones((b, t), bool)

    def loss(w, remat):
        return eagle3_loss(dcfg, {**w, **buffers}, params["embed"], aux, logits, tokens, mask, num_steps=4, remat=remat)

    grad = {remat: jax.jit(jax.value_and_grad(lambda w, r=remat: loss(w, r), has_aux=True)) for remat in (False, True)}
    (plain_loss, plain_metrics), plain_grads = grad[False](weights)
    (remat_loss, remat_metrics), remat_grads = grad[True](weights)
    np.testing.assert_allclose(remat_loss, plain_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), remat_metrics, plain_metrics)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), remat_grads, plain_grads)
    temporaries = {
        remat: fn.lower(weights).compile().memory_analysis().temp_size_in_bytes for remat, fn in grad.items()
    }
    assert temporaries[True] < 0.95 * temporaries[False], temporaries
