"""The drafter interface: pure functions over a pytree state, driven by the speculative loop.

A drafter is a frozen (hashable) dataclass holding only static settings, so it can be a
`jax.jit` static argument; its weights travel separately as `dparams` (None when it has none).

    state = drafter.init(dparams, prefill)                    # once, after the policy's prefill
    state, tree = drafter.propose(dparams, state, root, cache_len, active, key)
    state = drafter.update(dparams, state, verified)          # after each verification

A state may be `Pooled(rows, pool)`: the loop moves `rows` (batch-major) with its rows into a
smaller stage batch and keeps `pool` (call-wide, e.g. every row's tokens by original row) as is.

A drafter whose `propose` returns its state unchanged says so with `propose_keeps_state = True`;
an autoregressive iteration of an adaptive loop then skips it. One with `defers = True` (an EAGLE-3
head with a backlog) is not proposed to either, and gets `state = drafter.defer(dparams, state,
verified)` in place of `update`: it queues the step's entry for its next proposal. Others run a
depth-1 proposal to keep their state in step (e.g. a draft model's pending tokens).

`drafter.policy_layers` lists the policy layers whose outputs `update` receives in
`verified.hidden` (empty when the drafter does not read the policy's hidden states).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp

from jaxspec.models.sharding import Sharding
from jaxspec.rollout.speculative.tree import DraftTree


class Prefill(NamedTuple):
    """What drafters start from (B rows, U distinct prompts padded to P tokens).

    prompt_tokens int32 [U, P]; prompt_lengths int32 [U]; row_prompt int32 [B];
    row_lengths int32 [B]; first_token int32 [B]: the token sampled from the prefill logits,
    the root of the first tree; policy_hidden [len(policy_layers), U, P, H]: the policy's layer
    outputs over each distinct prompt (empty when the drafter reads none); max_len: cache slots
    a drafter's KV cache needs; cache_dtype; sharding.
    """

    prompt_tokens: jax.Array
    prompt_lengths: jax.Array
    row_prompt: jax.Array
    row_lengths: jax.Array
    first_token: jax.Array
    policy_hidden: jax.Array
    max_len: int
    cache_dtype: object
    sharding: Sharding | None


class Pooled(NamedTuple):
    """A drafter state in two parts: rows (batch-major: moves with its rows between loop stages)
    and pool (call-wide: the loop never moves it)."""

    rows: object
    pool: object


class Verified(NamedTuple):
    """The outcome of one verification step (E = longest accepted path + 1).

    committed int32 [B, E]: [root, accepted drafts...] now in the policy's KV cache at slots
        cache_len .. cache_len + num_accepted; entries past num_accepted are padding.
    next_root int32 [B]: the token sampled after the accepted run, the next tree's root.
    num_accepted int32 [B]; cache_len int32 [B]: the policy cache length before this step.
    hidden [len(policy_layers), B, E, H]: the policy's layer outputs at the committed tokens.
    active bool [B]: rows that were still generating (others must be left as they are).
    """

    committed: jax.Array
    next_root: jax.Array
    num_accepted: jax.Array
    cache_len: jax.Array
    hidden: jax.Array
    active: jax.Array


def new_tokens(verified: Verified) -> jax.Array:
    """int32 [B, E]: the tokens one step appends after the old root, i.e. the accepted drafts then
    the next root (entry num_accepted); entries past it are 0."""
    batch, width = verified.committed.shape
    steps = jnp.arange(width, dtype=jnp.int32)[None, :]
    shifted = jnp.concatenate([verified.committed[:, 1:], jnp.zeros((batch, 1), jnp.int32)], axis=1)
    return jnp.where(steps == verified.num_accepted[:, None], verified.next_root[:, None], shifted)


def defers_step(drafter, drafts: bool) -> bool:
    """Whether a step that drafts (or, drafts=False, verifies the root alone) calls the drafter's
    `defer` in place of `propose` and `update`: an autoregressive step of a deferring drafter."""
    return not drafts and getattr(drafter, "defers", False)


class Drafter(Protocol):
    policy_layers: tuple[int, ...]
    depth: int  # tree levels below the root
    width: int  # children per tree node (1: chains)

    def init(self, dparams, prefill: Prefill): ...

    def propose(
        self, dparams, state, root: jax.Array, cache_len: jax.Array, active: jax.Array, key: jax.Array
    ) -> tuple[object, DraftTree]:
        """A tree for every row from its root int32 [B] at policy slot cache_len int32 [B]. Rows
        that are not active bool [B] have finished: their trees are discarded, so a drafter need
        not read their caches."""

    def update(self, dparams, state, verified: Verified): ...
