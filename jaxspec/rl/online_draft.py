"""The EAGLE-3 head trained online next to the policy (draft.online): its static description, its
optimizer and schedule, and the state it trains through a step.

The head's params split into trainable weights and frozen buffers (its vocabulary maps,
`jaxspec.draft.split_buffers`); the update reads both and steps the weights with the head's own
AdamW. The checkpoint keeps the merged params ("draft_params") and the optimizer state
("draft_opt_state"), as a run without online training keeps the frozen head.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import optax

from jaxspec.draft import merge_buffers, split_buffers
from jaxspec.optim import clipped_adamw
from jaxspec.rl.config import OnlineDraftConfig


@functools.cache
def draft_optimizer(cfg: OnlineDraftConfig) -> optax.GradientTransformation:
    """The draft head's own `clipped_adamw` (constant learning rate); `jaxspec.rl.step.update_fn`
    multiplies its updates by draft.loss_weight."""
    return clipped_adamw(
        cfg.learning_rate, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip
    )


class OnlineDraft(NamedTuple):
    """Static description of the EAGLE-3 head trained next to the policy (hashable: a key of the
    compiled update)."""

    dcfg: object  # jaxspec.draft.DraftConfig
    train: OnlineDraftConfig

    def trains_on(self, update_index: int) -> bool:
        """Whether the head trains on a step's minibatch update `update_index` (epoch * minibatches
        + minibatch): every draft.train_every-th, from the first."""
        return update_index % self.train.train_every == 0

    @property
    def skips_updates(self) -> bool:
        """Whether some minibatch updates run without the head (draft.train_every > 1)."""
        return self.train.train_every > 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OnlineDraftState:
    """The head while a step's updates run (a pytree): weights (trainable params), buffers (frozen
    vocabulary maps) and opt_state (AdamW state of the weights), arrays or their abstract values."""

    weights: dict
    buffers: dict
    opt_state: Any

    @classmethod
    def init(cls, draft: OnlineDraft, params: dict) -> OnlineDraftState:
        """The head's params `params` with a fresh optimizer state."""
        weights, buffers = split_buffers(params)
        return cls(weights, buffers, draft_optimizer(draft.train).init(weights))

    @classmethod
    def from_checkpoint(cls, state: dict) -> OnlineDraftState:
        """Split from the run's state entries "draft_params" and "draft_opt_state"."""
        weights, buffers = split_buffers(state["draft_params"])
        return cls(weights, buffers, state["draft_opt_state"])

    @property
    def params(self) -> dict:
        """The head's params (weights and buffers merged)."""
        return merge_buffers(self.weights, self.buffers)

    def checkpoint_entries(self) -> dict:
        """The run's state entries: the merged params and the optimizer state."""
        return {"draft_params": self.params, "draft_opt_state": self.opt_state}

    def update_args(self) -> tuple:
        """(weights, buffers, opt_state): the draft arguments of the compiled update."""
        return self.weights, self.buffers, self.opt_state

    def with_update(self, weights: dict, opt_state: Any) -> OnlineDraftState:
        """The state after an update returned new weights and optimizer state."""
        return dataclasses.replace(self, weights=weights, opt_state=opt_state)
