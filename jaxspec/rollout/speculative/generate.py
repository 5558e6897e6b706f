"""Speculative rollouts: build the drafter from a `Spec`, prefill, run the compiled loop, report."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.models.config import ModelConfig
from jaxspec.models.kv_cache import cache_bytes
from jaxspec.models.params import Params
from jaxspec.models.sharding import Sharding
from jaxspec.rollout.experts import recorded_experts_bytes
from jaxspec.rollout.memory import check_fits, rollout_memory_bytes
from jaxspec.rollout.output import RolloutOutput
from jaxspec.rollout.prefill import cache_shards, prefill_prompts
from jaxspec.rollout.prompts import PromptBatch
from jaxspec.rollout.sampling import Sampling
from jaxspec.rollout.speculative.adaptive import AdaptiveDepth, cost_points
from jaxspec.rollout.speculative.draft_model import DraftModelDrafter
from jaxspec.rollout.speculative.drafter import Drafter
from jaxspec.rollout.speculative.hybrid import HybridSources, hybrid_drafter
from jaxspec.rollout.speculative.loop import speculative_decode
from jaxspec.rollout.speculative.ngram import NgramDrafter
from jaxspec.rollout.speculative.spec import Spec
from jaxspec.rollout.speculative.stats import summarize
from jaxspec.rollout.speculative.suffix import SuffixDrafter, suffix_sources
from jaxspec.rollout.stages import batch_stages

_F32 = 4


def make_drafter(
    cfg: ModelConfig, params: Params, sampling: Sampling, spec: Spec, sharding: Sharding | None = None
) -> tuple[Drafter, object]:
    """(drafter, the pytree its methods take as dparams) for policy `cfg`; ValueError when the
    draft does not fit the policy (naming the mismatched dimension). The suffix drafter's dparams
    depend on the call's rows: `speculative_generate` makes them (`suffix_sources`)."""
    if not isinstance(spec, Spec):
        raise ValueError(f"spec must be a jaxspec.rollout.Spec or None, got {type(spec).__name__}")
    shape = dict(depth=spec.num_draft_tokens, width=spec.tree_width, num_nodes=spec.num_tree_nodes)
    if spec.method == "ngram":
        return NgramDrafter(sizes=spec.ngram_sizes, **shape), None
    if spec.method == "suffix":
        return SuffixDrafter(max_match=spec.suffix_max_match, num_candidates=spec.suffix_candidates, **shape), None
    dcfg, dparams = spec.draft[:2]
    if spec.method == "draft_model":
        if dcfg.vocab_size != cfg.vocab_size:
            raise ValueError(
                f"Spec.draft: the draft model's vocab_size {dcfg.vocab_size} differs from the "
                f"policy's {cfg.vocab_size}; draft_model needs the same vocabulary"
            )
        _check_width(spec, dcfg.vocab_size)
        return DraftModelDrafter(
            cfg=dcfg, sampling=sampling, stochastic=spec.stochastic, sharding=sharding, **shape
        ), dparams
    from jaxspec.draft import DraftConfig, check_compatible
    from jaxspec.rollout.speculative.eagle3 import Eagle3Drafter

    if not isinstance(dcfg, DraftConfig):
        raise ValueError(
            f"Spec.draft[0] must be a jaxspec.draft.DraftConfig for method='eagle3', got {type(dcfg).__name__}"
        )
    try:
        check_compatible(cfg, dcfg)
    except ValueError as err:
        raise ValueError(f"Spec.draft: the EAGLE-3 head does not fit the policy: {err}") from None
    dcfg = dcfg.for_layers_of(cfg)  # a head that names no aux layers reads the policy's defaults
    if dparams["lm_head"].shape != (dcfg.hidden_size, dcfg.draft_vocab_size):
        raise ValueError(
            f"Spec.draft: lm_head has shape {dparams['lm_head'].shape}, the head's config says "
            f"(hidden_size, draft_vocab_size) = ({dcfg.hidden_size}, {dcfg.draft_vocab_size})"
        )
    _check_width(spec, dcfg.draft_vocab_size)
    # An adaptive loop's autoregressive iterations queue the head's entries (a hybrid's head runs them).
    backlog = spec.adaptive_probe_max if spec.adaptive and not spec.suffix_branches else 0
    drafter = Eagle3Drafter(
        dcfg=dcfg, sampling=sampling, stochastic=spec.stochastic, sharding=sharding, backlog=backlog, **shape
    )
    head_params = {"head": dparams, "embed": params["embed"]}
    if spec.suffix_branches:
        return hybrid_drafter(drafter, spec), head_params
    return drafter, head_params


