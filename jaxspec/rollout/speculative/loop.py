"""The compiled speculative decode loop: draft -> verify -> commit, in one `lax.while_loop`.

Each iteration, for every row at once:
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
measured so far, depth 0 being an autoregressive step (the root verified alone).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec import kernels
from jaxspec.models.config import ModelConfig
from jaxspec.models.paged import PagedKVCache, paged_move
from jaxspec.models.sharding import KV_CACHE_AXES, Sharding, constrain
from jaxspec.models.transformer import KVCache, Params, extend
from jaxspec.rollout.experts import EXPERT_AXES, expert_buffer, write_experts
from jaxspec.rollout.sampling import Sampling, choose_tokens, processed_logprobs
from jaxspec.rollout.speculative.adaptive import AdaptiveDepth, DepthState, candidate_depths, choose, observe
from jaxspec.rollout.speculative.drafter import Drafter, Pooled, Prefill, Verified
from jaxspec.rollout.speculative.stats import Counts, count_step
from jaxspec.rollout.speculative.tree import DraftTree, ancestor_mask
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
    done: jax.Array  # bool [B]
    key: jax.Array
    counts: Counts
    experts: jax.Array | None  # [B, S, L_sparse, k] the recorded routing (`jaxspec.rollout.experts`), or None
    depths: DepthState | None  # an adaptive loop's measured acceptance (`adaptive`), or None


def commit_path(cache: KVCache | PagedKVCache, cache_len: jax.Array, path: jax.Array) -> KVCache | PagedKVCache:
    """Moves the KV of accepted tree nodes to consecutive slots (positions, in a paged cache).

    The verification forward wrote node n of row b at slot cache_len[b] + n; path int32 [B, E]
    lists accepted node ids from the root (-1 after). Afterwards slot cache_len[b] + i holds
    node path[b, i]. Entries past the path are left as they are (they lie past the new length).
    """
    rows = jnp.arange(path.shape[0])[:, None]
    offsets = jnp.arange(path.shape[1], dtype=jnp.int32)[None, :]
    src = cache_len[:, None] + jnp.where(path >= 0, path, offsets)
    dst = cache_len[:, None] + offsets
    if isinstance(cache, PagedKVCache):  # positions through the page table

        def move(buf: jax.Array) -> jax.Array:
            return paged_move(buf, cache.page_table, src, dst)

    else:

        def move(buf: jax.Array) -> jax.Array:
            return buf.at[rows, dst].set(buf[rows, src], mode="drop")

    return cache._replace(k=tuple(map(move, cache.k)), v=tuple(map(move, cache.v)))


def _root_alone(root: jax.Array) -> DraftTree:
    """The tree of an autoregressive step: the root int32 [B], no draft nodes."""
    column = jnp.zeros((root.shape[0], 1), jnp.int32)
    return DraftTree(
        tokens=root[:, None], parents=column - 1, depth=column, num_nodes=column[:, 0] + 1, draft_probs=None
    )


def _pad_to(x: jax.Array, size: int, axis: int, value) -> jax.Array:
    """`x` padded with `value` to `size` entries along `axis` (a shallower stage's tree)."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


class StepOutcome(NamedTuple):
    """One draft-and-verify step of B rows (W = max_depth + 1, the most tokens a step emits).

    cache, draft: the policy's cache (accepted nodes' KV at consecutive positions) and the
    drafter's state after the step; tree: the verified `DraftTree`; path int32 [B, W] accepted
    node ids from the root (-1 after); emitted int32 [B, W]: the accepted drafts then the next
    token (entry `accepted`), 0 after; logprobs float32 [B, W] log p of each emitted token, 0
    after; accepted int32 [B] draft tokens accepted; next_token int32 [B] the next root;
    node_experts: the tree nodes' routing [B, N, L_sparse, k] when recorded, else None.
    """

    cache: object
    draft: object
    tree: object
    path: jax.Array
    emitted: jax.Array
    logprobs: jax.Array
    accepted: jax.Array
    next_token: jax.Array
    node_experts: jax.Array | None


def speculative_step(
    cfg: ModelConfig,
    params: Params,
    sampling: Sampling,
    drafter: Drafter,
    dparams,
    cache,
    draft,
    root: jax.Array,
    cache_len: jax.Array,
    active: jax.Array,
    draft_key: jax.Array,
    verify,
    *,
    max_depth: int,
    chain: bool,
    sharding: Sharding | None = None,
    record: bool = False,
    drafts: bool = True,
) -> StepOutcome:
    """Steps 1-4 of the module docstring for rows root int32 [B] at cache_len int32 [B], the rows
    in active bool [B] still generating. cache: a dense `KVCache` or a `PagedKVCache`.
    verify(verify_logits [B, N, V], tree, temperature) -> `kernels.VerifyResult`: the exact
    acceptance (`kernels.tree_verify` with the step's key or keys). chain: the deepest drafter
    drafts chains (node n is node n - 1's only child); drafts=False verifies the root alone (an
    autoregressive step through the same code)."""
    width = max_depth + 1
    loop_rows = root.shape[0]
    steps = jnp.arange(width, dtype=jnp.int32)[None, :]
    with jax.named_scope("propose"):
        if drafts:
            draft, tree = drafter.propose(dparams, draft, root, cache_len, active, draft_key)
        else:
            if not getattr(drafter, "propose_keeps_state", False):  # e.g. a head's pending entries
                one = dataclasses.replace(drafter, depth=1, num_nodes=1)
                draft, _ = one.propose(dparams, draft, root, cache_len, active, draft_key)
            tree = _root_alone(root)
    with jax.named_scope("verify_forward"):
        logits, hidden, cache, *node_experts = extend(
            cfg,
            params,
            cache,
            tree.tokens,
            cache_len[:, None] + tree.depth,
            cache_len,
            tree_mask=None if chain else ancestor_mask(tree.parents, max_depth),
            active=active,
            hidden_layers=drafter.policy_layers,
            sharding=sharding,
            record_experts=record,
        )
    with jax.named_scope("verify"):
        if sampling.greedy:
            result = verify(logits, tree, 0.0)
        else:
            result = verify(processed_logprobs(logits, sampling), tree, 1.0)
    # A stage that drafts less deep than the deepest pads its outcome to the loop's width.
    path = _pad_to(result.path[:, :width], width, 1, -1)
    accepted, next_token = result.num_accepted, result.next_token
    committed = (
        _pad_to(tree.tokens[:, :width], width, 1, 0)
        if chain
        else jnp.take_along_axis(tree.tokens, jnp.maximum(path, 0), axis=1)
    )
    emitted = jnp.concatenate([committed[:, 1:], jnp.zeros((loop_rows, 1), jnp.int32)], axis=1)
    emitted = jnp.where(steps == accepted[:, None], next_token[:, None], emitted)
    node_hidden = (
        _pad_to(hidden[:, :, :width], width, 2, 0)
        if chain or hidden.shape[0] == 0
        else (jnp.take_along_axis(hidden, jnp.maximum(path, 0)[None, :, :, None], axis=2))
    )
    with jax.named_scope("draft_update"):
        draft = drafter.update(
            dparams,
            draft,
            Verified(
                committed=committed,
                next_root=next_token,
                num_accepted=accepted,
                cache_len=cache_len,
                hidden=node_hidden,
                active=active,
            ),
        )
    if not chain:  # a chain's accepted nodes already sit at consecutive slots
        with jax.named_scope("commit"):
            cache = commit_path(cache, cache_len, path)
    return StepOutcome(
        cache=cache,
        draft=draft,
        tree=tree,
        path=path,
        emitted=emitted,
        logprobs=_pad_to(result.logprobs[:, :width], width, 1, 0.0),
        accepted=accepted,
        next_token=next_token,
        node_experts=node_experts[0] if record else None,
    )


@functools.partial(
    jax.jit,
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
    `PromptBatch`. drafters: one per stage, alike but for their tree depth; their state is made by
    the deepest. max_depth: the deepest tree level of any stage (longest acceptable run);
    draft_len: cache slots of the drafter's own cache. stages: the loop's batch sizes as rows
    finish (`jaxspec.rollout.stages`), stages[0] = B; the drafter's state moves with its rows.
    prompt_experts: None, or the prefill's record [B, P, L_sparse, k] of the prompts' routing, to
    which each step adds the accepted path's (`jaxspec.rollout.experts`). adaptive: None drafts
    every stage's depth at every iteration; settings choose each iteration's depth (`adaptive`).
    Returns (tokens int32 [B, max_new_tokens], logprobs float32 [B, max_new_tokens], lengths int32 [B],
    the record [B, P + max_new_tokens, L_sparse, k] or None, Counts, loop iterations per stage int32
    [len(stages)], the B-row cache after the first stage: returned so that it updates the donated
    one in place).
    """
    num_rows, max_new = logits.shape[0], sampling.max_new_tokens
    record = prompt_experts is not None
    pad_id = cfg.pad_token_id or 0
    eos_ids = jnp.asarray(sampling.eos_id, jnp.int32)
    width = max_depth + 1  # most tokens one step emits
    steps = jnp.arange(width, dtype=jnp.int32)[None, :]
    deepest = max(drafters, key=lambda d: d.depth)
    chain = deepest.width == 1  # node n is node n - 1's only child: causal mask, the path is 0, 1, ...

    def step(drafter: Drafter, state: _LoopState, drafts: bool = True) -> _LoopState:
        """One iteration; drafts=False verifies the root alone (an autoregressive step)."""
        loop_rows = state.root.shape[0]
        rows = jnp.arange(loop_rows)[:, None]
        key, draft_key, verify_key = jax.random.split(state.key, 3)
        active = ~state.done

        def verify(verify_logits, tree, temperature):
            return kernels.tree_verify(
                verify_logits,
                tree.parents,
                tree.tokens,
                tree.num_nodes,
                verify_key,
                temperature=temperature,
                draft_probs=tree.draft_probs,
            )

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
            verify,
            max_depth=max_depth,
            chain=chain,
            sharding=sharding,
            record=record,
            drafts=drafts,
        )
        draft, draft_pool = (out.draft, None) if state.draft_pool is None else out.draft
        accepted = out.accepted
        eos = jnp.isin(out.emitted, eos_ids) & (steps <= accepted[:, None])
        first_eos = jnp.where(jnp.any(eos, axis=1), jnp.argmax(eos, axis=1), width)
        count = jnp.where(active, jnp.minimum(jnp.minimum(accepted + 1, first_eos + 1), max_new - state.lengths), 0)
        slots = jnp.where(steps < count[:, None], state.lengths[:, None] + steps, max_new)
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
            done=state.done | (active & ((first_eos < count) | (state.lengths + count >= max_new))),
            key=key,
            counts=count_step(state.counts, out.tree.parents, out.tree.num_nodes, out.path, accepted, active)._replace(
                depth_steps=state.counts.depth_steps.at[drafter.depth if drafts else 0].add(1)
            ),
            experts=experts,
            depths=state.depths,
        )

    def adaptive_step(drafter: Drafter, state: _LoopState) -> _LoopState:
        """One iteration at the depth `adaptive.choose` picks among the stage's candidates."""
        depths = candidate_depths(drafter.depth)
        branches = [
            functools.partial(step, dataclasses.replace(drafter, depth=d, num_nodes=adaptive.nodes(d)), drafts=d > 0)
            for d in depths
        ]
        index = choose(adaptive, state.depths, depths)
        new = jax.lax.switch(index, branches, state)
        return new._replace(depths=observe(adaptive, state.depths, state.counts, new.counts, index > 0))

    key, first_key = jax.random.split(key)
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
        done=jnp.isin(first, eos_ids) | (max_new == 1),
        key=key,
        counts=Counts.zeros(max_depth, deepest.depth),
        experts=expert_buffer(prompt_experts, prompt_experts.shape[1] + max_new, sharding) if record else None,
        depths=None if adaptive is None else DepthState.start(max_depth),
    )
    # Between stages the running rows move with their drafter state.
    recorded = ("experts",) if record else ()
    state, out, full_cache, stage_steps = run_in_stages(
        [functools.partial(step if adaptive is None else adaptive_step, drafter) for drafter in drafters],
        state,
        stages,
        ("root", "cache", "cache_len", "draft", "tokens", "logprobs", "lengths", "done", *recorded),
        lambda moved: moved._replace(
            cache=jax.tree.map(lambda buf: constrain(sharding, buf, KV_CACHE_AXES), moved.cache)
        ),
        outputs=("tokens", "logprobs", "lengths", *recorded),
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
