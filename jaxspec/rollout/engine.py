"""Autoregressive rollouts: shared prefill of distinct prompts, then one compiled decode loop.

`generate` prefills each distinct prompt once (GRPO repeats every prompt n times), at most
`PREFILL_CHUNK` prompts at a time, copies its KV rows to all the batch rows that carry it, and
runs a `jax.lax.while_loop` that appends one token per row per iteration, with no host round
trip, until every row has emitted an eos or `max_new_tokens` tokens. The steps read each attention
layer's q, k and v weights as one matrix (`jaxspec.rollout.weights`). The batch KV cache is
donated into the loop and updated in place. At RL batch sizes the loop runs in stages: once at
most half the rows still run, they move into a batch half the size (`jaxspec.rollout.stages`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.distributed import to_host
from jaxspec.models.config import ModelConfig
from jaxspec.models.kv_cache import KVCache
from jaxspec.models.params import Params
from jaxspec.models.sharding import KV_CACHE_AXES, Sharding, constrain
from jaxspec.models.transformer import extend
from jaxspec.rollout.compiler_options import rollout_jit
from jaxspec.rollout.continuous import slot_generate
from jaxspec.rollout.experts import EXPERT_AXES, expert_buffer, recorded_experts_bytes, write_experts
from jaxspec.rollout.memory import check_fits, rollout_memory_bytes
from jaxspec.rollout.output import RolloutOutput
from jaxspec.rollout.prefill import cache_shards, prefill_prompts
from jaxspec.rollout.prompts import group_prompts, row_limits, validate_prompts
from jaxspec.rollout.sampling import Sampling, choose_per_row, row_keys
from jaxspec.rollout.slot_layout import DEFAULT_PAGE_SIZE
from jaxspec.rollout.speculative.generate import speculative_generate
from jaxspec.rollout.speculative.slots import slot_speculative_generate
from jaxspec.rollout.stages import batch_stages, run_in_stages
from jaxspec.rollout.weights import rollout_spec, rollout_weights


def generate(
    cfg: ModelConfig,
    params: Params,
    prompts: Sequence[Sequence[int]],
    key: jax.Array,
    sampling: Sampling = Sampling(),
    spec=None,
    *,
    cache_dtype=None,
    sharding: Sharding | None = None,
    prompt_width: int = 1,
    record_experts: bool = False,
    slots: int | str | None = None,
    kv_pages: int | None = None,
    page_size: int = DEFAULT_PAGE_SIZE,
    decode_steps: int | None = None,
    row_max_new_tokens: Sequence[int] | None = None,
) -> RolloutOutput:
    """Samples a continuation of every prompt from the policy.

    prompts: B token-id lists, lengths may differ. key: PRNG key; all randomness derives from it.
    cache_dtype: KV cache dtype (default: the params' dtype). sharding: when given, the cache is
    laid out by `KV_CACHE_AXES` (with slots, the page pools by `KV_PAGES_AXES`) and the batch is
    sharded over the mesh's batch axes.
    Compiled programs are reused across calls with the same batch size, prompt-length bucket,
    distinct-prompt bucket and `sampling`. prompt_width: pad prompts as if the longest had this
    many tokens; a caller that knows its longest prompt passes it, so that every call shares one
    prompt-length bucket (one compilation).
    spec: None for autoregressive decoding, or a `jaxspec.rollout.Spec` for speculative decoding
        (the same distribution; `stats` then reports acceptance, see `speculative.stats.summarize`).
    record_experts: a mixture-of-experts policy's rollout also returns the experts its router chose
        at every position (`RolloutOutput.experts`, `jaxspec.rollout.experts`) for routing replay;
        False leaves the compiled programs as they are without it.
    slots: None runs the staged engine (a dense KV cache [B, P + N] for every row, the batch
        halved as rows finish; `jaxspec.rollout.stages`), which stays the default until GPU
        measurements show the slot engine faster everywhere; its autoregressive rows draw as the
        slot engine's do (below), so one key gives the same tokens on either. An integer S streams the rows through
        S decode slots over a paged KV cache in one compiled loop (`jaxspec.rollout.slots`):
        finished rows free their pages and slots for the next pending rows, so memory follows the
        live tokens, and the rows of one prompt share its prefix pages (prefilled once); row r's
        token i is drawn with fold_in(fold_in(key, r), i), so in float32 the same key gives the
        same tokens for any S. Autoregressive or speculative (every drafter), with or without
        record_experts. With a sharding the rows, slots and pages split into groups over the
        batch axes (data x fsdp) that divide both the rows and S, each group's pages on its own
        devices with the KV heads over the tensor axis (`jaxspec.rollout.slot_state`); the same
        tokens as on one device. "auto" picks S and the pool from the devices' free memory: the
        most slots (at most B) whose longest sequences all fit at once, so nothing is
        preempted, stated once on the "jaxspec.rollout" logger (`jaxspec.rollout.slot_memory`;
        on the CPU, which reports no free memory, 2 GiB per device are assumed).
    kv_pages: with an integer slots, the page pool (default: every slot's longest sequence, which
        never preempts); a smaller pool preempts the newest rows when it runs short and resumes
        them exactly. page_size: token positions per page. decode_steps: with slots, the decode
        steps between two rounds of scheduling (admissions, preemptions, releases; default
        `jaxspec.rollout.slot_layout.DECODE_STEPS`): more amortise the schedule's cost, fewer
        leave a finished row's slot idle for less long (at most decode_steps - 1 steps).
    row_max_new_tokens: B integers in [1, sampling.max_new_tokens], the most tokens each row may
        emit (a request's own max_tokens; default: sampling.max_new_tokens for every row). A row
        stopped at its limit holds the first tokens of the row it would be without one (the same
        draws; in the staged speculative loop, whose draws follow its batch, only greedily); the
        slot engine gives a row pages only up to its own longest sequence.
        sampling.max_new_tokens still sets the output's width N and the compiled shapes.
    Raises ValueError for an empty prompt list or prompt, slots neither None, "auto" nor an
    integer >= 1 (decode_steps likewise not an integer >= 1), row_max_new_tokens not B integers
    in [1, sampling.max_new_tokens], a kv_pages pool that cannot hold
    one row's longest sequence (or given with slots="auto"), a token or eos id outside the
    vocabulary, a prompt that with max_new_tokens exceeds the model context, a rollout that does
    not fit the device's free memory, a draft that does not fit the policy, or record_experts
    with a dense policy.
    """
    if not isinstance(sampling, Sampling):
        raise ValueError(f"sampling must be a jaxspec.rollout.Sampling, got {type(sampling).__name__}")
    eos_ids = sampling.eos_ids(cfg.eos_token_id)
    for eos in eos_ids:
        if not 0 <= eos < cfg.vocab_size:
            raise ValueError(f"eos_id {eos} is outside the vocabulary [0, {cfg.vocab_size})")
    sampling = dataclasses.replace(sampling, eos_id=eos_ids)
    if sampling.coupled and not sampling.greedy and spec is not None and spec.stochastic:
        raise ValueError(
            "Sampling.coupled needs deterministic drafts: Spec.draft_sampling='stochastic' draws its "
            "draft tokens from its own noise, so its rollouts cannot follow the autoregressive draws"
        )
    if record_experts and not cfg.sparse_layers:
        raise ValueError("record_experts: the policy is dense (no mixture-of-experts layers route tokens to experts)")
    checked = validate_prompts(cfg, prompts, sampling.max_new_tokens)
    limits = row_limits(row_max_new_tokens, len(checked), sampling.max_new_tokens)
    batch = group_prompts(checked, limits, prompt_width)
    params, spec = rollout_weights(params), rollout_spec(spec)  # q, k and v in one GEMM per layer
    cache_dtype = jnp.dtype(params["embed"].dtype if cache_dtype is None else cache_dtype)
    num_rows, padded_width = batch.row_prompt.shape[0], batch.tokens.shape[1]
    max_len = padded_width + sampling.max_new_tokens
    if slots is not None:
        paged = dict(slots=slots, cache_dtype=cache_dtype, kv_pages=kv_pages, page_size=page_size, sharding=sharding)
        paged |= dict(record_experts=record_experts, decode_steps=decode_steps)
        if spec is not None:
            return slot_speculative_generate(cfg, params, batch, key, sampling, spec, **paged)
        return slot_generate(cfg, params, batch, key, sampling, **paged)
    if spec is not None:
        return speculative_generate(
            cfg,
            params,
            batch,
            key,
            sampling,
            spec,
            cache_dtype=cache_dtype,
            sharding=sharding,
            record_experts=record_experts,
        )

    longest = int(batch.row_lengths.max())
    stages = batch_stages(num_rows, sharding)
    needed = rollout_memory_bytes(
        cfg, num_rows, longest, sampling.max_new_tokens, cache_dtype, batch.num_distinct, stage_rows=sum(stages[1:])
    )
    if record_experts:
        needed += recorded_experts_bytes(cfg, sum(stages), max_len)
    check_fits(
        needed // cache_shards(cfg, sharding, num_rows, max_len),
        jax.local_devices()[0].memory_stats(),
        batch=num_rows,
        prompt_len=longest,
        max_new_tokens=sampling.max_new_tokens,
    )

    def put(x: np.ndarray, axes: tuple[str, ...]) -> jax.Array:
        return jnp.asarray(x) if sharding is None else jax.device_put(x, sharding.named(axes, x.shape))

    cache, logits, _, *prompt_experts = prefill_prompts(
        cfg,
        params,
        put(batch.tokens, ("batch", "seq")),
        put(batch.lengths, ("batch",)),
        put(batch.row_prompt, ("batch",)),
        max_len=max_len,
        cache_dtype=cache_dtype,
        sharding=sharding,
        record_experts=record_experts,
    )
    tokens, logprobs, lengths, experts, stage_steps, _ = _decode(
        cfg,
        sampling,
        params,
        cache,
        logits,
        put(batch.row_lengths, ("batch",)),
        put(batch.row_max_new, ("batch",)),
        key,
        prompt_experts[0] if record_experts else None,
        sharding=sharding,
        stages=stages,
    )
    stage_steps = [int(n) for n in to_host(stage_steps)]
    stats = {
        "steps": sum(stage_steps),
        "stage_rows": list(stages),
        "stage_steps": stage_steps,
        "acceptance_length": 1.0,
        "acceptance_rate_per_position": np.zeros((0,), np.float32),
        "generated_tokens": int(to_host(lengths).sum()),
    }
    return RolloutOutput(tokens=tokens, lengths=lengths, logprobs=logprobs, stats=stats, experts=experts)


class _LoopState(NamedTuple):
    emitted: jax.Array  # int32 scalar: tokens emitted so far by rows still running
    last_token: jax.Array  # int32 [B]
    cache: KVCache
    cache_len: jax.Array  # int32 [B]: filled slots = position of last_token
    tokens: jax.Array  # int32 [B, N]
    logprobs: jax.Array  # float32 [B, N]
    lengths: jax.Array  # int32 [B]
    done: jax.Array  # bool [B]
    row: jax.Array  # int32 [B]: the call's index of each loop row (rows move between stages)
    experts: jax.Array | None  # [B, S, L_sparse, k] the recorded routing (`jaxspec.rollout.experts`), or None


@rollout_jit(static_argnames=("cfg", "sampling", "sharding", "stages"), donate_argnames=("cache",))
def _decode(
    cfg: ModelConfig,
    sampling: Sampling,
    params: Params,
    cache: KVCache,
    logits: jax.Array,
    cache_len: jax.Array,
    row_max_new: jax.Array,
    key: jax.Array,
    prompt_experts: jax.Array | None,
    *,
    sharding: Sharding | None,
    stages: tuple[int, ...],
):
    """Samples up to N = sampling.max_new_tokens tokens per row.

    cache: B rows of S slots, slots [0, cache_len[b]) hold row b's prompt (donated, updated in
    place); logits float32 [B, V] for the first new token; row_max_new int32 [B]: the most tokens
    each row emits (<= N); sampling.eos_id: the resolved tuple of
    eos ids. prompt_experts: None, or the prefill's record [B, P, L_sparse, k] of the prompts'
    routing, to which each step adds its token's (`jaxspec.rollout.experts`). stages: the loop's
    batch sizes as rows finish (`jaxspec.rollout.stages`), stages[0] = B.
    Returns (tokens int32 [B, N], logprobs float32 [B, N], lengths int32 [B], the record [B, S,
    L_sparse, k] or None, loop iterations per stage int32 [len(stages)], the B-row cache after
    the first stage: returned so that it updates the donated one in place).
    """
    num_rows, max_new = logits.shape[0], sampling.max_new_tokens
    record = prompt_experts is not None
    pad_id = cfg.pad_token_id or 0

    def is_eos(tokens: jax.Array) -> jax.Array:
        hit = jnp.zeros(tokens.shape, bool)
        for eos in sampling.eos_id:
            hit = hit | (tokens == eos)
        return hit

    def emit(state: _LoopState, logits: jax.Array) -> _LoopState:
        token, logprob = choose_per_row(row_keys(key, state.row, state.lengths), logits, sampling)
        active = ~state.done
        column = functools.partial(jax.lax.dynamic_update_slice_in_dim, start_index=state.emitted, axis=1)
        return state._replace(
            emitted=state.emitted + 1,
            last_token=jnp.where(active, token, state.last_token),
            tokens=column(state.tokens, jnp.where(active, token, pad_id)[:, None]),
            logprobs=column(state.logprobs, jnp.where(active, logprob, 0.0)[:, None]),
            lengths=state.lengths + active,
            done=state.done | (active & is_eos(token)) | (state.lengths + active >= row_max_new[state.row]),
        )

    def step(state: _LoopState) -> _LoopState:
        with jax.named_scope("forward"):
            step_logits, _, new_cache, *experts = extend(
                cfg,
                params,
                state.cache,
                state.last_token[:, None],
                state.cache_len[:, None],
                state.cache_len,
                active=~state.done,
                sharding=sharding,
                record_experts=record,
            )
        new_cache = jax.tree.map(lambda buf: constrain(sharding, buf, KV_CACHE_AXES), new_cache)
        if record:
            state = state._replace(
                experts=write_experts(state.experts, experts[0], state.cache_len, ~state.done[:, None], sharding)
            )
        state = state._replace(cache=new_cache, cache_len=state.cache_len + ~state.done)
        with jax.named_scope("sample"):
            return emit(state, step_logits[:, 0])

    state = _LoopState(
        emitted=jnp.zeros((), jnp.int32),
        last_token=jnp.zeros((num_rows,), jnp.int32),
        cache=cache,
        cache_len=cache_len.astype(jnp.int32),
        tokens=jnp.full((num_rows, max_new), pad_id, jnp.int32),
        logprobs=jnp.zeros((num_rows, max_new), jnp.float32),
        lengths=jnp.zeros((num_rows,), jnp.int32),
        done=jnp.zeros((num_rows,), bool),
        row=jnp.arange(num_rows, dtype=jnp.int32),
        experts=expert_buffer(prompt_experts, cache.max_len, sharding) if record else None,
    )
    state = emit(state, logits)
    recorded = ("experts",) if record else ()
    state, out, full_cache, stage_steps = run_in_stages(
        step,
        state,
        stages,
        ("last_token", "cache", "cache_len", "tokens", "logprobs", "lengths", "done", "row", *recorded),
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
        stage_steps,
        full_cache,
    )
