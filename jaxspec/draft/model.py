"""EAGLE-3 draft head: params pytree, initialisation, and the layer computation shared by the
training-time-test loss and the cached drafting path.

Params (H hidden, F intermediate, Nq/Nk heads of D dims, V policy vocabulary, Vd draft vocabulary):

    {"fc": [3H, H],                         # fuses the policy's aux hidden states (no bias)
     "midlayer": {"input_norm": [H],        # on the token embedding   (HF input_layernorm)
                  "hidden_norm": [H],       # on the hidden input
                  "q": [2H, Nq, D], "kv": [2H, 2, Nk, D], "o": [Nq, D, H],  # k, v: kv[:, 0], [:, 1]
                  "mlp_norm": [H],          # (HF post_attention_layernorm)
                  "gate_up": [H, 2, F], "down": [F, H]},  # gate, up: gate_up[:, 0], [:, 1]
     "norm": [H], "lm_head": [H, Vd],
     "d2t": int32 [Vd],                     # buffer: target id of draft id i is i + d2t[i]
     "t2d": bool [V]}                       # buffer: which policy tokens the head can predict

The token embedding is the policy's `params["embed"]` [V, H], passed to every function and never
copied into the head. One step of the layer, for token embeddings e and hidden inputs h [B, T, H]:

    x = cat(input_norm(e), hidden_norm(h))            # [B, T, 2H]
    h' = h + o(attention(q(x), k(x), v(x)))           # residual is the un-normed h
    out = h' + down(silu(gate(n)) * up(n)), n = mlp_norm(h')
    logits = lm_head(norm(out))                       # float32 [B, T, Vd]

`out` (before the final norm) is the next drafting step's hidden input.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.draft.config import DraftConfig
from jaxspec.models.blocks import attn_out_and_mlp, project_qkv, rms_norm
from jaxspec.models.config import ModelConfig
from jaxspec.models.params import pair
from jaxspec.models.projection import project
from jaxspec.models.rope import apply_rope
from jaxspec.models.sharding import Sharding

DraftParams = dict
BUFFERS = ("d2t", "t2d")


def build_vocab_maps(token_counts, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The `draft_vocab_size` most frequent policy tokens as EAGLE-3 maps.

    token_counts: int array [V], occurrences of each policy token in the training data (ties go
    to the lower id). Draft ids follow increasing target id. Returns (d2t int32 [Vd] with
    target_id = draft_id + d2t[draft_id], t2d bool [V]).
    """
    counts = np.asarray(token_counts)
    if counts.ndim != 1:
        raise ValueError(f"token_counts must be a 1-D array over the vocabulary, got shape {counts.shape}")
    if not 0 < draft_vocab_size <= counts.shape[0]:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in [1, vocab_size={counts.shape[0]}]")
    chosen = np.sort(np.argsort(-counts, kind="stable")[:draft_vocab_size])
    t2d = np.zeros(counts.shape[0], bool)
    t2d[chosen] = True
    return (chosen - np.arange(draft_vocab_size)).astype(np.int32), t2d


