"""EAGLE-3 training-time test (TTT): the head unrolled on its own outputs, as in drafting.

Policy sequence x_0..x_{T-1}, fused policy features f_t = fc(aux_t). Step 0 pairs f_t with token
x_{t+1} (rope position t) and predicts x_{t+2}. Step i >= 1 keeps the position index t but feeds
token x_{t+1+i} (rope position t + i) with the head's own step i-1 output at t as hidden input,
and predicts x_{t+2+i}. Query t of step i attends to the step-0 keys at positions <= t and to
the keys of steps 1..i at position t: exactly the cache a drafting chain of depth i from context
x_0..x_{t+1} would hold, so TTT logits equal teacher-forced `draft_extend` calls. Those
extra keys are one per step at the query's own position: on GPU `ttt_attention` is flash
attention over all of them under that mask; elsewhere it scores them apart from the causal step-0
keys, so the scores grow by T per step, not by T x T.

Loss of step i: soft cross-entropy of the head against softmax(policy logits at t+1+i restricted
to the draft vocabulary), averaged over positions whose target token x_{t+2+i} has loss_mask on
and whose policy argmax lies in the draft vocabulary; steps are weighted step_decay**i.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.draft.config import DraftConfig
from jaxspec.draft.model import (
    DraftParams,
    attention_inputs,
    check_embed,
    draft_logits,
    fuse,
    layer_output,
    target_ids,
    to_target_ids,
)
from jaxspec.models.attention import use_cudnn_attention
from jaxspec.models.rope import rope_tables
from jaxspec.models.transformer import segment_positions


def ttt_attention(
    q: jax.Array,
    prefix_k: jax.Array,
    prefix_v: jax.Array,
    own_k: jax.Array,
    own_v: jax.Array,
    segment_ids: jax.Array,
    impl: str = "auto",
) -> jax.Array:
    """Attention of one TTT step over the step-0 keys and the query's own later-step keys.

    q [B, T, Nq, D]; prefix_k/v [B, T, Nk, D], the step-0 keys, seen causally (s <= t) within
    the query's segment (segment_ids int32 [B, T]: packed sequences); own_k/v [B, T, S, Nk, D],
    the keys of steps 1..S at each query's own position t (S may be 0). Returns [B, T, Nq, D].
    impl "cudnn": flash attention over the (S + 1) T keys under that mask, no scores kept (GPU);
    "xla": float32 scores [B, Nq, T, T + S], the own keys scored apart from the prefix instead of
    as (S + 1) T keys; "auto": cudnn where `use_cudnn_attention` allows. The backward pass
    recomputes rather than keeping anything per step.
    """
    b, t, nq, d = q.shape
    if use_cudnn_attention(impl, q.dtype, d, t):
        return _flash_ttt_attention(q, prefix_k, prefix_v, own_k, own_v, segment_ids, "cudnn")
    return _factored_ttt_attention(q, prefix_k, prefix_v, own_k, own_v, segment_ids)


@jax.checkpoint
def _factored_ttt_attention(q, prefix_k, prefix_v, own_k, own_v, segment_ids) -> jax.Array:
    """`ttt_attention` with the own keys scored apart from the prefix."""
    b, t, nq, d = q.shape
    nk = prefix_k.shape[2]
    qg = q.reshape(b, t, nk, nq // nk, d)
    scale = d**-0.5
    prefix = jnp.einsum("btkgd,bskd->bkgts", qg, prefix_k, preferred_element_type=jnp.float32) * scale
    prefix = jnp.where(_causal_in_segment(segment_ids)[:, None, None], prefix, jnp.finfo(jnp.float32).min)
    own = jnp.einsum("btkgd,btskd->bkgts", qg, own_k, preferred_element_type=jnp.float32) * scale
    probs = jax.nn.softmax(jnp.concatenate([prefix, own], axis=-1), axis=-1).astype(prefix_v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs[..., :t], prefix_v, preferred_element_type=jnp.float32)
    out += jnp.einsum("bkgts,btskd->btkgd", probs[..., t:], own_v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, nq, d).astype(q.dtype)


@functools.partial(jax.checkpoint, static_argnums=(6,))
def _flash_ttt_attention(q, prefix_k, prefix_v, own_k, own_v, segment_ids, implementation: str) -> jax.Array:
    """`ttt_attention` as one `jax.nn.dot_product_attention` over keys [prefix | step 1 | ... | step S]
    ([B, (S + 1) T, Nk, D]) under the mask: causal within the segment on the prefix, the diagonal
    (the query's own position) on each later step."""
    b, t, s = own_k.shape[:3]
    by_step = lambda x: x.transpose(0, 2, 1, 3, 4).reshape(b, s * t, *x.shape[3:])  # noqa: E731
    keys = jnp.concatenate([prefix_k, by_step(own_k)], axis=1)
    values = jnp.concatenate([prefix_v, by_step(own_v)], axis=1)
    own_position = jnp.broadcast_to(jnp.tile(jnp.eye(t, dtype=bool), (1, s)), (b, t, s * t))
    mask = jnp.concatenate([_causal_in_segment(segment_ids), own_position], axis=-1)
    return jax.nn.dot_product_attention(q, keys, values, mask=mask[:, None], implementation=implementation)


def _causal_in_segment(segment_ids: jax.Array) -> jax.Array:
    """bool [B, T, T]: query t sees key s <= t of its own segment (segment_ids int32 [B, T])."""
    t = segment_ids.shape[1]
    return jnp.tril(jnp.ones((t, t), bool)) & (segment_ids[:, :, None] == segment_ids[:, None, :])


def _shift(x: jax.Array, n: int) -> jax.Array:
    """x[:, n:] right-padded with zeros (False) back to length T along axis 1."""
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, min(n, x.shape[1]))
    return jnp.pad(x[:, n:], pad)


