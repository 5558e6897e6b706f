"""Trainer-side log-probabilities of rollout tokens and the GRPO / DAPO policy loss.

Shapes: S rollouts, packed into R rows of width W (`jaxspec.rl.batch.pack_rows`), N =
max_new_tokens, V = vocabulary. Response token j of rollout s is predicted by the logits at flat
position resp_index[s, j] of the packed [R * W] positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.models.config import ModelConfig
from jaxspec.models.sharding import Sharding
from jaxspec.models.transformer import Params, forward_hidden
from jaxspec.rl.config import LossConfig
from jaxspec.rollout.sampling import Sampling, processed_logprobs


def sequence_forward(cfg: ModelConfig, params: Params, tokens: jax.Array, segment_ids: jax.Array,
                     hidden_layers: tuple[int, ...] = (), compute_dtype=jnp.float32, remat: bool = False,
                     sharding: Sharding | None = None) -> tuple[jax.Array, jax.Array]:
    """One policy forward over packed prompt+response rows.

    tokens int32 [R, W]; segment_ids int32 [R, W] (each sequence attends within itself; rope
    positions restart per sequence). Params are cast to `compute_dtype` (gradients reach the
    float32 master). Returns (float32 logits [R, W, V], hidden [len(hidden_layers), R, W, H]:
    outputs of the given 0-based layers). With a `sharding`, every layer's activations are split
    over the batch axes (rows), whatever the params' layout: without the constraint the rows of an
    fsdp-sharded embedding table come out split along the hidden dimension, a layout cuDNN's
    flash attention cannot partition.
    """
    compute_params = jax.tree.map(lambda x: x.astype(compute_dtype), params)
    return forward_hidden(cfg, compute_params, tokens, hidden_layers, segment_ids=segment_ids, remat=remat,
                          sharding=sharding)


def response_logprobs(logits: jax.Array, resp_index: jax.Array, resp_tokens: jax.Array, sampling: Sampling
                      ) -> tuple[jax.Array, jax.Array]:
    """Log-probability of each response token under the processed distribution p.

    logits float32 [R, W, V]; resp_index int32 [S, N] (flat position in [R * W] of the logits
    predicting response token j); resp_tokens int32 [S, N]. p is `processed_logprobs(logits,
    sampling)`, the same distribution the rollout sampled from (temperature, top-k, top-p).
    Returns (float32 log p [S, N], float32 entropy of p [S, N], not differentiated).
    """
    step_logits = jnp.take(logits.reshape(-1, logits.shape[-1]), resp_index, axis=0)  # [S, N, V]
    logp_all = processed_logprobs(step_logits, sampling)
    logp = jnp.take_along_axis(logp_all, resp_tokens[:, :, None], axis=2)[:, :, 0]
    logp_all = jax.lax.stop_gradient(logp_all)
    entropy = -jnp.sum(jnp.where(jnp.isfinite(logp_all), jnp.exp(logp_all) * logp_all, 0.0), axis=-1)
    return logp, entropy


def aggregate(per_token: jax.Array, mask: jax.Array, aggregation: str) -> jax.Array:
    """Reduces [B, N] token values over the tokens where mask [B, N] is set.

    "token": sum over all tokens / number of tokens. "sequence": mean over the rows that have any
    token of each row's token mean. 0 when no token is set.
    """
    mask = mask.astype(jnp.float32)
    masked = jnp.where(mask > 0, per_token, 0.0)
    if aggregation == "token":
        return masked.sum() / jnp.maximum(mask.sum(), 1.0)
    if aggregation == "sequence":
        counts = mask.sum(axis=1)
        row_means = masked.sum(axis=1) / jnp.maximum(counts, 1.0)
        rows = (counts > 0).astype(jnp.float32)
        return (row_means * rows).sum() / jnp.maximum(rows.sum(), 1.0)
    raise ValueError(f"aggregation must be 'token' or 'sequence', got {aggregation!r}")


def policy_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array, cfg: LossConfig,
                ref_logp: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped-ratio policy-gradient loss with an optional k3 KL penalty.

    logp / old_logp / ref_logp float32 [B, N]: current, behaviour (rollout or recomputed) and
    reference log-probs of the response tokens; advantages float32 [B]; mask [B, N] (1 = token
    counts). Per token, with ratio r = exp(logp - old_logp) and advantage A:
        pg = -min(r·A, clip(r, 1 - eps_low, 1 + eps_high)·A)
        kl = exp(ref - logp) - (ref - logp) - 1                      (k3, only when kl_beta > 0)
        loss_token = pg + kl_beta·kl
    reduced by `aggregate(..., cfg.aggregation)`. Tokens whose log-prob is -inf (excluded from p
    by top-k/top-p on the trainer's side) do not count.
    Returns (loss, {"pg_loss", "kl", "clip_low_frac", "clip_high_frac", "ratio_mean", "tokens"}).
    """
    mask = (mask > 0) & jnp.isfinite(logp)
    maskf = mask.astype(jnp.float32)
    ratio = jnp.exp(jnp.where(mask, logp - old_logp, 0.0))
    adv = advantages[:, None].astype(jnp.float32)
    clipped = jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    pg = -jnp.minimum(ratio * adv, clipped * adv)
    per_token = pg
    kl = jnp.zeros_like(pg)
    if cfg.kl_beta > 0:
        if ref_logp is None:
            raise ValueError("loss.kl_beta > 0 needs the reference log-probs (ref_logp)")
        log_ref_ratio = jnp.where(mask, ref_logp - logp, 0.0)
        kl = jnp.exp(log_ref_ratio) - log_ref_ratio - 1.0
        per_token = pg + cfg.kl_beta * kl
    count = jnp.maximum(maskf.sum(), 1.0)
    metrics = {
        "pg_loss": aggregate(pg, maskf, cfg.aggregation),
        "kl": aggregate(kl, maskf, cfg.aggregation),
        "clip_low_frac": (maskf * ((adv < 0) & (ratio < 1.0 - cfg.eps_low))).sum() / count,
        "clip_high_frac": (maskf * ((adv > 0) & (ratio > 1.0 + cfg.eps_high))).sum() / count,
        "ratio_mean": (maskf * ratio).sum() / count,
        "tokens": maskf.sum(),
    }
    return aggregate(per_token, maskf, cfg.aggregation), metrics