def adaptive_depth(spec: Spec) -> AdaptiveDepth | None:
    """The loop's depth-choice settings of `spec` (None: spec.adaptive is off)."""
    if not spec.adaptive:
        return None
    return AdaptiveDepth(
        tree_width=spec.tree_width * spec.num_sources,
        tree_budget=spec.tree_budget,
        verify_token_cost=cost_points(spec.verify_token_cost),
        draft_token_cost=float(spec.draft_token_cost),
        decay=float(spec.adaptive_decay),
        probe_interval=spec.adaptive_probe,
        probe_max=spec.adaptive_probe_max,
    )


def with_call_sources(cfg: ModelConfig, spec: Spec, batch: PromptBatch, dparams):
    """The drafter's dparams for a call of `batch`'s rows: a suffix-drafting spec's (method suffix:
    `SuffixSources`; suffix_branches: `HybridSources`) read the call's groups of rows and the
    earlier responses the spec holds (`suffix_sources`); other dparams are returned as they are."""
    if not spec.drafts_suffixes:
        return dparams
    history = spec.draft if spec.method == "suffix" else (spec.draft[2:] or (None,))[0]
    sources = suffix_sources(history, batch.row_prompt, spec.suffix_group_rows, cfg.vocab_size)
    return sources if spec.method == "suffix" else HybridSources(dparams, sources)


def suffix_sources_bytes(spec: Spec, dparams, rows: int, row_len: int) -> int:
    """Bytes of a suffix-drafting step's gathered sources and the buffers matched over them, for
    `rows` rows drafting from rows of `row_len` token slots (dparams: `with_call_sources`')."""
    sources = dparams if spec.method == "suffix" else dparams.suffix
    history = sources.history.tokens.shape
    slots = (1 + sources.siblings.shape[1]) * row_len + history[1] * history[2]
    return 4 * _F32 * rows * slots


def _check_width(spec: Spec, draft_vocab: int) -> None:
    if spec.tree_width > draft_vocab:
        raise ValueError(f"Spec.tree_width={spec.tree_width} exceeds the draft vocabulary ({draft_vocab} tokens)")


def speculative_memory_bytes(
    cfg: ModelConfig,
    batch: int,
    prompt_len: int,
    max_new_tokens: int,
    spec: Spec,
    cache_dtype,
    num_distinct: int,
    stage_rows: int = 0,
) -> int:
    """Device bytes a speculative rollout allocates beyond the params (an estimate).

    The autoregressive estimate (`rollout_memory_bytes`) with the cache grown by the tree's spare
    slots, plus the verification forward's float32 buffers for the other tree nodes (logits,
    processed log-probs, attention over the cache, MLP), draft distributions for stochastic
    drafts, and the draft model's or EAGLE-3 head's own cache (and an adaptive head's queue);
    caches also for the `stage_rows` rows of the smaller batches the loop moves into
    (`jaxspec.rollout.stages`).
    """
    nodes = 1 + spec.num_tree_nodes
    extra = nodes + spec.num_draft_tokens * spec.tree_width
    needed = rollout_memory_bytes(cfg, batch, prompt_len, max_new_tokens + extra, cache_dtype, num_distinct, stage_rows)
    slots = prompt_len + max_new_tokens + extra
    per_node = 4 * cfg.vocab_size + 2 * cfg.num_heads * slots + 2 * cfg.intermediate_size
    needed += _F32 * batch * (nodes - 1) * per_node
    if spec.stochastic:
        needed += 2 * _F32 * batch * (1 + spec.num_draft_tokens * spec.tree_width) * cfg.vocab_size
    if spec.method == "draft_model":
        needed += cache_bytes(spec.draft[0], batch + stage_rows, slots, cache_dtype)
    if spec.method == "eagle3":
        needed += cache_bytes(spec.draft[0].layer_config, batch + stage_rows, slots, cache_dtype)
    return needed + head_queue_bytes(spec, batch + stage_rows)