def init_eagle3(
    cfg: ModelConfig,
    key: jax.Array,
    draft_vocab_size: int | None = None,
    token_counts=None,
    *,
    aux_layer_ids: tuple[int, ...] | None = None,
    dtype=jnp.float32,
    std: float = 0.02,
) -> tuple[DraftConfig, DraftParams]:
    """A random EAGLE-3 head for policy `cfg`.

    draft_vocab_size: default min(V, 32000). token_counts: int [V] policy-token counts of the
    training data; the reduced vocabulary is its `draft_vocab_size` most frequent tokens (default
    without counts: ids 0..Vd-1). Matrices are normal(0, std), norm weights 1.
    """
    dcfg = DraftConfig.for_policy(cfg, draft_vocab_size, aux_layer_ids)
    if token_counts is None:
        token_counts = np.zeros(dcfg.vocab_size, np.int64)  # ties -> the first Vd ids
    elif np.shape(token_counts) != (dcfg.vocab_size,):
        raise ValueError(
            f"token_counts has shape {np.shape(token_counts)}, expected the policy vocabulary ({dcfg.vocab_size},)"
        )
    d2t, t2d = build_vocab_maps(token_counts, dcfg.draft_vocab_size)
    weights = _random_weights(dcfg, key, jnp.dtype(dtype), float(std))
    return dcfg, merge_buffers(weights, {"d2t": jnp.asarray(d2t), "t2d": jnp.asarray(t2d)})


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def _random_weights(dcfg: DraftConfig, key: jax.Array, dtype, std: float) -> DraftParams:
    """The float leaves of a head: matrices normal(0, std), norm weights 1. All matrices are cut
    from one normal draw (one small program to compile)."""
    h, f, d, nq, nk = dcfg.hidden_size, dcfg.intermediate_size, dcfg.head_dim, dcfg.num_heads, dcfg.num_kv_heads
    shapes = {
        "fc": (3 * h, h),
        "q": (2 * h, nq, d),
        "k": (2 * h, nk, d),
        "v": (2 * h, nk, d),
        "o": (nq, d, h),
        "gate": (h, f),
        "up": (h, f),
        "down": (f, h),
        "lm_head": (h, dcfg.draft_vocab_size),
    }
    sizes = [math.prod(shape) for shape in shapes.values()]
    flat = std * jax.random.normal(key, (sum(sizes),), jnp.float32)
    offsets = np.cumsum([0] + sizes)
    m = {
        name: flat[offsets[i] : offsets[i + 1]].reshape(shape).astype(dtype)
        for i, (name, shape) in enumerate(shapes.items())
    }
    ones = jnp.ones((h,), dtype)
    midlayer = {
        "input_norm": ones,
        "hidden_norm": ones,
        "mlp_norm": ones,
        **{name: m[name] for name in ("q", "o", "down")},
        "kv": pair(m["k"], m["v"]),
        "gate_up": pair(m["gate"], m["up"]),
    }
    return {"fc": m["fc"], "midlayer": midlayer, "norm": ones, "lm_head": m["lm_head"]}


def split_buffers(dparams: DraftParams) -> tuple[DraftParams, DraftParams]:
    """(trainable weights, {"d2t", "t2d"}): the integer/bool buffers take no gradient."""
    weights = {k: v for k, v in dparams.items() if k not in BUFFERS}
    return weights, {k: dparams[k] for k in BUFFERS}


def merge_buffers(weights: DraftParams, buffers: DraftParams) -> DraftParams:
    return {**weights, **buffers}


def target_ids(dparams: DraftParams) -> jax.Array:
    """int32 [Vd]: the policy token id of every draft id."""
    d2t = dparams["d2t"]
    return jnp.arange(d2t.shape[0], dtype=jnp.int32) + d2t.astype(jnp.int32)


def to_target_ids(dparams: DraftParams, draft_ids: jax.Array) -> jax.Array:
    """Maps draft-vocabulary ids (any shape, int) to policy token ids (int32, same shape)."""
    draft_ids = draft_ids.astype(jnp.int32)
    return draft_ids + jnp.take(dparams["d2t"], draft_ids).astype(jnp.int32)


def check_embed(dcfg: DraftConfig, embed: jax.Array) -> None:
    """The policy embedding must be [V, H] of the head's target (ValueError naming the dimension)."""
    if embed.ndim != 2:
        raise ValueError(f"embed must be the policy's [vocab_size, hidden_size] embedding, got shape {embed.shape}")
    if embed.shape[1] != dcfg.hidden_size:
        raise ValueError(
            f"hidden_size: the draft head has {dcfg.hidden_size}, the policy embedding has {embed.shape[1]}"
        )
    if embed.shape[0] != dcfg.vocab_size:
        raise ValueError(
            f"vocab_size: the draft head targets a vocabulary of {dcfg.vocab_size}, the policy "
            f"embedding has {embed.shape[0]}"
        )


def fuse(dcfg: DraftConfig, dparams: DraftParams, aux: jax.Array) -> jax.Array:
    """fc of the policy's aux hidden states: aux [3, B, T, H] (layers low, mid, high) -> [B, T, H]
    in the head's dtype."""
    return fuse_stacked(dparams, stack_aux(dcfg, dparams, aux))


