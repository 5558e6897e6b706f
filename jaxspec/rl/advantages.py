"""Group-relative advantages (GRPO): each response is scored against the other samples of its prompt."""

from __future__ import annotations

import numpy as np


def group_advantages(
    rewards: np.ndarray, group_size: int, mode: str = "std", eps: float = 1e-6
) -> tuple[np.ndarray, np.ndarray]:
    """Advantages of G groups of `group_size` consecutive responses.

    rewards: float [G * group_size], the samples of one prompt adjacent.
    mode: "std" -> (r - mean_g) / (std_g + eps) with the unbiased (n - 1) standard deviation;
          "mean" -> r - mean_g.
    Returns (float32 advantages [G * group_size], bool informative [G]: the group's rewards are
    not all equal). A group whose rewards are all equal gets advantage exactly 0.
    """
    if mode not in ("std", "mean"):
        raise ValueError(f"advantage mode must be 'std' or 'mean', got {mode!r}")
    rewards = np.asarray(rewards, np.float64)
    if group_size < 2 or rewards.ndim != 1 or rewards.size % group_size:
        raise ValueError(f"rewards of shape {rewards.shape} do not split into groups of {group_size} (>= 2)")
    groups = rewards.reshape(-1, group_size)
    centred = groups - groups.mean(axis=1, keepdims=True)
    informative = groups.max(axis=1) > groups.min(axis=1)
    centred[~informative] = 0.0  # exact zeros, whatever the rounding of the mean
    if mode == "std":
        scale = np.where(informative[:, None], groups.std(axis=1, ddof=1, keepdims=True) + eps, 1.0)
        centred = centred / scale
    return centred.reshape(-1).astype(np.float32), informative
