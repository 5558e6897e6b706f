"""`Spec`: how speculative rollouts draft and verify (method, draft, tree shape)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxspec.models.config import ModelConfig

METHODS = ("eagle3", "draft_model", "ngram")
DRAFT_SAMPLINGS = ("greedy", "stochastic")


@dataclasses.dataclass(frozen=True, eq=False)
class Spec:
    """Speculative decoding settings for `jaxspec.rollout.generate(..., spec=Spec(...))`.

    method: "eagle3" (an EAGLE-3 head over the policy's hidden states), "draft_model" (a smaller
        policy with the same vocabulary) or "ngram" (continuations of earlier matches of the last
        n tokens in prompt + response; no draft weights).
    draft: eagle3: (dcfg, dparams) from `jaxspec.draft`; draft_model: (ModelConfig, params);
        ngram: None.
    num_draft_tokens: draft depth k (>= 1): the longest run of draft tokens one step can accept.
    tree_width: children expanded per node and nodes kept per depth (1 = a chain).
    tree_budget: most draft nodes verified per step (>= tree_width); None keeps the whole
        k * tree_width tree. Every verification step runs 1 + min(tree_budget, k * tree_width)
        tree nodes through the policy.
    draft_sampling: "greedy": children are the draft's top-`tree_width` tokens (deterministic);
        "stochastic": children are drawn from the draft distribution without replacement
        (Gumbel-top-k). Both are exact; they differ only in how often drafts are accepted.
        ngram drafts are deterministic, so ngram takes only "greedy".
    ngram_sizes: suffix lengths the ngram drafter looks up, in order of preference.
    stage_draft_tokens: None, or the draft depth of each stage of the decode loop
        (`jaxspec.rollout.stages.batch_stages`: the full batch B, then B/2 and B/4 while they hold
        at least 32 rows; the last entry holds for the stages past it, entries past the last stage
        go unused), each in 1..num_draft_tokens. A verification step's policy forward
        costs more per draft token the more rows it runs, so large batches favour short drafts and
        the small batches of the long-answer tail favour long ones (e.g. (3, 5, 7) with
        num_draft_tokens=7). None drafts num_draft_tokens at every stage.

    Equality is identity (the draft holds arrays).
    """

    method: str
    draft: Any = None
    num_draft_tokens: int = 3
    tree_width: int = 1
    tree_budget: int | None = None
    draft_sampling: str = "greedy"
    ngram_sizes: tuple[int, ...] = (3, 2, 1)
    stage_draft_tokens: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"Spec.method must be one of {METHODS}, got {self.method!r}")
        if self.draft_sampling not in DRAFT_SAMPLINGS:
            raise ValueError(f"Spec.draft_sampling must be one of {DRAFT_SAMPLINGS}, got {self.draft_sampling!r}")
        if not _is_int(self.num_draft_tokens) or self.num_draft_tokens < 1:
            raise ValueError(f"Spec.num_draft_tokens must be an integer >= 1, got {self.num_draft_tokens!r}")
        if not _is_int(self.tree_width) or self.tree_width < 1:
            raise ValueError(f"Spec.tree_width must be an integer >= 1, got {self.tree_width!r}")
        if self.tree_budget is not None and (not _is_int(self.tree_budget) or self.tree_budget < self.tree_width):
            raise ValueError(
                f"Spec.tree_budget must be None or an integer >= tree_width={self.tree_width}, got {self.tree_budget!r}"
            )
        sizes = tuple(self.ngram_sizes) if isinstance(self.ngram_sizes, (list, tuple)) else None
        if not sizes or not all(_is_int(n) and n >= 1 for n in sizes):
            raise ValueError(f"Spec.ngram_sizes must be a non-empty tuple of integers >= 1, got {self.ngram_sizes!r}")
        object.__setattr__(self, "ngram_sizes", tuple(int(n) for n in sizes))
        if self.stage_draft_tokens is not None:
            depths = tuple(self.stage_draft_tokens) if isinstance(self.stage_draft_tokens, (list, tuple)) else None
            if not depths or not all(_is_int(k) and 1 <= k <= self.num_draft_tokens for k in depths):
                raise ValueError(
                    f"Spec.stage_draft_tokens must be None or a non-empty tuple of integers in "
                    f"1..num_draft_tokens={self.num_draft_tokens}, got {self.stage_draft_tokens!r}"
                )
            object.__setattr__(self, "stage_draft_tokens", tuple(int(k) for k in depths))
        object.__setattr__(self, "num_draft_tokens", int(self.num_draft_tokens))
        object.__setattr__(self, "tree_width", int(self.tree_width))
        if self.tree_budget is not None:
            object.__setattr__(self, "tree_budget", int(self.tree_budget))
        if self.method == "ngram":
            if self.draft is not None:
                raise ValueError("Spec.draft must be None for method='ngram' (it drafts from the token history)")
            if self.draft_sampling != "greedy":
                raise ValueError(
                    "Spec.draft_sampling must be 'greedy' for method='ngram' (its drafts have no "
                    "distribution to sample from)"
                )
        elif not (isinstance(self.draft, tuple) and len(self.draft) == 2):
            raise ValueError(
                f"Spec.draft must be a (config, params) pair for method={self.method!r}, "
                f"got {type(self.draft).__name__}"
            )
        elif self.method == "draft_model" and not isinstance(self.draft[0], ModelConfig):
            raise ValueError(
                f"Spec.draft[0] must be a jaxspec.models.ModelConfig for method='draft_model', "
                f"got {type(self.draft[0]).__name__}"
            )

    @property
    def num_tree_nodes(self) -> int:
        """Draft nodes verified per step (the tree's root excluded), at the longest draft."""
        return self.tree_nodes(self.num_draft_tokens)

    def tree_nodes(self, depth: int) -> int:
        """Draft nodes of this spec's tree drafted `depth` levels deep."""
        full = depth * self.tree_width
        return full if self.tree_budget is None else min(self.tree_budget, full)

    def stage_depths(self, num_stages: int) -> tuple[int, ...]:
        """The draft depth of each of `num_stages` loop stages."""
        depths = self.stage_draft_tokens or (self.num_draft_tokens,)
        return tuple(depths[min(i, len(depths) - 1)] for i in range(num_stages))

    @property
    def max_accepted(self) -> int:
        """Most draft tokens one step can accept: the deepest path of a tree of this shape."""
        return min(self.num_draft_tokens, self.num_tree_nodes)

    @property
    def stochastic(self) -> bool:
        return self.draft_sampling == "stochastic"


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
