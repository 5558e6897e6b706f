"""The compiled speculative decode loop: draft -> verify -> commit, in one `lax.while_loop`.

Each iteration, for every row at once (one `jaxspec.rollout.speculative.step.speculative_step`, then
the loop's own bookkeeping):
  1. the drafter proposes a tree rooted at the row's last committed token;
  2. one policy forward (`extend`) runs all tree nodes with a tree attention mask (a node sees
     the prefix and its ancestors) at positions cache_len + depth, writing their KV at slots
     cache_len .. cache_len + N - 1;
  3. `jaxspec.kernels.tree_verify` accepts a path and samples the next token exactly from p;
  4. the accepted nodes' KV moves to consecutive slots, the accepted tokens and the next token
     are written to the outputs with their log-probs (an eos or max_new_tokens ends the row
     exactly there), and the drafter is updated. A rollout that records its routing
     (`jaxspec.rollout.experts`) writes the accepted nodes' experts at the positions their KV
     moves to.
Rows accept different numbers of tokens; finished rows keep computing with frozen state until
the loop moves the running rows into a smaller batch (`jaxspec.rollout.stages`). An adaptive loop
(`jaxspec.rollout.speculative.adaptive`) runs each iteration at a depth chosen from the acceptance
measured so far, depth 0 being an autoregressive step (the root verified alone, its next token
sampled as the autoregressive loop samples it); a run of depth-0 iterations up to the next probe
is an inner `while_loop` of such steps, with no branch to take in each.

Randomness: each iteration's draft and verification keys are split from the previous one's, so a
row's draws follow the batch it runs in; with `Sampling.coupled` token 0 and every verified node
are drawn under the autoregressive engine's key of the row and the token's position instead
(`sampling.depth_keys`), so the rollout is the autoregressive rollout of the same key.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.models.config import ModelConfig
from jaxspec.models.kv_cache import KVCache
from jaxspec.models.params import Params
from jaxspec.models.sharding import KV_CACHE_AXES, Sharding, constrain
from jaxspec.rollout.branch import run_if
from jaxspec.rollout.compiler_options import rollout_jit
from jaxspec.rollout.experts import EXPERT_AXES, expert_buffer, write_experts
from jaxspec.rollout.sampling import Sampling, choose_per_row, choose_tokens, depth_keys, row_keys
from jaxspec.rollout.speculative.adaptive import AdaptiveDepth, DepthState, candidate_depths, choose, observe
from jaxspec.rollout.speculative.drafter import Drafter, Pooled, Prefill
from jaxspec.rollout.speculative.stats import Counts, count_step
from jaxspec.rollout.speculative.step import speculative_step
from jaxspec.rollout.stages import run_in_stages


class _LoopState(NamedTuple):
    root: jax.Array  # int32 [B]: last committed token, not yet in the cache
    cache: KVCache
    cache_len: jax.Array  # int32 [B]: filled slots = position of root
    draft: object  # the drafter's state (its batch-major part, `Pooled.rows`, when it has a pool)
    draft_pool: object  # the call-wide part of a `Pooled` drafter state (never moved), or None
    tokens: jax.Array  # int32 [B, max_new]
    logprobs: jax.Array  # float32 [B, max_new]
    lengths: jax.Array  # int32 [B]
    limit: jax.Array  # int32 [B]: the most tokens the row emits
    done: jax.Array  # bool [B]
    row: jax.Array  # int32 [B]: the call's index of each loop row (rows move between stages)
    key: jax.Array
    counts: Counts
    experts: jax.Array | None  # [B, S, L_sparse, k] the recorded routing (`jaxspec.rollout.experts`), or None
    depths: DepthState | None  # an adaptive loop's measured acceptance (`adaptive`), or None


@rollout_jit(
    static_argnames=(
        "cfg",
        "sampling",
        "drafters",
        "max_depth",
        "draft_len",
        "cache_dtype",
        "sharding",
        "stages",
        "adaptive",
    ),
    donate_argnames=("cache",),
)
def speculative_decode(
    cfg: ModelConfig,
    sampling: Sampling,
    drafters: tuple[Drafter, ...],
    params: Params,
    dparams,
    cache: KVCache,
    logits: jax.Array,
    policy_hidden: jax.Array,
    prompt_tokens: jax.Array,
    prompt_lengths: jax.Array,
    row_prompt: jax.Array,
    row_lengths: jax.Array,
    row_max_new: jax.Array,
    key: jax.Array,
    prompt_experts: jax.Array | None,
    *,
    max_depth: int,
    draft_len: int,
    cache_dtype,
    sharding: Sharding | None,
    stages: tuple[int, ...],
    adaptive: AdaptiveDepth | None = None,
):
    """Samples up to sampling.max_new_tokens tokens per row with speculative steps.

    cache: the policy's prefilled cache (B rows; donated), with at least N spare slots past the
    longest rollout; logits float32 [B, V] for the first new token; policy_hidden: the policy's
    `drafter.policy_layers` outputs over the distinct prompts [n, U, P, H]; prompt_tokens int32
    [U, P], prompt_lengths int32 [U], row_prompt int32 [B], row_lengths int32 [B] as in
    `PromptBatch`; row_max_new int32 [B]: the most tokens each row emits (<= N). drafters: one per
    stage, alike but for their tree depth; their state is made by the deepest. max_depth: the
    deepest tree level of any stage (longest acceptable run); draft_len: cache slots of the
    drafter's own cache. stages: the loop's batch sizes as rows finish (`jaxspec.rollout.stages`),
    stages[0] = B; the drafter's state moves with its rows.
    prompt_experts: None, or the prefill's record [B, P, L_sparse, k] of the prompts' routing, to
    which each step adds the accepted path's (`jaxspec.rollout.experts`). adaptive: None drafts
    every stage's depth at every iteration; settings choose each iteration's depth (`adaptive`).
    Returns (tokens int32 [B, max_new_tokens], logprobs float32 [B, max_new_tokens], lengths int32 [B],
    the record [B, P + max_new_tokens, L_sparse, k] or None, Counts, loop iterations per stage int32
    [len(stages)], the B-row cache after the first stage: returned so that it updates the donated
    one in place).
    """
    num_rows, max_new = logits.shape[0], sampling.max_new_tokens
    call_key = key  # coupled draws key each token by (row, position) from the call's key
    record = prompt_experts is not None
    pad_id = cfg.pad_token_id or 0
    eos_ids = jnp.asarray(sampling.eos_id, jnp.int32)
    width = max_depth + 1  # most tokens one step emits
    steps = jnp.arange(width, dtype=jnp.int32)[None, :]
    deepest = max(drafters, key=lambda d: d.depth)
    chain = deepest.width == 1  # node n is node n - 1's only child: causal mask, the path is 0, 1, ...

    def step(drafter: Drafter, state: _LoopState, drafts: bool = True) -> _LoopState:
        """One iteration; drafts=False verifies the root alone (an autoregressive step, which its caller
        counts in `depth_steps`)."""
        loop_rows = state.root.shape[0]
        rows = jnp.arange(loop_rows)[:, None]
        key, draft_key, verify_key = jax.random.split(state.key, 3)
        if sampling.coupled:  # the autoregressive engine's keys of the tokens the step may emit
            verify_key = depth_keys(call_key, state.row, state.lengths, max_depth)
        active = ~state.done

        pooled = state.draft if state.draft_pool is None else Pooled(state.draft, state.draft_pool)
        out = speculative_step(
            cfg,
            params,
            sampling,
            drafter,
            dparams,
            state.cache,
            pooled,
            state.root,
            state.cache_len,
            active,
            draft_key,
            verify_key,
            max_depth=max_depth,
            chain=chain,
            sharding=sharding,
            record=record,
            drafts=drafts,
        )
        draft, draft_pool = (out.draft, None) if state.draft_pool is None else out.draft
        accepted = out.accepted
        at = steps[:, : out.emitted.shape[1]]  # the step's emitted columns (one without drafts)
        eos = jnp.isin(out.emitted, eos_ids) & (at <= accepted[:, None])
        first_eos = jnp.where(jnp.any(eos, axis=1), jnp.argmax(eos, axis=1), width)
        count = jnp.where(active, jnp.minimum(jnp.minimum(accepted + 1, first_eos + 1), state.limit - state.lengths), 0)
        slots = jnp.where(at < count[:, None], state.lengths[:, None] + at, max_new)
        if drafts:
            counts = count_step(state.counts, out.tree.parents, out.tree.num_nodes, out.path, accepted, active)
        else:  # a lone root: a verified row-step, nothing drafted
            counts = state.counts._replace(row_steps=state.counts.row_steps + jnp.sum(active, dtype=jnp.int32))
        experts = state.experts
        if record:  # the accepted path's experts at the positions its KV now holds
            path = out.path
            path_experts = jnp.take_along_axis(out.node_experts, jnp.maximum(path, 0)[:, :, None, None], axis=1)
            experts = write_experts(experts, path_experts, state.cache_len, active[:, None] & (path >= 0), sharding)
        return _LoopState(
            root=jnp.where(active, out.next_token, state.root),
            cache=jax.tree.map(lambda buf: constrain(sharding, buf, KV_CACHE_AXES), out.cache),
            cache_len=state.cache_len + jnp.where(active, accepted + 1, 0),
            draft=draft,
            draft_pool=draft_pool,
            tokens=state.tokens.at[rows, slots].set(out.emitted, mode="drop"),
            logprobs=state.logprobs.at[rows, slots].set(out.logprobs, mode="drop"),
            lengths=state.lengths + count,
            limit=state.limit,
            done=state.done | (active & ((first_eos < count) | (state.lengths + count >= state.limit))),
            row=state.row,
            key=key,
            counts=counts._replace(depth_steps=counts.depth_steps.at[drafter.depth].add(1)) if drafts else counts,
            experts=experts,
            depths=state.depths,
        )

    def adaptive_step(drafter: Drafter, state: _LoopState, stage_runs) -> tuple[_LoopState, jax.Array]:
        """One drafting iteration at the depth `adaptive.choose` picks among the stage's candidates
        or, where it picks depth 0, the run of autoregressive iterations up to the next probe, for
        as long as the stage runs (`stage_runs(state)`, `run_in_stages`). Returns (state, int32
        scalar iterations run)."""
        depths = candidate_depths(drafter.depth)
        at_depth = [dataclasses.replace(drafter, depth=d, num_nodes=adaptive.nodes(d)) for d in depths]
        index = choose(adaptive, state.depths, depths, state.root.shape[0])  # the stage's batch runs the step

        def drafting(drafter: Drafter, state: _LoopState) -> _LoopState:
            new = step(drafter, state)
            return new._replace(depths=observe(adaptive, state.depths, state.counts, new.counts, True))

        # Depth 0 tests no draft, so the rates stay and `choose` keeps picking it until the probe:
        # the run is a plain loop of autoregressive iterations, without a branch in each. The run
        # and each drafting depth (`run_if`) follow one another, not branches of a switch, which
        # XLA would copy every KV cache through.
        run = jnp.where(index == 0, state.depths.before_probe(), 0)
        new, ran = jax.lax.while_loop(
            lambda c: (c[1] < run) & stage_runs(c[0]),
            lambda c: (step(at_depth[0], c[0], drafts=False), c[1] + 1),
            (state, jnp.zeros((), jnp.int32)),
        )
        # The run's depth-0 iterations are counted once, not by a scatter in each of them.
        counts = new.counts._replace(depth_steps=new.counts.depth_steps.at[0].add(ran))
        new = new._replace(counts=counts, depths=state.depths._replace(since_draft=state.depths.since_draft + ran))
        for i, drafter_at in enumerate(at_depth[1:], start=1):
            new = run_if(index == i, functools.partial(drafting, drafter_at), new)
        return new, jnp.where(index > 0, 1, ran)

    key, first_key = jax.random.split(key)
    all_rows = jnp.arange(num_rows, dtype=jnp.int32)
    if sampling.coupled:  # token 0 as the autoregressive engine draws it
        first, first_logprob = choose_per_row(row_keys(call_key, all_rows, jnp.zeros_like(all_rows)), logits, sampling)
    else:
        first, first_logprob = choose_tokens(first_key, logits, sampling)
    prefill = Prefill(
        prompt_tokens=prompt_tokens,
        prompt_lengths=prompt_lengths,
        row_prompt=row_prompt,
        row_lengths=row_lengths,
        first_token=first,
        policy_hidden=policy_hidden,
        max_len=draft_len,
        cache_dtype=cache_dtype,
        sharding=sharding,
    )
    draft = deepest.init(dparams, prefill)
    draft, draft_pool = (draft.rows, draft.pool) if isinstance(draft, Pooled) else (draft, None)
    state = _LoopState(
        root=first,
        cache=cache,
        cache_len=row_lengths.astype(jnp.int32),
        draft=draft,
        draft_pool=draft_pool,
        tokens=jnp.full((num_rows, max_new), pad_id, jnp.int32).at[:, 0].set(first),
        logprobs=jnp.zeros((num_rows, max_new), jnp.float32).at[:, 0].set(first_logprob),
        lengths=jnp.ones((num_rows,), jnp.int32),
        limit=row_max_new.astype(jnp.int32),
        done=jnp.isin(first, eos_ids) | (row_max_new <= 1),
        row=all_rows,
        key=key,
        counts=Counts.zeros(max_depth, deepest.depth),
        experts=expert_buffer(prompt_experts, prompt_experts.shape[1] + max_new, sharding) if record else None,
        depths=None if adaptive is None else DepthState.start(max_depth, adaptive),
    )
    # Between stages the running rows move with their drafter state.
    recorded = ("experts",) if record else ()
    state, out, full_cache, stage_steps = run_in_stages(
        [functools.partial(step if adaptive is None else adaptive_step, drafter) for drafter in drafters],
        state,
        stages,
        ("root", "cache", "cache_len", "draft", "tokens", "logprobs", "lengths", "limit", "done", "row", *recorded),
        lambda moved: moved._replace(
            cache=jax.tree.map(lambda buf: constrain(sharding, buf, KV_CACHE_AXES), moved.cache)
        ),
        outputs=("tokens", "logprobs", "lengths", *recorded),
        counted=adaptive is not None,
    )
    batch_axes = ("batch", None)
    experts = constrain(sharding, out["experts"], EXPERT_AXES) if record else None
    return (
        constrain(sharding, out["tokens"], batch_axes),
        constrain(sharding, out["logprobs"], batch_axes),
        out["lengths"],
        experts,
        state.counts,
        stage_steps,
        full_cache,
    )