def _ttt_steps(
    dcfg: DraftConfig,
    dparams: DraftParams,
    embed: jax.Array,
    fused: jax.Array,
    tokens: jax.Array,
    num_steps: int,
    segment_ids: jax.Array,
    remat: bool = False,
) -> Iterator[jax.Array]:
    """Yields the layer output [B, T, H] of each unrolled step in turn. remat: each step is
    checkpointed, so the backward pass keeps its inputs (layer input, keys and values) and recomputes
    its activations (the MLP's [B, T, I] among them) instead of holding them for every step."""
    b, t = tokens.shape
    base_positions = segment_positions(segment_ids)

    def step_layer(step, dparams, hidden, prefix, own):
        cos, sin = rope_tables(dcfg.layer_config, base_positions + step)
        q, k, v = attention_inputs(dcfg, dparams, embed, _shift(tokens, 1 + step), hidden, cos, sin)
        prefix_k, prefix_v = prefix if prefix else (k, v)
        own_k = jnp.stack([*own[0], k], axis=2) if prefix else jnp.zeros((b, t, 0) + k.shape[2:], k.dtype)
        own_v = jnp.stack([*own[1], v], axis=2) if prefix else jnp.zeros((b, t, 0) + v.shape[2:], v.dtype)
        attn = ttt_attention(q, prefix_k, prefix_v, own_k, own_v, segment_ids)
        return layer_output(dcfg, dparams, hidden, attn), k, v

    hidden, prefix, own = fused, (), ((), ())
    for step in range(num_steps):
        layer = functools.partial(step_layer, step)
        hidden, k, v = (jax.checkpoint(layer) if remat else layer)(dparams, hidden, prefix, own)
        if prefix:
            own = ((*own[0], k), (*own[1], v))
        else:
            prefix = (k, v)
        yield hidden


def ttt_forward(
    dcfg: DraftConfig, dparams: DraftParams, embed: jax.Array, fused: jax.Array, tokens: jax.Array, num_steps: int
) -> tuple[jax.Array, jax.Array]:
    """The unrolled head: fused features [B, T, H], int32 tokens [B, T] -> (float32 logits
    [num_steps, B, T, Vd], layer outputs [num_steps, B, T, H]); entry [i, b, t] predicts
    x_{t+2+i} (see the module doc). Token inputs past the sequence end are id 0."""
    segment_ids = jnp.ones(tokens.shape, jnp.int32)
    outs = list(_ttt_steps(dcfg, dparams, embed, fused, tokens, num_steps, segment_ids))
    return jnp.stack([draft_logits(dcfg, dparams, out) for out in outs]), jnp.stack(outs)


class Eagle3Targets(NamedTuple):
    """What the loss reads of the policy's logits at each position (position t predicts x_{t+1})."""

    soft: jax.Array  # float32 [B, T, Vd]: softmax of the logits restricted to the draft vocabulary
    top: jax.Array  # int32 [B, T]: the argmax over the whole policy vocabulary


def eagle3_targets(dparams: DraftParams, target_logits: jax.Array) -> Eagle3Targets:
    """`Eagle3Targets` of policy logits [..., V] (any leading shape, any float dtype; no gradient)."""
    logits = jax.lax.stop_gradient(target_logits).astype(jnp.float32)
    return Eagle3Targets(
        soft=jax.nn.softmax(jnp.take(logits, target_ids(dparams), axis=-1), axis=-1),
        top=jnp.argmax(logits, axis=-1).astype(jnp.int32),
    )


def _step_cross_entropy(
    dcfg: DraftConfig,
    dparams: DraftParams,
    hidden: jax.Array,
    soft_target: jax.Array,
    policy_top: jax.Array,
    offset: int,
) -> tuple[jax.Array, jax.Array]:
    """One TTT step's terms at each position t, from its layer output hidden [B, T, H]: the soft
    cross-entropy (float32 [B, T]) of the head's logits at t against soft_target [B, T, Vd] at
    t + offset, and whether the head's argmax is policy_top (int32 [B, T]) at t + offset (bool
    [B, T]); zero / False where t + offset is past the end.

    The layer output moves `offset` positions right instead of the targets left: the moved copy is
    [B, T, H], not float32 [B, T, Vd]. Checkpointed, so the backward pass recomputes the float32
    logits from it and the loss keeps no [B, T, Vd] array of any step.
    """

    def terms(dparams, hidden, soft_target):
        t = hidden.shape[1]
        kept = max(t - offset, 0)
        moved = jnp.pad(hidden[:, :kept], ((0, 0), (t - kept, 0), (0, 0)))  # moved[t'] = hidden[t' - offset]
        logits = draft_logits(dcfg, dparams, moved)
        cross_entropy = -jnp.sum(soft_target * jax.nn.log_softmax(logits, axis=-1), axis=-1)
        top_matches = to_target_ids(dparams, jnp.argmax(logits, axis=-1)) == policy_top
        return _shift(cross_entropy, offset), _shift(top_matches, offset)

    return jax.checkpoint(terms)(dparams, hidden, soft_target)


