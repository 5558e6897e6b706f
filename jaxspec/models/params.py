"""The policy's parameters: a plain pytree, and random ones of a config's shape.

    {"embed": [V, H],
     "layers": [ {"attn_norm": [H], "q": [H, Nq, D], "k": [H, Nk, D], "v": [H, Nk, D],
                  "o": [Nq, D, H], ("q_bias": [Nq, D], "k_bias"/"v_bias": [Nk, D]),
                  ("q_norm": [D], "k_norm": [D]), "mlp_norm": [H],
                  "gate_up": [H, 2, F], "down": [F, H]}, ... L ],
     "final_norm": [H],
     ("lm_head": [H, V])}            # absent when embeddings are tied

A sparse (mixture-of-experts) layer holds "router" and stacked "experts_gate"/"experts_up"/
"experts_down" (`jaxspec.models.moe`) instead of "gate_up"/"down".

A dense MLP's gate and up projections are one leaf, gate_up[:, 0] and gate_up[:, 1] (`GATE_UP_AXIS`),
so that a step multiplies by both in one GEMM over [H, 2F] (a decode or verification step reads the
weights once, in one kernel) and a mesh splits both along F alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.models.config import ModelConfig

Params = dict
GATE_UP_AXIS = 1  # gate_up's axis of the two projections: gate_up[:, 0] is gate, [:, 1] is up


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> Params:
    """Random params (normal(0, std) matrices, unit norms, zero biases)."""
    h, f, d, nq, nk = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    keys = iter(jax.random.split(key, 2 + 8 * cfg.num_layers))

    def normal(shape):
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    layers = []
    for i in range(cfg.num_layers):
        layer = {
            "attn_norm": jnp.ones((h,), dtype),
            "q": normal((h, nq, d)),
            "k": normal((h, nk, d)),
            "v": normal((h, nk, d)),
            "o": normal((nq, d, h)),
            "mlp_norm": jnp.ones((h,), dtype),
        }
        if cfg.is_sparse_layer(i):
            e, fe = cfg.num_experts, cfg.moe_intermediate_size
            layer |= {
                "router": normal((h, e)),
                "experts_gate": normal((e, h, fe)),
                "experts_up": normal((e, h, fe)),
                "experts_down": normal((e, fe, h)),
            }
        else:
            gate, up = normal((h, f)), normal((h, f))
            layer |= {"gate_up": jnp.stack([gate, up], axis=GATE_UP_AXIS), "down": normal((f, h))}
        if cfg.attention_bias:
            layer |= {
                "q_bias": jnp.zeros((nq, d), dtype),
                "k_bias": jnp.zeros((nk, d), dtype),
                "v_bias": jnp.zeros((nk, d), dtype),
            }
        if cfg.qk_norm:
            layer |= {"q_norm": jnp.ones((d,), dtype), "k_norm": jnp.ones((d,), dtype)}
        layers.append(layer)
    params = {"embed": normal((cfg.vocab_size, h)), "layers": layers, "final_norm": jnp.ones((h,), dtype)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = normal((h, cfg.vocab_size))
    return params
