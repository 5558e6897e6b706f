"""The AdamW recipe of every jaxspec optimizer (`clipped_adamw`), and the warmup-cosine schedule
that pretraining and offline draft training put it on."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup to `learning_rate`, cosine decay to learning_rate * min_lr_ratio,
    after clipping gradients to global norm `grad_clip`.

    learning_rate: the peak learning rate, reached after the warmup.
    warmup_steps: optimizer steps of linear warmup from 0 (fewer than train.steps).
    min_lr_ratio: the learning rate at the last step, as a fraction of learning_rate (in [0, 1]).
    weight_decay: AdamW's decoupled weight decay, applied to matrices only (not to norm weights or
    biases).
    b1 / b2: AdamW's decay rates of the first and second moment estimates.
    grad_clip: the global gradient norm that gradients are clipped to before AdamW.
    """

    learning_rate: float = 1e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0


def clipped_adamw(
    learning_rate: float | Callable, *, b1: float, b2: float, weight_decay: float, grad_clip: float, mu_dtype=None
) -> optax.GradientTransformation:
    """Global-norm gradient clipping, then AdamW (first moment in `mu_dtype`, default the params'):
    every optimizer of jaxspec (pretraining, head training, the GRPO policy and its online head).
    Only matrices are decayed (not norm weights or biases)."""
    return optax.chain(
        optax.clip_by_global_norm(grad_clip),
        optax.adamw(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay, mu_dtype=mu_dtype, mask=decay_mask),
    )


def decay_mask(params):
    """True for the leaves weight decay applies to: matrices, not norm weights or biases."""
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> tuple[optax.GradientTransformation, Callable]:
    """(`clipped_adamw` on a warmup-cosine schedule over `total_steps`, the schedule)."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        decay_steps=total_steps,
        end_value=cfg.learning_rate * cfg.min_lr_ratio,
    )
    optimizer = clipped_adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip)
    return optimizer, schedule
