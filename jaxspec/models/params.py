"""The policy's parameters: a plain pytree, and random ones of a config's shape.

    {"embed": [V, H],
     "layers": [ {"attn_norm": [H], "q": [H, Nq, D], "kv": [H, 2, Nk, D],
                  "o": [Nq, D, H], ("q_bias": [Nq, D], "k_bias"/"v_bias": [Nk, D]),
                  ("q_norm": [D], "k_norm": [D]), "mlp_norm": [H],
                  "gate_up": [H, 2, F], "down": [F, H]}, ... L ],
     "final_norm": [H],
     ("lm_head": [H, V])}            # absent when embeddings are tied

A sparse (mixture-of-experts) layer holds "router" and stacked "experts_gate"/"experts_up"/
"experts_down" (`jaxspec.models.moe`) instead of "gate_up"/"down".

Two projections of one input that a mesh splits alike are one leaf (`PAIRED`): a dense MLP's gate
and up, gate_up[:, 0] and gate_up[:, 1], split along F, and attention's k and v, kv[:, 0] and
kv[:, 1], split over the KV heads. A step multiplies by both in one GEMM (a decode or verification
step reads the pair's weights in one kernel). q stays a leaf of its own: a tensor-parallel mesh
splits the query heads where it cannot split fewer KV heads. A rollout, which only reads the
weights, multiplies by all three in one GEMM where the mesh splits them alike (`fuse_qkv`; their
biases, where the family has them, become one leaf too).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.models.config import ModelConfig

Params = dict
PAIR_AXIS = 1  # a paired leaf's axis of its two projections
PAIRED = {"gate_up": ("gate", "up"), "kv": ("k", "v")}  # paired leaf -> the projections at index 0 and 1
FUSED_QKV = ("q", "kv", "q_bias", "k_bias", "v_bias")  # an attention layer's leaves `fuse_qkv` makes one


def pair(first: jax.Array, second: jax.Array) -> jax.Array:
    """Two projections [C, ...] of one input -> their paired leaf [C, 2, ...]."""
    return jnp.stack([first, second], axis=PAIR_AXIS)


def fuse_qkv(params: Params) -> Params:
    """`params` with every attention layer's q [C, Nq, D] and kv [C, 2, Nk, D] as one leaf
    "qkv" [C, Nk, Nq / Nk + 2, D]: the query heads of kv head j (j * G .. j * G + G - 1, G = Nq /
    Nk, the heads that attend with it), then its k, then its v, so that a decode step reads all
    three in one GEMM (`jaxspec.models.blocks.project_qkv`) and a mesh that splits the KV heads
    splits it alike. A layer's biases q_bias [Nq, D], k_bias and v_bias [Nk, D] become "qkv_bias"
    [Nk, G + 2, D] in the same order. Layers without q (or already fused) and every other leaf are
    kept as they are (the same arrays). Works on a policy's params and on an EAGLE-3 head's (its
    "midlayer")."""
    if isinstance(params, dict):
        if "q" in params and "kv" in params:
            layer = {k: v for k, v in params.items() if k not in FUSED_QKV}
            q, kv = params["q"], params["kv"]
            nk = kv.shape[2]
            grouped = q.reshape(q.shape[0], nk, q.shape[1] // nk, q.shape[2])
            layer["qkv"] = jnp.concatenate([grouped, jnp.moveaxis(kv, PAIR_AXIS, 2)], axis=2)
            if "q_bias" in params:
                q_bias = params["q_bias"].reshape(nk, -1, q.shape[2])
                layer["qkv_bias"] = jnp.concatenate([q_bias, params["k_bias"][:, None], params["v_bias"][:, None]], 1)
            return layer
        return {k: fuse_qkv(v) for k, v in params.items()}
    if isinstance(params, (list, tuple)):
        return type(params)(fuse_qkv(v) for v in params)
    return params


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
            "kv": pair(normal((h, nk, d)), normal((h, nk, d))),
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
            layer |= {"gate_up": pair(gate, up), "down": normal((f, h))}
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
