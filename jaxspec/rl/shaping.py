"""Host-side shaping of a step's rollouts before the loss: DAPO's soft overlong penalty on the
rewards, DAPO dynamic sampling's choice of groups, and the rollouts kept out of the loss
(filter_groups, mask_truncated)."""

from __future__ import annotations

import numpy as np

from jaxspec.rl.config import GRPOLossConfig


def truncated_rollouts(tokens: np.ndarray, lengths: np.ndarray, max_new_tokens: int, eos_id: int) -> np.ndarray:
    """bool [B]: rollouts cut at max_new_tokens without an eos (tokens int32 [B, N], lengths [B])."""
    return (lengths == max_new_tokens) & (tokens[:, -1] != eos_id)


def trained_rollouts(informative: np.ndarray, truncated: np.ndarray, group: int, loss: GRPOLossConfig) -> np.ndarray:
    """bool [B]: rollouts whose tokens enter the policy loss. informative bool [B / group] (groups
    with unequal rewards), truncated bool [B]; `loss.filter_groups` drops uninformative groups and
    `loss.mask_truncated` drops truncated rollouts."""
    keep = np.ones(truncated.shape, bool)
    if loss.filter_groups:
        keep &= np.repeat(informative, group)
    if loss.mask_truncated:
        keep &= ~truncated
    return keep


def overlong_penalty(lengths: np.ndarray, max_new_tokens: int, buffer: int, penalty: float) -> np.ndarray:
    """DAPO's soft overlong punishment, added to the rewards: float64 [B] for lengths int [B].

    0 up to max_new_tokens - buffer tokens, then falling linearly to -penalty at max_new_tokens:
    -penalty * (length - (max_new_tokens - buffer)) / buffer. buffer 0 = no penalty.
    """
    lengths = np.asarray(lengths, np.float64)
    if buffer <= 0:
        return np.zeros_like(lengths)
    excess = np.clip(lengths - (max_new_tokens - buffer), 0.0, buffer)
    return -penalty * excess / buffer


def select_groups(informative: np.ndarray, num_groups: int) -> np.ndarray:
    """DAPO dynamic sampling: ids of `num_groups` of the generated groups, the informative ones
    (unequal rewards) first in generation order, then uninformative ones in order to keep the
    batch's size when too few were found. informative bool [G] with G >= num_groups."""
    informative = np.asarray(informative, bool)
    if informative.size < num_groups:
        raise ValueError(f"{informative.size} groups cannot fill a batch of {num_groups}")
    order = np.concatenate([np.flatnonzero(informative), np.flatnonzero(~informative)])
    return order[:num_groups]
