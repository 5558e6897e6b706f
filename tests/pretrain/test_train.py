"""The pretraining loss on packed rows (`jaxspec.pretrain.train.response_loss`)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import ModelConfig, forward, forward_router, init_params, load_balancing_loss
from jaxspec.pretrain.data import pack
from jaxspec.pretrain.train import response_loss


def test_packed_loss_equals_per_example_loss_on_response_tokens():
    cfg = ModelConfig(
        family="qwen3",
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=32,
        qk_norm=True,
    )
    rng = np.random.default_rng(0)
    # random values of every param (host RNG: no per-shape compilation of jax.random)
    params = jax.tree.map(
        lambda s: jnp.asarray(rng.normal(0, 0.3, s.shape), jnp.float32),
        jax.eval_shape(lambda key: init_params(cfg, key), jax.random.PRNGKey(0)),
    )
    examples = [(rng.integers(5, 40, n).tolist(), p) for n, p in [(9, 3), (11, 5), (4, 1), (7, 6), (12, 2)]]
    packed = pack(examples, max_len=20, pad_id=0, seed=1)
    assert packed.num_examples == 5 and packed.dropped == 0 and len(packed) >= 3
    loss, count, router_aux = jax.jit(response_loss, static_argnums=0)(
        cfg, params, jnp.asarray(packed.tokens), jnp.asarray(packed.segment_ids), jnp.asarray(packed.weights)
    )
    # reference: one example per row, right-padded (causal attention never sees the padding)
    width = max(len(ids) for ids, _ in examples)
    rows = np.array([ids + [0] * (width - len(ids)) for ids, _ in examples], np.int32)
    logp = np.asarray(jax.nn.log_softmax(jax.jit(forward, static_argnums=0)(cfg, params, jnp.asarray(rows))))
    expected, n = 0.0, 0
    for b, (ids, prompt_len) in enumerate(examples):
        for t in range(prompt_len, len(ids)):  # every response token, predicted from t - 1
            expected -= logp[b, t - 1, ids[t]]
            n += 1
    assert int(count) == n == 6 + 6 + 3 + 1 + 10
    np.testing.assert_allclose(float(loss), expected / n, rtol=1e-5)
    assert float(router_aux) == 0.0  # a dense policy


def test_moe_response_loss_adds_the_weighted_router_loss():
    cfg = ModelConfig(
        family="qwen3_moe",
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        router_aux_loss_coef=0.5,
    )
    rng = np.random.default_rng(1)
    params = jax.tree.map(
        lambda s: jnp.asarray(rng.normal(0, 0.3, s.shape), jnp.float32),
        jax.eval_shape(lambda key: init_params(cfg, key), jax.random.PRNGKey(0)),
    )
    packed = pack([(rng.integers(5, 40, n).tolist(), 2) for n in (9, 6, 12)], max_len=16, pad_id=0, seed=1)
    tokens, segments, weights = map(jnp.asarray, (packed.tokens, packed.segment_ids, packed.weights))
    loss, _, aux = jax.jit(response_loss, static_argnums=0)(cfg, params, tokens, segments, weights)
    plain = dataclasses.replace(cfg, router_aux_loss_coef=0.0)
    ce, _, _ = jax.jit(response_loss, static_argnums=0)(plain, params, tokens, segments, weights)
    _, _, router = forward_router(cfg, params, tokens[:, :-1], mask=segments[:, :-1] > 0, segment_ids=segments[:, :-1])
    assert float(aux) == pytest.approx(float(load_balancing_loss(router, 2, segments[:, :-1] > 0)), rel=1e-6)
    assert float(loss) == pytest.approx(float(ce) + 0.5 * float(aux), rel=1e-6)
