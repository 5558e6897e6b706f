"""The warmup-cosine AdamW recipe shared by pretraining and offline draft training."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup to `learning_rate`, cosine decay to learning_rate * min_lr_ratio,
    after clipping gradients to global norm `grad_clip`."""

    learning_rate: float = 1e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0


def make_optimizer(cfg: OptimConfig, total_steps: int) -> tuple[optax.GradientTransformation, Callable]:
    """(grad-clipped AdamW, learning-rate schedule over `total_steps`). Only matrices are decayed
    (not norm weights or biases)."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=total_steps, end_value=cfg.learning_rate * cfg.min_lr_ratio)

    def decay_mask(params):
        return jax.tree.map(lambda x: x.ndim >= 2, params)

    optimizer = optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask))
    return optimizer, schedule
