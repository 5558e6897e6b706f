"""The decoder's building blocks, shared by the full-sequence forward and `extend`
(`jaxspec.models.transformer`) and the EAGLE-3 head: RMSNorm, a layer's attention input (q/k/v with
rope) and its attention output and MLP, the embedding lookup and the LM head.

Norms and logits are float32 whatever the parameter dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.models.config import ModelConfig
from jaxspec.models.moe import moe_mlp
from jaxspec.models.params import Params
from jaxspec.models.projection import project, swiglu
from jaxspec.models.rope import apply_rope
from jaxspec.models.sharding import Sharding


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, cast back to x.dtype before the weight (as transformers does)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def qkv(
    cfg: ModelConfig, layer: Params, h: jax.Array, cos, sin, *, impl: str = "xla", sharding: Sharding | None = None
):
    """A layer's attention input from its normed input h [B, T, H] (the attention norm applied) ->
    (q [B, T, Nq, D], k [B, T, Nk, D], v [B, T, Nk, D]): the projections (with their biases, and
    q/k norms where the family has them), q and k rotated by the rope tables cos/sin of their
    positions. impl, sharding: the projections' (`jaxspec.models.projection.project`)."""
    q, k, v = project_qkv(h, layer, impl=impl, sharding=sharding)
    if cfg.qk_norm:
        q = rms_norm(q, layer["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, layer["k_norm"], cfg.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def project_qkv(
    x: jax.Array, layer: Params, *, impl: str = "xla", sharding: Sharding | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [B, T, Nq, D], k and v [B, T, Nk, D] of the attention input x [B, T, C], with the layer's
    biases where it has them: two GEMMs over the layer's q [C, Nq, D] and kv [C, 2, Nk, D]
    (`jaxspec.models.params.PAIRED`), or one over its fused qkv [C, Nk, G + 2, D]
    (`jaxspec.models.params.fuse_qkv`); impl, sharding: `jaxspec.models.projection.project`'s."""
    if "qkv" in layer:
        out = project("btc,cngd->btngd", x, layer["qkv"], impl=impl, sharding=sharding)  # [B, T, Nk, G + 2, D]
        if "qkv_bias" in layer:
            out = out + layer["qkv_bias"]
        b, t, nk, width, d = out.shape
        group = width - 2
        return out[:, :, :, :group].reshape(b, t, nk * group, d), out[:, :, :, group], out[:, :, :, group + 1]
    q = project("btc,cnd->btnd", x, layer["q"], impl=impl, sharding=sharding)
    both = project("btc,cknd->btknd", x, layer["kv"], impl=impl, sharding=sharding)
    q, k, v = q, both[:, :, 0], both[:, :, 1]
    if "q_bias" in layer:
        q, k, v = q + layer["q_bias"], k + layer["k_bias"], v + layer["v_bias"]
    return q, k, v


def attn_out_and_mlp(
    cfg: ModelConfig,
    layer: Params,
    x: jax.Array,
    attn: jax.Array,
    moe_impl: str = "ragged_dot",
    sharding: Sharding | None = None,
    experts: jax.Array | None = None,
):
    """Attention output projection and the MLP, both residual -> (x [B, T, H], router logits
    [B, T, E] float32 and the experts each token ran on int32 [B, T, k], both None for a dense
    layer); moe_impl, sharding, experts: a sparse layer's grouped matmuls, the mesh and the
    replayed experts [B, T, k] or None (`moe.moe_mlp`)."""
    x = x + attention_output(layer, attn)
    out, router_logits, experts = mlp(
        cfg, layer, rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps), moe_impl, sharding, experts
    )
    return x + out, router_logits, experts


def attention_output(
    layer: Params, attn: jax.Array, *, impl: str = "xla", sharding: Sharding | None = None
) -> jax.Array:
    """The output projection of attention [B, T, Nq, D] -> [B, T, H] (before the residual add);
    impl, sharding: `jaxspec.models.projection.project`'s."""
    return project("btnd,ndh->bth", attn, layer["o"], impl=impl, sharding=sharding)


def mlp(
    cfg: ModelConfig,
    layer: Params,
    h: jax.Array,
    moe_impl: str = "ragged_dot",
    sharding: Sharding | None = None,
    experts: jax.Array | None = None,
    matmul_impl: str = "xla",
):
    """A layer's MLP on its normed input h [B, T, H] (before the residual add) -> (out [B, T, H],
    router logits [B, T, E] float32, experts [B, T, k] int32; both None for a dense layer), as
    `attn_out_and_mlp`; matmul_impl: a dense layer's projections' (`dense_mlp`), a sparse layer's
    expert kernel for decode-sized calls (`moe.expert_kernel_impl`)."""
    if "router" in layer:
        return moe_mlp(layer, h, cfg.num_experts_per_tok, cfg.norm_topk_prob, moe_impl, sharding, experts, matmul_impl)
    return dense_mlp(layer, h, impl=matmul_impl, sharding=sharding), None, None


def dense_mlp(layer: Params, h: jax.Array, *, impl: str = "xla", sharding: Sharding | None = None) -> jax.Array:
    """A dense layer's MLP on its normed input h [..., H] -> [..., H]: down(silu(gate h) * up h),
    gate and up in one GEMM over gate_up [H, 2, F] (`jaxspec.models.params`); impl, sharding:
    `jaxspec.models.projection`'s."""
    act = swiglu(h, layer["gate_up"], impl=impl, sharding=sharding)
    return project("...f,fh->...h", act, layer["down"], impl=impl, sharding=sharding)


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """int32 tokens [B, T] -> their embedding rows [B, T, H] in the params' dtype."""
    return jnp.take(params["embed"], tokens, axis=0)


def head_params(params: Params, dtype) -> Params:
    """The params `logits_from_hidden` reads (final_norm, lm_head, embed: the head when tied), cast
    to `dtype` (the forward's compute dtype; gradients reach the float32 master)."""
    return {k: params[k].astype(dtype) for k in ("final_norm", "embed", "lm_head") if k in params}


def logits_from_hidden(cfg: ModelConfig, params: Params, x: jax.Array) -> jax.Array:
    """Final norm and LM head: x [B, T, H] -> float32 logits [B, T, V]."""
    return logits_from_normed(cfg, params, rms_norm(x, params["final_norm"], cfg.rms_norm_eps))


def logits_from_normed(
    cfg: ModelConfig, params: Params, h: jax.Array, *, impl: str = "xla", sharding: Sharding | None = None
) -> jax.Array:
    """The LM head on the final norm's output: h [B, T, H] -> float32 logits [B, T, V]; impl,
    sharding: `jaxspec.models.projection.project`'s."""
    with jax.named_scope("lm_head"):
        tied = cfg.tie_word_embeddings
        head = params["embed"] if tied else params["lm_head"]
        return project(
            "bth,hv->btv", h, head, impl=impl, transpose=tied, preferred_element_type=jnp.float32, sharding=sharding
        )
