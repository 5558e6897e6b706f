"""Trainer-side log-probabilities of rollout tokens and the GRPO / DAPO / Dr.GRPO policy loss.

Shapes: S rollouts, packed into R rows of width W (`jaxspec.rl.batch.pack_rows`), N =
max_new_tokens, V = vocabulary. Response token j of rollout s is predicted by the hidden state (and
logits) at flat position resp_index[s, j] of the packed [R * W] positions.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.draft import DraftParams, Eagle3Targets, eagle3_targets
from jaxspec.models.blocks import head_params, logits_from_hidden
from jaxspec.models.config import ModelConfig
from jaxspec.models.params import Params
from jaxspec.models.sharding import Sharding, constrain
from jaxspec.models.transformer import forward_router
from jaxspec.rl.config import AGGREGATIONS, GRPOLossConfig
from jaxspec.rollout.sampling import Sampling, processed_logprobs

LOGPROB_CHUNK = 1024  # response positions per chunk of the log-prob head: float32 logits [1024, V]


def sequence_forward(
    cfg: ModelConfig,
    params: Params,
    tokens: jax.Array,
    segment_ids: jax.Array,
    hidden_layers: tuple[int, ...] = (),
    compute_dtype=jnp.float32,
    remat: bool = False,
    sharding: Sharding | None = None,
    head: bool = True,
    experts: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One policy forward over packed prompt+response rows.

    tokens int32 [R, W]; segment_ids int32 [R, W] (each sequence attends within itself; rope
    positions restart per sequence). The forward computes in `compute_dtype`, each layer's weights
    cast inside its layer function (`forward_router`; gradients reach the float32 master). Returns
    (float32 logits [R, W, V], hidden [len(hidden_layers), R, W, H]: outputs of the given 0-based
    layers, float32 router logits [len(cfg.sparse_layers), R, W, E] of a mixture-of-experts
    policy, [0, R, W, 0] for a dense one). head=False returns the last
    layer's output [R, W, H] in `compute_dtype` (before the final norm) in place of the logits: the
    input of `response_logprobs`. With a `sharding`, every layer's activations are split over the
    batch axes (rows), whatever the params' layout: without the constraint the rows of an
    fsdp-sharded embedding table come out split along the hidden dimension, a layout cuDNN's flash
    attention cannot partition. A mixture-of-experts policy's experts run as `moe_impl="auto"`
    picks (the grouped-matmul kernels on a GPU for large calls, forward and backward). experts:
    None, or integer [R, W, L_sparse, k] experts to replay (routing replay, `jaxspec.rl.routing`).
    """
    return forward_router(
        cfg,
        params,
        tokens,
        hidden_layers,
        segment_ids=segment_ids,
        remat=remat,
        sharding=sharding,
        head=head,
        moe_impl="auto",
        compute_dtype=compute_dtype,
        experts=experts,
    )


def router_aux_weight(loss: GRPOLossConfig, model: ModelConfig) -> float:
    """The weight of the router's load-balancing loss in the policy loss: loss.router_aux_coef, or
    the policy's router_aux_loss_coef when that is null (0 for a dense policy). ValueError naming
    the key for a non-zero weight on a dense policy (it has no router)."""
    if not model.sparse_layers:
        if loss.router_aux_coef:
            raise ValueError(
                f"loss.router_aux_coef: the policy is dense (no mixture-of-experts layers, no router); "
                f"set it to null or 0, got {loss.router_aux_coef}"
            )
        return 0.0
    return model.router_aux_loss_coef if loss.router_aux_coef is None else loss.router_aux_coef


