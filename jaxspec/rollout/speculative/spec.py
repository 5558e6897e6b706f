"""How speculative rollouts draft and verify: the settings (`SpecConfig`, also the `spec` section of
a `jaxspec train` config) and `Spec`, those settings beside the draft's weights."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Literal

import numpy as np

from jaxspec.models.config import ModelConfig
from jaxspec.rollout.speculative.suffix import SuffixHistory

METHODS = ("eagle3", "draft_model", "ngram", "suffix")
HISTORY_FREE = ("ngram", "suffix")  # methods that draft from tokens, without weights
DRAFT_SAMPLINGS = ("greedy", "stochastic")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings: the `spec` section of a `jaxspec train` config, and what a
    `jaxspec.rollout.Spec` holds beside the draft's weights. Frozen and hashable (equal settings
    are equal); `errors` is their one range check.

    method: "none" samples autoregressively (config files; `generate` takes spec=None for that);
        "eagle3" drafts with an EAGLE-3 head over the policy's hidden states, "draft_model" with a
        smaller policy of the same vocabulary, "ngram" with continuations of earlier matches of the
        last n tokens in prompt + response (no draft weights), "suffix" with the most frequent
        continuations of the longest match of the row's last tokens in its own tokens, the other
        rows of its GRPO group and earlier answers to its prompt
        (`jaxspec.rollout.speculative.suffix`; no draft weights).
    draft (config files): EAGLE-3 folder (method eagle3) or HF folder of a smaller model
        (draft_model). With eagle3, null = the embedded tiny policy's head
        (`jaxspec/assets/tiny-eagle3`) and "random" = a freshly initialised head (seeded by
        train.seed), e.g. to train online from scratch. A `Spec` holds the weights instead (its
        settings leave this null).
    num_draft_tokens: draft depth k (>= 1): the longest run of draft tokens one step can accept.
    tree_width: children expanded per node and nodes kept per depth (1 = a chain).
    tree_budget: most draft nodes verified per step (>= tree_width); null keeps the whole
        num_draft_tokens * tree_width tree. Every verification step runs
        1 + min(tree_budget, num_draft_tokens * tree_width) tree nodes through the policy.
    draft_sampling: "greedy" expands the draft's top-`tree_width` tokens (deterministic),
        "stochastic" draws them from the draft distribution without replacement (Gumbel-top-k);
        both are exact, they differ only in how often drafts are accepted. ngram and suffix drafts
        are deterministic, so they take only "greedy".
    ngram_sizes: suffix lengths the ngram drafter looks up, in order of preference.
    suffix_max_match: longest run of a row's last tokens the suffix drafter matches (>= 1).
    suffix_candidates: matches (of the longest length found) whose continuations make the suffix
        drafter's tree, counted per continuation (>= 1).
    suffix_group_rows: rows of one GRPO group: the rows carrying one prompt fall, in row order,
        into groups of this many rows that draft from each other (null: all rows of a prompt;
        `jaxspec train` sets its samples per prompt).
    suffix_history: earlier responses per prompt that `jaxspec train` keeps for the suffix drafter
        and for suffix_branches (>= 0; 0 keeps none).
    suffix_branches: method eagle3 only: true drafts hybrid trees, the head's tree and the suffix
        drafter's (the suffix_* keys) merged into one with each token path once
        (`jaxspec.rollout.speculative.hybrid`); each row's node budget is split between the two
        per step by their measured acceptance (running rates, adaptive_decay). Deterministic
        drafts only (draft_sampling "greedy"); tree_width applies to both sources, and a null
        tree_budget keeps both whole trees (2 * num_draft_tokens * tree_width nodes).
    adaptive: false drafts the full depth at every loop iteration; true chooses each iteration's
        depth, 0 (a plain autoregressive step) included, from the acceptance measured so far and
        the cost model below (`jaxspec.rollout.speculative.adaptive`; the statistics count the
        iterations of each depth and the autoregressive ones).
    verify_token_cost: the adaptive cost model: what each verified draft node adds to a decode
        step's cost, in decode steps (>= 0): one number for every batch size, or [rows, cost]
        pairs, rows ascending (e.g. [[1, 0.01], [64, 0.1], [512, 0.6]]), read at the rows a step
        runs (the staged loop's stage batch, the slot engine's decoding slots), linear between the
        pairs and flat beyond. Near 0 at small batches, larger at large ones, where verifying N
        nodes per row multiplies the policy's weights instead of reading them once: `jaxspec bench
        spec-cost` measures it at each batch size ((verify(N) / decode - 1) / (N - 1)) and prints
        the pairs.
    draft_token_cost: the adaptive cost model: the cost of drafting one tree level, in decode
        steps (>= 0; bench spec-cost's draft / decode for eagle3; about 0 for ngram and suffix).
    adaptive_decay: weight of the earlier measurements in the running acceptance rates (of the
        adaptive depth and of the suffix_branches split), in [0, 1) (0: the last iteration's alone).
    adaptive_probe: after this many autoregressive iterations in a row, one iteration drafts
        again (>= 1, a probe), so drafts that became useful are noticed.
    adaptive_probe_max: each probe that does not bring drafting back doubles the run before the
        next one, up to this many iterations (>= adaptive_probe; = adaptive_probe: a fixed run).
        An EAGLE-3 head queues the features of an autoregressive run and runs them at once at
        the next drafting iteration (up to this many entries per row).
    stage_draft_tokens: null, or the draft depth of each stage of the decode loop
        (`jaxspec.rollout.stages.batch_stages`: the full batch B, then B/2 and B/4 while they hold
        at least 32 rows; the last entry holds for the stages past it, entries past the last stage
        go unused), each in 1..num_draft_tokens. A verification step's policy forward costs more
        per draft token the more rows it runs, so large batches favour short drafts and the small
        batches of the long-answer tail favour long ones (e.g. [3, 5, 7] with num_draft_tokens 7).
        null drafts num_draft_tokens at every stage. On the slot engine (rollout.slots S) entry i
        is the depth while at most S / 2^i and more than S / 2^(i + 1) slots decode.
    """

    method: Literal["none", "eagle3", "draft_model", "ngram", "suffix"] = "none"
    draft: str | None = None
    num_draft_tokens: int = 3
    tree_width: int = 1
    tree_budget: int | None = None
    draft_sampling: Literal["greedy", "stochastic"] = "greedy"
    ngram_sizes: tuple[int, ...] = (3, 2, 1)
    suffix_max_match: int = 8
    suffix_candidates: int = 16
    suffix_group_rows: int | None = None
    suffix_history: int = 0
    suffix_branches: bool = False
    adaptive: bool = False
    verify_token_cost: float | tuple[tuple[int, float], ...] = 0.1
    draft_token_cost: float = 0.0
    adaptive_decay: float = 0.7
    adaptive_probe: int = 16
    adaptive_probe_max: int = 128
    stage_draft_tokens: tuple[int, ...] | None = None

    def __post_init__(self):
        # Python callers may pass lists and numpy integers: keep the settings plain and hashable.
        for name in (
            "num_draft_tokens",
            "tree_width",
            "tree_budget",
            "suffix_max_match",
            "suffix_candidates",
            "suffix_group_rows",
            "suffix_history",
            "adaptive_probe",
            "adaptive_probe_max",
        ):
            if isinstance(getattr(self, name), np.integer):
                object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("ngram_sizes", "stage_draft_tokens"):
            if isinstance(getattr(self, name), (list, tuple)):
                items = (int(v) if isinstance(v, np.integer) else v for v in getattr(self, name))
                object.__setattr__(self, name, tuple(items))
        if isinstance(self.verify_token_cost, (list, tuple)):  # [rows, cost] pairs
            pairs = (tuple(pair) if isinstance(pair, (list, tuple)) else pair for pair in self.verify_token_cost)
            object.__setattr__(self, "verify_token_cost", tuple(pairs))

    def errors(self, prefix: str = "spec.", null: str = "null") -> list[tuple[str, str]]:
        """(key, message) for every setting out of range or of the wrong type, the key `prefix` +
        the field's name ("spec.tree_budget" in a config file, "Spec.tree_budget" for `Spec`);
        `null` spells None in the messages. The draft is checked where it is given: a config
        file's folder by `jaxspec train` before any compute, weights by `Spec`."""
        errors = []

        def need(ok: bool, name: str, message: str) -> None:
            if not ok:
                errors.append((prefix + name, message))

        need(
            self.method in ("none", *METHODS),
            "method",
            f"must be one of {list(METHODS)} (or 'none': no speculation), got {self.method!r}",
        )
        need(
            self.draft_sampling in DRAFT_SAMPLINGS,
            "draft_sampling",
            f"must be one of {list(DRAFT_SAMPLINGS)}, got {self.draft_sampling!r}",
        )
        need(
            self.method not in HISTORY_FREE or self.draft_sampling == "greedy",
            "draft_sampling",
            f"must be 'greedy' for method={self.method!r} (its drafts have no distribution to sample from)",
        )
        for name in ("num_draft_tokens", "tree_width", "suffix_max_match", "suffix_candidates"):
            value = getattr(self, name)
            need(_is_int(value) and value >= 1, name, f"must be an integer >= 1, got {value!r}")
        rows = self.suffix_group_rows
        need(
            rows is None or (_is_int(rows) and rows >= 1),
            "suffix_group_rows",
            f"must be {null} or an integer >= 1, got {rows!r}",
        )
        history = self.suffix_history
        need(_is_int(history) and history >= 0, "suffix_history", f"must be an integer >= 0, got {history!r}")
        need(isinstance(self.adaptive, bool), "adaptive", f"must be true or false, got {self.adaptive!r}")
        branches = self.suffix_branches
        need(isinstance(branches, bool), "suffix_branches", f"must be true or false, got {branches!r}")
        need(
            branches is not True or self.method == "eagle3",
            "suffix_branches",
            f"adds suffix branches to an EAGLE-3 head's tree: needs method 'eagle3', got {self.method!r}",
        )
        need(
            branches is not True or self.draft_sampling == "greedy",
            "draft_sampling",
            "must be 'greedy' with suffix_branches (sampled head drafts beside deterministic suffix "
            "drafts are not verified exactly)",
        )
        cost = self.draft_token_cost
        need(_is_number(cost) and cost >= 0, "draft_token_cost", f"must be a number >= 0, got {cost!r}")
        need(
            _is_cost_points(self.verify_token_cost),
            "verify_token_cost",
            "must be a number >= 0 or [rows, cost] pairs with integer rows >= 1 ascending and costs >= 0, got "
            + _shown(self.verify_token_cost),
        )
        decay = self.adaptive_decay
        need(_is_number(decay) and 0 <= decay < 1, "adaptive_decay", f"must be a number in [0, 1), got {decay!r}")
        probe = self.adaptive_probe
        need(_is_int(probe) and probe >= 1, "adaptive_probe", f"must be an integer >= 1, got {probe!r}")
        longest = self.adaptive_probe_max
        need(
            _is_int(longest) and _is_int(probe) and longest >= probe,
            "adaptive_probe_max",
            f"must be an integer >= adaptive_probe={probe!r}, got {longest!r}",
        )
        budget, width, k = self.tree_budget, self.tree_width, self.num_draft_tokens
        need(budget is None or _is_int(budget), "tree_budget", f"must be {null} or an integer, got {budget!r}")
        need(
            not (_is_int(budget) and _is_int(width)) or budget >= width,
            "tree_budget",
            f"must be {null} or >= {prefix}tree_width={width}, got {budget}",
        )
        sizes = self.ngram_sizes
        need(
            isinstance(sizes, tuple) and bool(sizes) and all(_is_int(n) and n >= 1 for n in sizes),
            "ngram_sizes",
            f"must be a non-empty list of integers >= 1, got {_shown(sizes)}",
        )
        depths = self.stage_draft_tokens
        need(
            depths is None
            or not _is_int(k)  # reported above
            or (isinstance(depths, tuple) and bool(depths) and all(_is_int(d) and 1 <= d <= k for d in depths)),
            "stage_draft_tokens",
            f"must be {null} or a non-empty list of depths in 1..{prefix}num_draft_tokens={k}, got {_shown(depths)}",
        )
        return errors

    @property
    def num_tree_nodes(self) -> int:
        """Draft nodes verified per step (the tree's root excluded), at the longest draft."""
        return self.tree_nodes(self.num_draft_tokens)

    def tree_nodes(self, depth: int) -> int:
        """Draft nodes of this tree shape drafted `depth` levels deep."""
        full = depth * self.tree_width * self.num_sources
        return full if self.tree_budget is None else min(self.tree_budget, full)

    def stage_depths(self, num_stages: int) -> tuple[int, ...]:
        """The draft depth of each of `num_stages` loop stages."""
        depths = self.stage_draft_tokens or (self.num_draft_tokens,)
        return tuple(depths[min(i, len(depths) - 1)] for i in range(num_stages))

    @property
    def num_sources(self) -> int:
        """Draft trees merged into the verified one: 2 with suffix_branches, else 1."""
        return 2 if self.suffix_branches is True else 1

    @property
    def drafts_suffixes(self) -> bool:
        """Whether the drafter reads the suffix sources (method suffix, or suffix_branches)."""
        return self.method == "suffix" or self.suffix_branches is True

    @property
    def stochastic(self) -> bool:
        return self.draft_sampling == "stochastic"


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class Spec:
    """Speculative decoding for `jaxspec.rollout.generate(..., spec=Spec(...))`:

        Spec(method, draft=None, *, num_draft_tokens=3, tree_width=1, tree_budget=None,
             draft_sampling="greedy", ngram_sizes=(3, 2, 1), suffix_max_match=8,
             suffix_candidates=16, suffix_group_rows=None, suffix_history=0,
             suffix_branches=False, adaptive=False,
             verify_token_cost=0.1, draft_token_cost=0.0, adaptive_decay=0.7, adaptive_probe=16,
             adaptive_probe_max=128, stage_draft_tokens=None)

    method and the keyword settings are those of `SpecConfig` (method "none" is spec=None);
    `Spec.from_config` takes a `SpecConfig` whole. Raises ValueError naming the setting
    ("Spec.tree_budget ...") that is out of range, or a draft that does not suit the method.

    config: the settings (`SpecConfig`; its `draft` is None). A Spec reads as them too:
        spec.num_draft_tokens is spec.config.num_draft_tokens.
    draft: the draft's weights: eagle3: (dcfg, dparams) from `jaxspec.draft` (with
        suffix_branches, optionally a third item: the earlier responses to the call's prompts, a
        `SuffixHistory`); draft_model: (ModelConfig, params); ngram: None; suffix: None, or the
        earlier responses to the call's prompts (`jaxspec.rollout.speculative.suffix.SuffixHistory`).

    Equality is identity (the draft holds arrays).
    """

    config: SpecConfig
    draft: Any

    def __init__(self, method: str, draft: Any = None, **settings):
        config = SpecConfig(method=method, **settings)
        errors = config.errors(prefix="Spec.", null="None")
        if errors:
            key, message = errors[0]
            raise ValueError(f"{key} {message}")
        if config.method == "none":
            raise ValueError(f"Spec.method must be one of {list(METHODS)}; spec=None samples autoregressively")
        if config.method == "ngram":
            if draft is not None:
                raise ValueError("Spec.draft must be None for method='ngram' (it drafts from the token history)")
        elif config.method == "suffix":
            if draft is not None and not isinstance(draft, SuffixHistory):
                raise ValueError(
                    f"Spec.draft must be None or a SuffixHistory for method='suffix', got {type(draft).__name__}"
                )
        elif config.suffix_branches and isinstance(draft, tuple) and len(draft) == 3:
            if draft[2] is not None and not isinstance(draft[2], SuffixHistory):
                raise ValueError(
                    f"Spec.draft[2] must be None or a SuffixHistory (the suffix branches' earlier responses), "
                    f"got {type(draft[2]).__name__}"
                )
        elif not (isinstance(draft, tuple) and len(draft) == 2):
            raise ValueError(
                f"Spec.draft must be a (config, params) pair for method={config.method!r}, got {type(draft).__name__}"
            )
        elif config.method == "draft_model" and not isinstance(draft[0], ModelConfig):
            raise ValueError(
                f"Spec.draft[0] must be a jaxspec.models.ModelConfig for method='draft_model', "
                f"got {type(draft[0]).__name__}"
            )
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "draft", draft)

    def __getattr__(self, name: str):
        if name.startswith("_") or name == "config":  # not a setting (or not built yet: copies)
            raise AttributeError(f"'Spec' object has no attribute {name!r}")
        try:
            return getattr(self.config, name)
        except AttributeError:
            raise AttributeError(f"'Spec' object has no attribute {name!r}") from None

    def with_draft(self, draft: Any) -> Spec:
        """This Spec with the draft weights `draft` in place of its own (the same settings)."""
        spec = copy.copy(self)
        object.__setattr__(spec, "draft", draft)
        return spec

    @classmethod
    def from_config(cls, config: SpecConfig, draft: Any = None) -> Spec:
        """The Spec of `config`'s settings drafting with the weights `draft` (config.draft, where a
        config file names the draft's folder, is not read)."""
        settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "draft"}
        return cls(draft=draft, **settings)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _is_cost_points(value) -> bool:
    """A number >= 0, or a non-empty sequence of (rows, cost) pairs: integer rows >= 1, strictly
    ascending, costs numbers >= 0 (`SpecConfig.verify_token_cost`)."""
    if _is_number(value):
        return value >= 0
    if not isinstance(value, tuple) or not value:
        return False
    if not all(isinstance(p, tuple) and len(p) == 2 and _is_int(p[0]) and _is_number(p[1]) for p in value):
        return False
    rows = [p[0] for p in value]
    return rows[0] >= 1 and all(a < b for a, b in zip(rows, rows[1:])) and all(p[1] >= 0 for p in value)


def _shown(value) -> str:
    """A list or tuple, of values or of pairs, as a config file writes it ([3, 2], [[1, 0.5]]);
    anything else as its repr."""
    if not isinstance(value, tuple):
        return repr(value)
    return repr([list(item) if isinstance(item, tuple) else item for item in value])