def eagle3_loss(
    dcfg: DraftConfig,
    dparams: DraftParams,
    embed: jax.Array,
    aux_hidden: jax.Array,
    target_logits: jax.Array | Eagle3Targets,
    tokens: jax.Array,
    loss_mask: jax.Array,
    num_steps: int = 7,
    step_decay: float = 0.8,
    segment_ids: jax.Array | None = None,
    remat: bool = False,
) -> tuple[jax.Array, dict]:
    """TTT loss of the head on one batch of policy sequences.

    embed: the policy's token embedding [V, H]. aux_hidden: [3, B, T, H] policy outputs of layers
    dcfg.aux_layer_ids. target_logits: float [B, T, V] policy logits (position t predicts x_{t+1}),
    or their `eagle3_targets` (which is all the loss reads of them: a caller can build them a chunk
    of positions at a time, never holding [B, T, V]).
    tokens: int32 [B, T]. loss_mask: bool [B, T], whether token j is a prediction target (e.g. a
    response token, not prompt or padding). segment_ids: int32 [B, T] when rows pack several
    sequences (`jaxspec.rl.batch.pack_rows`): the head attends and predicts within a sequence
    only, with rope positions restarting per sequence (default: one sequence per row). remat:
    checkpoint each unrolled step (the backward pass recomputes its activations).
    Policy inputs are detached (no gradient flows back).
    Returns (float32 scalar loss, metrics): "step_loss" [S], "top1_agreement" [S] (draft argmax
    mapped to a policy id == policy argmax, over positions whose target has loss_mask on),
    "positions" [S] (those positions), "counted" [S] (positions in the loss), all float32.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    check_embed(dcfg, embed)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
    b, t = tokens.shape
    given_targets = isinstance(target_logits, Eagle3Targets)
    if given_targets:
        target_shapes = (
            ("targets.soft", target_logits.soft, (b, t, dcfg.draft_vocab_size)),
            ("targets.top", target_logits.top, (b, t)),
        )
    else:
        target_shapes = (("target_logits", target_logits, (b, t, dcfg.vocab_size)),)
    for name, arr, want in (
        ("aux_hidden", aux_hidden, (3, b, t, dcfg.hidden_size)),
        *target_shapes,
        ("loss_mask", loss_mask, (b, t)),
        ("segment_ids", segment_ids, (b, t)),
    ):
        if arr is None:
            continue
        if tuple(arr.shape) != want:
            raise ValueError(f"{name} has shape {tuple(arr.shape)}, expected {want}")
    embed, aux_hidden = map(jax.lax.stop_gradient, (embed, aux_hidden))
    targets = target_logits if given_targets else eagle3_targets(dparams, target_logits)
    soft_target, policy_top = jax.lax.stop_gradient(targets)

    fused = fuse(dcfg, dparams, aux_hidden)
    in_vocab = jnp.take(dparams["t2d"], policy_top)
    loss_mask = loss_mask.astype(bool)
    segment_ids = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)

    step_losses, agreements, positions, counted_sizes = [], [], [], []
    steps = _ttt_steps(dcfg, dparams, embed, fused, tokens, num_steps, segment_ids, remat)
    for step, hidden in enumerate(steps):
        target_on = _shift(loss_mask, 2 + step) & (_shift(segment_ids, 2 + step) == segment_ids)
        counted = (target_on & _shift(in_vocab, 1 + step)).astype(jnp.float32)
        cross_entropy, top_matches = _step_cross_entropy(dcfg, dparams, hidden, soft_target, policy_top, 1 + step)
        n_counted = counted.sum()
        step_losses.append((cross_entropy * counted).sum() / jnp.maximum(n_counted, 1.0))
        n_positions = target_on.sum().astype(jnp.float32)
        agreements.append((top_matches & target_on).sum() / jnp.maximum(n_positions, 1.0))
        positions.append(n_positions)
        counted_sizes.append(n_counted)
    step_loss = jnp.stack(step_losses)
    loss = jnp.sum(step_loss * step_decay ** jnp.arange(num_steps, dtype=jnp.float32))
    metrics = {
        "step_loss": step_loss,
        "top1_agreement": jnp.stack(agreements).astype(jnp.float32),
        "positions": jnp.stack(positions),
        "counted": jnp.stack(counted_sizes),
    }
    return loss, metrics