def response_logprobs(
    cfg: ModelConfig,
    params: Params,
    hidden: jax.Array,
    resp_index: jax.Array,
    resp_tokens: jax.Array,
    sampling: Sampling,
    *,
    chunk_size: int = LOGPROB_CHUNK,
    sharding: Sharding | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Log-probability of each response token under the processed distribution p, from the final
    hidden states, chunk by chunk: no [R, W, V] or [S, N, V] float32 tensor exists.

    hidden [R, W, H]: the last layer's output before the final norm (`sequence_forward(...,
    head=False)`), in the forward's compute dtype; params: the policy's params, of which the final
    norm and the LM head (or the tied embedding) are read, cast to hidden's dtype as the forward
    casts them (in each chunk: their gradient sums over the chunks in the params' own dtype).
    resp_index int32 [S, N] (flat position in [R * W] of the hidden state predicting response token
    j); resp_tokens int32 [S, N]. The S * N gathered rows are cut into chunks of `chunk_size`
    positions (the last one zero-padded and dropped); each chunk's float32 logits [chunk_size, V]
    (`logits_from_hidden`), p = `processed_logprobs(logits, sampling)` (the distribution the rollout
    sampled from: temperature, top-k, top-p), log p of the chosen token and the entropy of p are
    computed under `jax.checkpoint`, so the backward pass recomputes a chunk's logits instead of
    keeping them. sharding: the run's mesh (each chunk's positions split over its batch axes), None
    on one device.
    Returns (float32 log p [S, N], float32 entropy of p [S, N], not differentiated).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of positions, got {chunk_size}")
    s, n = resp_index.shape
    positions = s * n
    chunk = min(chunk_size, positions)
    chunks = -(-positions // chunk)
    pad = chunks * chunk - positions
    rows = jnp.take(hidden.reshape(-1, hidden.shape[-1]), resp_index.reshape(-1), axis=0)  # [S * N, H]
    rows = jnp.pad(rows, ((0, pad), (0, 0))).reshape(chunks, chunk, rows.shape[-1])
    tokens = jnp.pad(resp_tokens.reshape(-1), (0, pad)).reshape(chunks, chunk)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def chunk_logprobs(args):
        x, token = args  # [C, H], [C]
        x = constrain(sharding, x, ("batch", "act_embed"))
        # Cast per chunk: the head's gradient sums over the chunks in the params' dtype (the float32
        # master), not in the compute dtype.
        head = head_params(params, x.dtype)
        logits = constrain(sharding, logits_from_hidden(cfg, head, x[None])[0], ("batch", "vocab"))
        logp_all = processed_logprobs(logits, sampling)  # [C, V]
        logp = jnp.take_along_axis(logp_all, token[:, None], axis=1)[:, 0]
        logp_all = jax.lax.stop_gradient(logp_all)
        entropy = -jnp.sum(jnp.where(jnp.isfinite(logp_all), jnp.exp(logp_all) * logp_all, 0.0), axis=-1)
        return logp, entropy

    logp, entropy = jax.lax.map(chunk_logprobs, (rows, tokens))
    return logp.reshape(-1)[:positions].reshape(s, n), entropy.reshape(-1)[:positions].reshape(s, n)


def draft_targets(
    cfg: ModelConfig,
    params: Params,
    hidden: jax.Array,
    dparams: DraftParams,
    *,
    chunk_size: int = LOGPROB_CHUNK,
    sharding: Sharding | None = None,
) -> Eagle3Targets:
    """The online EAGLE-3 loss's `Eagle3Targets` (soft [R, W, Vd], top [R, W]) from the policy's
    final hidden states [R, W, H] (as `response_logprobs` reads them), about `chunk_size` positions
    at a time: the rows' next chunk_size // R columns, so a chunk keeps the rows' split over the
    mesh. A chunk's float32 logits [R, C, V] exist only inside its step, never the [R, W, V] logits
    of every packed position (5.6 GB for 8 rollouts x 1152 tokens of Qwen3-8B); the targets are
    written in place into their [R, W, ...] buffers. No gradient."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of positions, got {chunk_size}")
    params, hidden = jax.lax.stop_gradient((params, hidden))
    r, w, _ = hidden.shape
    cols = min(w, max(1, chunk_size // r))
    chunks = -(-w // cols)
    hidden = jnp.pad(hidden, ((0, 0), (0, chunks * cols - w), (0, 0)))
    head = head_params(params, hidden.dtype)
    vd = dparams["d2t"].shape[0]
    layout = ("batch", "seq", "vocab")

    def chunk_targets(i, out):
        x = jax.lax.dynamic_slice_in_dim(hidden, i * cols, cols, axis=1)
        x = constrain(sharding, x, ("batch", "seq", "act_embed"))
        logits = constrain(sharding, logits_from_hidden(cfg, head, x), layout)  # [R, C, V]
        soft, top = eagle3_targets(dparams, logits)
        return Eagle3Targets(
            jax.lax.dynamic_update_slice_in_dim(out.soft, soft, i * cols, axis=1),
            jax.lax.dynamic_update_slice_in_dim(out.top, top, i * cols, axis=1),
        )

    empty = Eagle3Targets(
        constrain(sharding, jnp.zeros((r, chunks * cols, vd), jnp.float32), layout),
        jnp.zeros((r, chunks * cols), jnp.int32),
    )
    soft, top = jax.lax.fori_loop(0, chunks, chunk_targets, empty)
    return Eagle3Targets(soft=soft[:, :w], top=top[:, :w])


def reference_sampling(sampling: Sampling) -> Sampling:
    """`sampling` without top-k / top-p: the temperature-only distribution the KL penalty compares
    (as verl does), whose log-prob is finite on every token whatever the rollout sampled."""
    return dataclasses.replace(sampling, top_p=1.0, top_k=0)


def aggregate(
    per_token: jax.Array, mask: jax.Array, aggregation: str, denominator: jax.Array | None = None
) -> jax.Array:
    """Reduces [B, N] token values over the tokens where mask [B, N] is set.

    "token" (DAPO; verl's token-mean): sum over all tokens / number of tokens.
    "sequence" (original GRPO; verl's seq-mean-token-mean): mean over the rows that have any
        token of each row's token mean.
    "seq-mean-token-sum-norm" (Dr.GRPO): each row's token sum / N (the constant max_new_tokens),
        mean over the rows that have any token.
    denominator: when given, replaces the count the mean divides by (tokens for "token", rows with
    tokens for the other two); `loss_denominator` gives the whole RL step's count per minibatch,
    which may be below 1 (a step of 2 tokens over 4 minibatches: 0.5) and is used as it is.
    0 when no token is set.
    """
    mask = mask.astype(jnp.float32)
    masked = jnp.where(mask > 0, per_token, 0.0)
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if aggregation == "token":
        numerator, count = masked.sum(), mask.sum()
    else:
        counts = mask.sum(axis=1)
        rows = (counts > 0).astype(jnp.float32)
        if aggregation == "sequence":
            row_values = masked.sum(axis=1) / jnp.maximum(counts, 1.0)
        else:
            row_values = masked.sum(axis=1) / per_token.shape[1]
        numerator, count = (row_values * rows).sum(), rows.sum()
    if denominator is None:
        return numerator / jnp.maximum(count, 1.0)
    return numerator / jnp.where(denominator > 0, denominator, 1.0)


def loss_denominator(loss_mask: np.ndarray, aggregation: str, minibatches: int) -> float:
    """The count `aggregate` divides one minibatch's loss by so that the RL step's loss is normalised
    over the whole step: the step's tokens (or rows with tokens) / minibatches. loss_mask bool [S, N]
    of the whole step. With one minibatch this is the minibatch's own count."""
    loss_mask = np.asarray(loss_mask, bool)
    count = loss_mask.sum() if aggregation == "token" else loss_mask.any(axis=1).sum()
    return float(count) / minibatches


def finite_tokens(mask, *logps):
    """bool [B, N]: mask [B, N] and every given log-prob [B, N] finite (None entries are skipped).
    numpy in, numpy out (the host's step-level count); jax arrays in a traced loss."""
    xp = np if all(isinstance(x, np.ndarray) for x in (mask, *logps) if x is not None) else jnp
    mask = mask > 0
    for logp in logps:
        if logp is not None:
            mask = mask & xp.isfinite(logp)
    return mask


LOG_RATIO_CLAMP = 20.0  # nats: exp of a float32 log-ratio past ~88 is inf, and its gradient nan (verl's clamp)
KL_CLAMP = 10.0  # the k3 estimate's range per token (verl's low_var_kl)


def behaviour_weights(
    prox_logp: jax.Array, behaviour_logp: jax.Array, cap: float | None
) -> tuple[jax.Array, jax.Array]:
    """The decoupled objective's per-token weight pi_prox / pi_behaviour (not differentiated) and
    whether the cap truncated it: float32 [B, N] log-probs (finite where used) -> (min(exp(prox -
    behaviour), cap) float32 [B, N], capped bool [B, N]). cap None: no truncation. The log-ratio is
    clamped to +-LOG_RATIO_CLAMP nats before the exp."""
    log_weight = jnp.clip(prox_logp - behaviour_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    weight = jnp.exp(jax.lax.stop_gradient(log_weight))
    if cap is None:
        return weight, jnp.zeros(weight.shape, bool)
    return jnp.minimum(weight, cap), weight > cap


def policy_loss(
    logp: jax.Array,
    prox_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    cfg: GRPOLossConfig,
    ref_logp: jax.Array | None = None,
    behaviour_logp: jax.Array | None = None,
    denominator: jax.Array | None = None,
    kl_logp: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Decoupled clipped-ratio policy-gradient loss (Hilton et al. 2021; AReaL), dual-clip, with an
    optional k3 KL penalty.

    logp float32 [B, N]: the current policy's log-probs of the response tokens under the processed
    (top-k/top-p) distribution; prox_logp float32 [B, N]: the proximal policy's, the anchor of the
    clip (the trainer's recomputation at the weights the step starts from, or the behaviour's own
    without recomputation); behaviour_logp float32 [B, N] or None: the log-probs of the policy that
    sampled the tokens (the rollout's, exact under speculation) when prox_logp is a recomputation;
    advantages float32 [B]; mask [B, N] (1 = token counts). Per token, with the log-ratios clamped to
    +-LOG_RATIO_CLAMP nats before exp, r = exp(logp - prox_logp), A the advantage and
    w = min(exp(prox_logp - behaviour_logp), cfg.tis_cap) (1 without behaviour_logp):
        pg = -min(r·A, clip(r, 1 - eps_low, 1 + eps_high)·A)
        pg = min(pg, -clip_ratio_c·A)           where A < 0        (dual-clip PPO; clip_ratio_c set)
        pg = w · pg                                                 (w not differentiated)
        kl = clip(exp(ref - cur) - (ref - cur) - 1, ±KL_CLAMP)     (k3, only when kl_beta > 0)
        loss_token = pg + kl_beta·kl
    reduced by `aggregate(..., cfg.aggregation, denominator)`. In expectation over tokens drawn from
    the behaviour policy the gradient at the proximal weights is the on-policy one (up to the cap),
    whatever the staleness. ref_logp / kl_logp float32 [B, N]: the reference's and the current
    policy's temperature-only log-probs (no top-k/top-p: finite on every token, as in verl); kl_logp
    defaults to logp.
    A token whose current, proximal, behaviour or reference log-prob is not finite (e.g. -inf when
    it lies outside the trainer's top-k/top-p nucleus) is dropped from the loss and counted in
    "nonfinite_tokens"; no inf or nan reaches the loss or its gradient.
    Returns (loss, {"pg_loss", "kl", "clip_low_frac", "clip_high_frac", "dual_clip_frac",
    "ratio_mean", "behaviour_weight_mean", "behaviour_weight_max", "behaviour_weight_capped_frac",
    "tokens", "nonfinite_tokens"}).
    """
    if cfg.kl_beta > 0 and ref_logp is None:
        raise ValueError("loss.kl_beta > 0 needs the reference log-probs (ref_logp)")
    if cfg.tis_cap == 0 and behaviour_logp is not None:
        raise ValueError("loss.tis_cap 0 drops the behaviour policy; behaviour_logp must not be given")
    kl_logp = logp if kl_logp is None else kl_logp
    candidates = mask > 0
    mask = finite_tokens(candidates, logp, prox_logp, behaviour_logp, *((ref_logp, kl_logp) if cfg.kl_beta > 0 else ()))
    maskf = mask.astype(jnp.float32)

    def safe(x):  # masked entries -> 0 before any arithmetic, so no inf reaches a gradient
        return jnp.where(mask, x, 0.0)

    ratio = jnp.exp(jnp.clip(safe(logp) - safe(prox_logp), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    adv = advantages[:, None].astype(jnp.float32)
    clipped = jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    pg = -jnp.minimum(ratio * adv, clipped * adv)
    dual = jnp.zeros(pg.shape, bool)
    if cfg.clip_ratio_c is not None:
        bound = -cfg.clip_ratio_c * adv
        dual = (adv < 0) & (pg > bound)
        pg = jnp.where(adv < 0, jnp.minimum(pg, bound), pg)
    weight, capped = jnp.ones_like(pg), jnp.zeros(pg.shape, bool)
    if behaviour_logp is not None:
        weight, capped = behaviour_weights(safe(prox_logp), safe(behaviour_logp), cfg.tis_cap)
        pg = pg * weight
    per_token = pg
    kl = jnp.zeros_like(pg)
    if cfg.kl_beta > 0:
        log_ref_ratio = jnp.clip(safe(ref_logp) - safe(kl_logp), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl = jnp.clip(jnp.exp(log_ref_ratio) - log_ref_ratio - 1.0, -KL_CLAMP, KL_CLAMP)
        per_token = pg + cfg.kl_beta * kl
    count = jnp.maximum(maskf.sum(), 1.0)
    metrics = {
        "pg_loss": aggregate(pg, maskf, cfg.aggregation, denominator),
        "kl": aggregate(kl, maskf, cfg.aggregation, denominator),
        "clip_low_frac": (maskf * ((adv < 0) & (ratio < 1.0 - cfg.eps_low))).sum() / count,
        "clip_high_frac": (maskf * ((adv > 0) & (ratio > 1.0 + cfg.eps_high))).sum() / count,
        "dual_clip_frac": (maskf * dual).sum() / count,
        "ratio_mean": (maskf * ratio).sum() / count,
        "behaviour_weight_mean": (maskf * weight).sum() / count,
        "behaviour_weight_max": jnp.max(jnp.where(mask, weight, 0.0)),
        "behaviour_weight_capped_frac": (maskf * capped).sum() / count,
        "tokens": maskf.sum(),
        "nonfinite_tokens": (candidates & ~mask).sum().astype(jnp.float32),
    }
    return aggregate(per_token, maskf, cfg.aggregation, denominator), metrics
