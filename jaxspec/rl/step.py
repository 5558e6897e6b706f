"""Optimizers and the compiled trainer functions: log-prob scoring and one minibatch update.

The compiled functions are built once per (model config, sampling, loss/optimizer settings) and
cached, so repeated runs in one process (and every step of a run) reuse their compilations.

A minibatch is a `jaxspec.rl.batch.PackedRows`: S rollouts packed into R rows (its docstring
gives every field's dtype and shape).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxspec.draft import eagle3_loss, merge_buffers
from jaxspec.models.config import ModelConfig
from jaxspec.models.moe import load_balancing_loss
from jaxspec.models.sharding import Sharding, param_shardings
from jaxspec.optim import clipped_adamw
from jaxspec.rl.batch import PackedRows
from jaxspec.rl.config import GRPOLossConfig, PolicyOptimConfig
from jaxspec.rl.loss import (
    LOGPROB_CHUNK,
    aggregate,
    draft_targets,
    policy_loss,
    reference_sampling,
    response_logprobs,
    router_aux_weight,
    sequence_forward,
)
from jaxspec.rl.online_draft import OnlineDraft, draft_optimizer
from jaxspec.rl.routing import differing_layers, replays_routing
from jaxspec.rollout.sampling import Sampling


@functools.cache
def policy_optimizer(cfg: PolicyOptimConfig) -> optax.GradientTransformation:
    """`clipped_adamw` (first moment in `cfg.state_dtype`); lr warms up linearly over
    `warmup_steps` updates."""
    return clipped_adamw(
        learning_rate(cfg),
        b1=cfg.b1,
        b2=cfg.b2,
        weight_decay=cfg.weight_decay,
        grad_clip=cfg.grad_clip,
        mu_dtype=jnp.dtype(cfg.state_dtype),
    )


def learning_rate(cfg: PolicyOptimConfig) -> Callable:
    if cfg.warmup_steps == 0:
        return optax.constant_schedule(cfg.learning_rate)
    return optax.linear_schedule(cfg.learning_rate / cfg.warmup_steps, cfg.learning_rate, cfg.warmup_steps - 1)


@functools.cache
def score_fn(
    cfg: ModelConfig,
    sampling: Sampling,
    compute_dtype: str,
    remat: bool,
    sharding: Sharding | None = None,
    logprob_chunk: int = LOGPROB_CHUNK,
    routing_replay: bool = False,
) -> Callable:
    """Compiled (params, tokens, segment_ids, resp_index, resp_tokens) of packed rows -> log p of the
    response tokens float32 [S, N] (no gradient). sharding: the run's mesh (activations split over
    its batch axes, `sequence_forward`), None on one device. logprob_chunk: response positions per
    chunk of the head (`response_logprobs`).
    A sixth argument, the rollout's experts [R, W, L_sparse, k] packed like the tokens (a
    mixture-of-experts policy), makes it return (log p, int32 [S, N] the sparse layers whose top-k
    differs from the record at each response token's predicting position, `routing.differing_layers`);
    routing_replay: the forward runs every token on those experts (they must be given)."""

    def score(params, tokens, segment_ids, resp_index, resp_tokens, experts=None):
        if routing_replay and experts is None:
            raise ValueError("routing replay scores with the rollout's experts: pass them")
        hidden, _, router_logits = sequence_forward(
            cfg,
            params,
            tokens,
            segment_ids,
            (),
            jnp.dtype(compute_dtype),
            remat,
            sharding,
            head=False,
            experts=experts if routing_replay else None,
        )
        logp = response_logprobs(
            cfg, params, hidden, resp_index, resp_tokens, sampling, chunk_size=logprob_chunk, sharding=sharding
        )[0]
        if experts is None:
            return logp
        return logp, differing_layers(router_logits, experts, resp_index, cfg.num_experts_per_tok)

    return jax.jit(score)


@functools.cache
def update_fn(
    cfg: ModelConfig,
    sampling: Sampling,
    loss_cfg: GRPOLossConfig,
    optim_cfg: PolicyOptimConfig,
    compute_dtype: str,
    remat: bool,
    draft: OnlineDraft | None,
    sharding: Sharding | None = None,
    logprob_chunk: int = LOGPROB_CHUNK,
) -> MinibatchUpdate:
    """Compiled minibatch update (the policy does not step on a minibatch without loss tokens: the
    caller, which packed it, says so; see `MinibatchUpdate`).

    (params, opt_state, draft_weights, draft_buffers, draft_opt_state, minibatch) ->
    (params, opt_state, draft_weights, draft_opt_state, metrics). With `draft` None the draft
    arguments are None and pass through. A mixture-of-experts policy's loss adds
    `router_aux_weight` x the router's load-balancing loss over the minibatch's non-padding tokens
    (metric router_aux_loss, logged whatever the weight). The policy's log-probs come from its final
    hidden states in chunks of `logprob_chunk` response positions (`response_logprobs`): the policy
    loss holds no float32 logits of every packed position, forward or backward. With a draft, one
    policy forward also returns the aux hidden states; the draft loss reads them and the policy's
    `Eagle3Targets` at every position, built detached from the final hidden states in chunks of
    `logprob_chunk` positions (`draft_targets`: no [R, W, V] logits; no gradient kept), so the
    policy gets exactly the policy-loss gradient and the head the draft-loss gradient; each is
    clipped and run through its own AdamW. The head's update is then multiplied by λ =
    draft.loss_weight: the head trains on L = L_policy + λ·L_draft with the weight acting after the
    clipping and Adam's normalisation, which would cancel a weight on the loss (λ·draft.learning_rate
    is its effective learning rate). remat rematerialises the policy's layers and the head's
    unrolled steps. params / opt_state / draft weights / draft opt_state are
    donated. Separate programs (`MinibatchUpdate`): the gradients, then the optimizers' steps.
    With loss.routing_replay the policy's forward runs every token on the minibatch's recorded
    experts (`PackedRows.experts`, `jaxspec.rl.routing`).
    """
    p_opt = policy_optimizer(optim_cfg)
    router_aux = router_aux_weight(loss_cfg, cfg)
    replay = replays_routing(loss_cfg, cfg)
    d_opt = draft_optimizer(draft.train) if draft is not None else None
    hidden_layers = tuple(draft.dcfg.aux_layer_ids) if draft is not None else ()

    def loss_fn(params, draft_weights, draft_buffers, mb: PackedRows):
        if replay and mb.experts is None:
            raise ValueError("loss.routing_replay: the minibatch holds no recorded experts (PackedRows.experts)")
        final, hidden, router_logits = sequence_forward(
            cfg,
            params,
            mb.tokens,
            mb.segment_ids,
            hidden_layers,
            jnp.dtype(compute_dtype),
            remat,
            sharding,
            head=False,
            experts=mb.experts if replay else None,
        )
        logprobs = functools.partial(
            response_logprobs,
            cfg,
            params,
            final,
            mb.resp_index,
            mb.resp_tokens,
            chunk_size=logprob_chunk,
            sharding=sharding,
        )
        logp, entropy = logprobs(sampling)
        kl_logp = None
        if loss_cfg.kl_beta > 0:
            kl_logp = logprobs(reference_sampling(sampling))[0]
        denominator = None if mb.loss_denominator is None else jnp.max(mb.loss_denominator)
        loss, metrics = policy_loss(
            logp,
            mb.prox_logp,
            mb.advantages,
            mb.loss_mask,
            loss_cfg,
            ref_logp=mb.ref_logp,
            behaviour_logp=mb.behaviour_logp,
            denominator=denominator,
            kl_logp=kl_logp,
        )
        if cfg.sparse_layers:
            metrics["router_aux_loss"] = load_balancing_loss(router_logits, cfg.num_experts_per_tok, mb.segment_ids > 0)
            if router_aux:
                loss = loss + router_aux * metrics["router_aux_loss"]
        metrics["loss"] = loss
        metrics["entropy"] = aggregate(entropy, mb.loss_mask, "token")
        total = loss
        if draft is not None:
            dparams = merge_buffers(draft_weights, draft_buffers)
            targets = draft_targets(cfg, params, final, dparams, chunk_size=logprob_chunk, sharding=sharding)
            draft_loss, draft_metrics = eagle3_loss(
                draft.dcfg,
                dparams,
                jax.lax.stop_gradient(params["embed"]),
                jax.lax.stop_gradient(hidden),
                targets,
                mb.tokens,
                mb.seq_resp_mask,
                num_steps=draft.train.ttt_steps,
                step_decay=draft.train.step_decay,
                segment_ids=mb.segment_ids,
                remat=remat,
            )
            metrics["draft_loss"] = draft_loss
            metrics.update({f"draft_{k}": v for k, v in draft_metrics.items()})
            total = loss + draft_loss  # λ scales the head's update below
        return total, metrics

    def minibatch_gradients(params, draft_weights, draft_buffers, mb):
        grad_fn = jax.grad(loss_fn, argnums=(0, 1), has_aux=True)
        (grads, draft_grads), metrics = grad_fn(params, draft_weights, draft_buffers, mb)
        if sharding is not None:  # an output: laid out like the params, not as XLA would choose
            grads = jax.lax.with_sharding_constraint(grads, param_shardings(sharding, grads))
        metrics["grad_norm"] = optax.tree.norm(grads)
        if draft is not None:
            metrics["draft_grad_norm"] = optax.tree.norm(draft_grads)
        return grads, draft_grads, metrics

    def policy_step(params, opt_state, grads):
        updates, opt_state = p_opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def draft_step(draft_weights, draft_opt_state, draft_grads):
        updates, draft_opt_state = d_opt.update(draft_grads, draft_opt_state, draft_weights)
        updates = jax.tree.map(lambda u: draft.train.loss_weight * u, updates)
        return optax.apply_updates(draft_weights, updates), draft_opt_state

    def minibatch_step(params, opt_state, draft_weights, draft_opt_state, grads, draft_grads):
        params, opt_state = policy_step(params, opt_state, grads)
        if draft is None:
            return params, opt_state, None, None
        return params, opt_state, *draft_step(draft_weights, draft_opt_state, draft_grads)

    return MinibatchUpdate(
        jax.jit(minibatch_gradients),
        jax.jit(minibatch_step, donate_argnums=(0, 1, 2, 3)),
        jax.jit(draft_step, donate_argnums=(0, 1)) if draft is not None else None,
    )


class MinibatchUpdate(NamedTuple):
    """`update_fn`'s update as compiled programs, called as one function:

    gradients (params, draft_weights, draft_buffers, minibatch) -> (grads, draft_grads, metrics)
    optimizer_step (params, opt_state, draft_weights, draft_opt_state, grads, draft_grads) ->
        (params, opt_state, draft_weights, draft_opt_state), the first four donated: both steps
    draft_step (draft_weights, draft_opt_state, draft_grads) -> (draft_weights, draft_opt_state),
        both donated: the head's step alone, for a minibatch without policy tokens (the head trains
        on every minibatch; the policy has nothing to learn from it). None without a draft.

    Separate programs so the float32 gradients (the size of the sharded policy) are buffers of their
    own, one per leaf, between the programs: inside one program they were part of its temporaries,
    which XLA allocates as one block (Qwen3-8B on 2 x 80 GB: 19.2 GB, which the allocator could not
    find in one piece among 34.6 GB free). The host, which packed the minibatch, says whether the
    policy steps: a `lax.cond` on the device instead kept the stepped state from aliasing the donated
    one (Qwen3-8B, fsdp=2: 86.7 GB of outputs, 22.4 of them aliased). Any member may be a
    `jax.stages.Compiled` (`compile`).
    """

    gradients: Callable
    optimizer_step: Callable
    draft_step: Callable | None = None

    def __call__(self, params, opt_state, draft_weights, draft_buffers, draft_opt_state, mb, policy_steps: bool = True):
        """One minibatch's update; `policy_steps` False (a minibatch without policy tokens, which only
        an update with a draft takes) steps the head alone and returns params and opt_state as given."""
        if not policy_steps and self.draft_step is None:
            raise ValueError("an update without a draft has nothing to step on a minibatch without policy tokens")
        grads, draft_grads, metrics = self.gradients(params, draft_weights, draft_buffers, mb)
        if policy_steps:
            stepped = self.optimizer_step(params, opt_state, draft_weights, draft_opt_state, grads, draft_grads)
        else:
            stepped = (params, opt_state, *self.draft_step(draft_weights, draft_opt_state, draft_grads))
        return (*stepped, metrics)

    def programs(self) -> dict[str, Callable]:
        """The programs this update has, by name (no draft_step without a draft)."""
        return {name: program for name, program in self._asdict().items() if program is not None}

    def compile(self, params, opt_state, draft_weights, draft_buffers, draft_opt_state, mb) -> MinibatchUpdate:
        """Every program compiled ahead of a call with these arguments (arrays or ShapeDtypeStructs
        with shardings); the steps for the gradients program's outputs."""
        gradients = self.gradients.lower(params, draft_weights, draft_buffers, mb).compile()
        # the outputs' shapes and shardings, in the default layouts the call's arrays have
        outputs = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), gradients.out_info
        )
        grads, draft_grads, _ = outputs
        step = self.optimizer_step.lower(
            params, opt_state, draft_weights, draft_opt_state, grads, draft_grads
        ).compile()
        draft_step = None
        if self.draft_step is not None:
            draft_step = self.draft_step.lower(draft_weights, draft_opt_state, draft_grads).compile()
        return MinibatchUpdate(gradients, step, draft_step)