def fuse_stacked(
    dparams: DraftParams, stacked: jax.Array, *, impl: str = "xla", sharding: Sharding | None = None
) -> jax.Array:
    """fc of `stack_aux`'s [B, T, 3H] -> [B, T, H] in the head's dtype; impl, sharding:
    `jaxspec.models.projection.project`'s (a rollout's drafting step passes "auto")."""
    return project("btc,ch->bth", stacked, dparams["fc"], impl=impl, sharding=sharding)


def stack_aux(dcfg: DraftConfig, dparams: DraftParams, aux: jax.Array) -> jax.Array:
    """The policy's aux hidden states aux [3, B, T, H] side by side, [B, T, 3H] in the head's
    dtype: what `fuse_stacked` takes (an adaptive rollout queues them and runs the fc later)."""
    if dcfg.aux_layer_ids is None:
        raise ValueError(
            "the EAGLE-3 head names no policy layers (its config.json has no "
            "eagle_aux_hidden_state_layer_ids): resolve them for the policy with "
            "dcfg.for_layers_of(policy_cfg) or load_eagle3(path, policy=policy_cfg)"
        )
    if aux.ndim != 4 or aux.shape[0] != 3 or aux.shape[-1] != dcfg.hidden_size:
        raise ValueError(
            f"aux must be [3, B, T, hidden_size={dcfg.hidden_size}] (the policy's outputs of "
            f"layers {list(dcfg.aux_layer_ids)}), got shape {aux.shape}"
        )
    return jnp.concatenate([aux[0], aux[1], aux[2]], axis=-1).astype(dparams["fc"].dtype)


def layer_input(
    dcfg: DraftConfig, dparams: DraftParams, embed: jax.Array, tokens: jax.Array, hidden: jax.Array
) -> jax.Array:
    """The layer's input x = cat(input_norm(e), hidden_norm(h)) [B, T, 2H] for int32 tokens [B, T]
    (their embeddings e) and hidden inputs h [B, T, H]. XLA's RMS norms: on a GPU both norms and
    the concatenation are one fusion (a norm kernel each would be two launches and the concatenation a third)."""
    layer = dparams["midlayer"]
    dtype = dparams["fc"].dtype
    emb = jax.lax.stop_gradient(jnp.take(embed, tokens, axis=0)).astype(dtype)
    eps = dcfg.rms_norm_eps
    return jnp.concatenate(
        [rms_norm(emb, layer["input_norm"], eps), rms_norm(hidden.astype(dtype), layer["hidden_norm"], eps)], axis=-1
    )


def attention_inputs(
    dcfg: DraftConfig,
    dparams: DraftParams,
    embed: jax.Array,
    tokens: jax.Array,
    hidden: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
):
    """Rotated q [B, T, Nq, D] and k, unrotated v [B, T, Nk, D] of the layer for int32 tokens
    [B, T] and hidden inputs [B, T, H]; cos/sin from `rope_tables(dcfg.layer_config, positions)`."""
    q, k, v = project_qkv(layer_input(dcfg, dparams, embed, tokens, hidden), dparams["midlayer"])
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def layer_output(dcfg: DraftConfig, dparams: DraftParams, hidden: jax.Array, attn: jax.Array) -> jax.Array:
    """Residual h + o(attn), then the SwiGLU MLP block: the layer output [B, T, H] before the
    final norm (the next drafting step's hidden input)."""
    return attn_out_and_mlp(dcfg.layer_config, dparams["midlayer"], hidden.astype(attn.dtype), attn)[0]


def draft_logits(dcfg: DraftConfig, dparams: DraftParams, out: jax.Array) -> jax.Array:
    """Final norm and lm_head: layer output [B, T, H] -> float32 logits over the draft vocabulary."""
    return head_logits(dparams, rms_norm(out, dparams["norm"], dcfg.rms_norm_eps))


def head_logits(
    dparams: DraftParams, normed: jax.Array, *, impl: str = "xla", sharding: Sharding | None = None
) -> jax.Array:
    """The lm_head on the final norm's output [B, T, H] -> float32 logits [B, T, Vd]; impl,
    sharding: `jaxspec.models.projection.project`'s."""
    with jax.named_scope("lm_head"):
        head = dparams["lm_head"]
        return project("bth,hv->btv", normed, head, impl=impl, preferred_element_type=jnp.float32, sharding=sharding)
