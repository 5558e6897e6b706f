"""Loss and jitted train step of pretraining (checkpoints: `jaxspec.run.Checkpointer`).

The training state is a pytree {"params", "opt_state", "step", "position", "key"}: float32 master
params, the optax state, the number of optimizer steps taken, the data position (packed rows
consumed) and the run's PRNG key (raw uint32 [2]).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from jaxspec.models.config import ModelConfig
from jaxspec.models.moe import load_balancing_loss
from jaxspec.models.params import Params
from jaxspec.models.sharding import Sharding
from jaxspec.models.transformer import forward_router


def response_loss(
    cfg: ModelConfig,
    params: Params,
    tokens: jax.Array,
    segment_ids: jax.Array,
    weights: jax.Array,
    compute_dtype=jnp.float32,
    remat: bool = False,
    attention_impl: str = "auto",
    sharding: Sharding | None = None,
    moe_impl: str = "ragged_dot",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Mean next-token cross-entropy over response tokens of packed rows, plus
    cfg.router_aux_loss_coef x the router's load-balancing loss over the non-padding tokens for a
    mixture-of-experts policy.

    tokens / segment_ids int32 [B, L+1] (segment 0 = padding; examples attend only within their
    segment and their positions restart at 0); weights float32 [B, L] selects the targets
    tokens[:, 1:] that count (see `data.PackedSet`). The forward computes in `compute_dtype`,
    each layer's weights cast inside its layer function (gradients flow back to the float32 master
    copy). attention_impl, moe_impl: as `forward_hidden`.
    sharding: the run's mesh; activations are split over its batch axes (`jaxspec.rl.loss.sequence_forward`).
    Returns (loss float32 scalar, number of counted target tokens, load-balancing loss (0 for a
    dense policy)).
    """
    inputs, targets, segments = tokens[:, :-1], tokens[:, 1:], segment_ids[:, :-1]
    logits, _, router_logits = forward_router(
        cfg,
        params,
        inputs,
        mask=segments > 0,
        segment_ids=segments,
        remat=remat,
        attention_impl=attention_impl,
        sharding=sharding,
        moe_impl=moe_impl,
        compute_dtype=compute_dtype,
    )
    logz = jax.nn.logsumexp(logits, axis=-1)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    count = weights.sum()
    loss = ((logz - target_logits) * weights).sum() / jnp.maximum(count, 1.0)
    if not cfg.sparse_layers:
        return loss, count, jnp.zeros((), jnp.float32)
    aux = load_balancing_loss(router_logits, cfg.num_experts_per_tok, segments > 0)
    return loss + cfg.router_aux_loss_coef * aux, count, aux


def make_train_step(
    cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    compute_dtype,
    remat: bool,
    attention_impl: str = "auto",
    sharding: Sharding | None = None,
    moe_impl: str = "ragged_dot",
) -> Callable:
    """Jitted (params, opt_state, batch) -> (params, opt_state, metrics); donates params/opt_state."""

    def step(params, opt_state, batch):
        def loss_fn(p):
            return response_loss(
                cfg,
                p,
                batch["tokens"],
                batch["segment_ids"],
                batch["weights"],
                compute_dtype,
                remat,
                attention_impl,
                sharding,
                moe_impl,
            )

        def with_aux(p):
            loss, count, router_aux = loss_fn(p)
            return loss, (count, router_aux)

        (loss, (count, router_aux)), grads = jax.value_and_grad(with_aux, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        return (
            params,
            opt_state,
            {"loss": loss, "grad_norm": grad_norm, "target_tokens": count, "router_aux_loss": router_aux},
        )

    return jax.jit(step, donate_argnums=(0, 1))