def head_queue_bytes(spec: Spec, rows: int) -> int:
    """Bytes of an adaptive EAGLE-3 head's queue of features (the policy's three layers) for
    `rows` rows (`Eagle3Drafter.defer`) and of its copy padded to whole pieces when it runs; 0 for
    other drafters."""
    if spec.method != "eagle3" or not spec.adaptive or spec.suffix_branches:
        return 0
    from jaxspec.rollout.speculative.eagle3 import piece_layout, queue_piece

    entries = spec.adaptive_probe_max
    _, padded = piece_layout(entries, queue_piece(spec.draft[0]))
    return _F32 * rows * (entries + padded) * 3 * spec.draft[0].hidden_size


def speculative_generate(
    cfg: ModelConfig,
    params: Params,
    batch: PromptBatch,
    key: jax.Array,
    sampling: Sampling,
    spec: Spec,
    *,
    cache_dtype,
    sharding: Sharding | None,
    record_experts: bool = False,
) -> RolloutOutput:
    """`jaxspec.rollout.generate` with `spec`: prompts already validated and grouped into `batch`,
    `sampling.eos_id` resolved to a tuple."""
    drafter, dparams = make_drafter(cfg, params, sampling, spec, sharding)
    dparams = with_call_sources(cfg, spec, batch, dparams)
    num_rows, prompt_width = batch.row_prompt.shape[0], batch.tokens.shape[1]
    stages = batch_stages(num_rows, sharding)
    depths = spec.stage_depths(len(stages))
    drafters = tuple(dataclasses.replace(drafter, depth=depth, num_nodes=spec.tree_nodes(depth)) for depth in depths)
    max_depth = min(max(depths), spec.tree_nodes(max(depths)))  # the longest run any stage can accept
    max_new = sampling.max_new_tokens
    policy_len = prompt_width + max_new + 1 + spec.num_tree_nodes  # the verify forward writes N slots
    draft_len = prompt_width + max_new + 1 + spec.num_draft_tokens * spec.tree_width  # the drafter's tree
    longest = int(batch.row_lengths.max())
    needed = speculative_memory_bytes(
        cfg, num_rows, longest, max_new, spec, cache_dtype, batch.num_distinct, sum(stages[1:])
    )
    if spec.drafts_suffixes:
        needed += suffix_sources_bytes(spec, dparams, num_rows, draft_len)
    if record_experts:
        needed += recorded_experts_bytes(cfg, sum(stages), prompt_width + max_new)
    check_fits(
        needed // cache_shards(cfg, sharding, num_rows, policy_len),
        jax.local_devices()[0].memory_stats(),
        batch=num_rows,
        prompt_len=longest,
        max_new_tokens=max_new,
    )

    def put(x, axes: tuple[str, ...]) -> jax.Array:
        return jnp.asarray(x) if sharding is None else jax.device_put(x, sharding.named(axes, x.shape))

    prompt_tokens, prompt_lengths = put(batch.tokens, ("batch", "seq")), put(batch.lengths, ("batch",))
    row_prompt, row_lengths = put(batch.row_prompt, ("batch",)), put(batch.row_lengths, ("batch",))
    cache, logits, policy_hidden, *prompt_experts = prefill_prompts(
        cfg,
        params,
        prompt_tokens,
        prompt_lengths,
        row_prompt,
        max_len=policy_len,
        cache_dtype=cache_dtype,
        sharding=sharding,
        hidden_layers=drafter.policy_layers,
        record_experts=record_experts,
    )
    tokens, logprobs, lengths, experts, counts, stage_steps, _ = speculative_decode(
        cfg,
        sampling,
        drafters,
        params,
        dparams,
        cache,
        logits,
        policy_hidden,
        prompt_tokens,
        prompt_lengths,
        row_prompt,
        row_lengths,
        put(batch.row_max_new, ("batch",)),
        key,
        prompt_experts[0] if record_experts else None,
        max_depth=max_depth,
        draft_len=draft_len,
        cache_dtype=cache_dtype,
        sharding=sharding,
        stages=stages,
        adaptive=adaptive_depth(spec),
    )
    return RolloutOutput(
        tokens=tokens,
        lengths=lengths,
        logprobs=logprobs,
        stats=summarize(counts, lengths, max_depth, stages, stage_steps),
        experts=experts,
    )
