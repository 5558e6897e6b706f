"""Routing replay (R3) for mixture-of-experts policies: which runs record the rollout's experts, the
trainer's disagreement with them, and the record laid out as training rows.

A mixture-of-experts policy's rollout and trainer can route a token to different experts although
they hold the same weights (other kernels, another batch, another dtype: a near-tie of the router
flips), and then their log-probs differ by far more than rounding. With loss.routing_replay the
rollout records each token's experts (`jaxspec.rollout.experts`) and the trainer's log-prob pass and
update run every token on them (`jaxspec.models.forward_router(..., experts=...)`), with the gate
weights from the trainer's own router, which still learns.

The log-prob pass (loss.recompute_logprobs) measures the disagreement: the fraction of (response
token, sparse layer) pairs whose top-k set under the trainer's router at the proximal weights
differs from the rollout's, at the position whose hidden state predicts the token (metric
expert_disagreement), and the fraction of response tokens with any such layer
(expert_disagreement_tokens). With replay on, layer j's router reads hidden states computed with
the replayed experts of the layers before it, so the measure isolates each router's own flips;
without replay, a flip also changes every later layer's input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models.config import ModelConfig
from jaxspec.models.moe import top_experts
from jaxspec.rl.config import GRPOLossConfig


def replays_routing(loss: GRPOLossConfig, model: ModelConfig) -> bool:
    """loss.routing_replay; ValueError naming the key for a dense policy (no experts to replay)."""
    if loss.routing_replay and not model.sparse_layers:
        raise ValueError(
            "loss.routing_replay: the policy is dense (no mixture-of-experts layers route tokens to "
            "experts); set it to false"
        )
    return loss.routing_replay


def records_experts(loss: GRPOLossConfig, model: ModelConfig) -> bool:
    """Whether a run's rollouts record their experts: a mixture-of-experts policy whose trainer
    replays them (loss.routing_replay) or measures its disagreement with them in the log-prob pass
    (loss.recompute_logprobs)."""
    return replays_routing(loss, model) or (bool(model.sparse_layers) and loss.recompute_logprobs)


def differing_layers(router_logits: jax.Array, experts: jax.Array, resp_index: jax.Array, top_k: int) -> jax.Array:
    """int32 [S, N]: how many sparse layers' top-k sets differ between the trainer's router and the
    record at the position predicting each response token.

    router_logits float32 [L_sparse, R, W, E] (`forward_router`'s); experts [R, W, L_sparse, k]
    integer, packed like the tokens; resp_index int32 [S, N] flat positions in [R * W]."""
    own = jnp.sort(top_experts(router_logits, top_k), axis=-1)  # [L_sparse, R, W, k]
    recorded = jnp.sort(jnp.moveaxis(experts.astype(jnp.int32), 2, 0), axis=-1)
    differ = jnp.any(own != recorded, axis=-1).sum(axis=0, dtype=jnp.int32)  # [R, W]
    return jnp.take(differ.reshape(-1), resp_index.reshape(-1)).reshape(resp_index.shape)


def disagreement_metrics(differing: np.ndarray, resp_mask: np.ndarray, num_sparse_layers: int) -> dict[str, float]:
    """{"expert_disagreement", "expert_disagreement_tokens"} (module docstring) of the response
    tokens resp_mask bool [S, N] from `differing_layers`' counts int [S, N]."""
    counts = np.asarray(differing)[np.asarray(resp_mask, bool)]
    if not counts.size:
        return {"expert_disagreement": 0.0, "expert_disagreement_tokens": 0.0}
    return {
        "expert_disagreement": float(counts.sum() / (counts.size * num_sparse_layers)),
        "expert_disagreement_tokens": float(np.mean(counts > 0)),
    }


def experts_to_width(experts: np.ndarray, width: int) -> np.ndarray:
    """A rollout's record [B, P + N, L_sparse, k] (positions of each row's own sequence) as training
    rows of width W: cut or padded with expert 0 past the columns the rows use (prompt + N <= W)."""
    experts = np.asarray(experts)[:, :width]
    return np.pad(experts, ((0, 0), (0, width - experts.shape[1]), (0, 0), (0, 0)))
