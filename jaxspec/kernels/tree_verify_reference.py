"""Exact (lossless) verification of a draft token tree against the policy: the pure-jnp reference.

Conventions shared by the reference and the Triton kernels (see `jaxspec.kernels.tree_verify` for the
argument contract): node 0 is the root, node n > 0 is a draft token whose parent is
`parents[b, n] < n`; siblings are verified in increasing node index; p at a node is
`softmax(logits * (1 / temperature))` (temperature 0: greedy, log-probs from `log_softmax(logits)`).

Deterministic drafts (children fixed before any coin, q a point mass): child x_k of a node is
accepted with probability r_k(x_k), r_1 = p, r_{k+1} = r_k with x_k zeroed and renormalised.
Unconditionally that accepts x_k with probability p(x_k), so one uniform u per node decides the
whole sibling list: the accepted child is the first whose running sum of p over siblings exceeds
u * (children's mass + residual mass); past all of them every child is rejected and the emitted
token is the residual sample, drawn from p restricted to the tokens that are not children (for a
leaf: from p itself, the bonus sample) by the two-level Gumbel race of `jaxspec.kernels.tree_race`. A
repeated sibling token has r_k = 0 there. Because each node's decision uses its own noise, every
node's outcome is computed at once and the walk down the tree only follows pointers.

Stochastic drafts (children drawn from q without replacement, in node order): the sequential
rule q_k(x) = q(x)·1[x not drawn before] / (1 − Σ_{j<k} q(x_j)), accept with
min(1, r_k(x_k) / q_k(x_k)), on rejection r_{k+1} = norm((r_k − q_k)⁺), and after the last
rejected child the emitted token is sampled from r_{K+1} (a flat Gumbel race); a
`lax.while_loop` walks the tree carrying r and q_k over the vocabulary (`jaxspec.kernels.tree_verify`'s
"auto" uses this path on the CPU; `jaxspec.kernels.tree_stochastic_triton` is the GPU kernel).

Coupled draws (one key per node, deterministic drafts): every node's sample is the race over all of
p under its own key, and a node accepts its first child whose token is that sample; otherwise the
sample is emitted. The token emitted at a node is then the one a lone root under the node's key
draws, whatever the tree: with node keys that depend only on (row, position), as
`jaxspec.rollout.sampling.depth_keys` makes them, a speculative rollout emits the tokens of the
autoregressive one. Child x_k is still accepted with probability p(x_k), so the acceptance is the
sibling rule's.

Noise (all from the key, through the counter-based hash of `jaxspec.kernels.tree_noise`): one uniform per
node (the deterministic decision at a parent, the stochastic test of a child) and Gumbel noise per
(row, node, tile) and per (row, node, token), which the Triton kernels regenerate identically.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxspec.kernels.tree_noise import LOG2E, node_hashes, race_noise, uniform_from_bits
from jaxspec.kernels.tree_race import RACE_TILE, inverse_temperature, race_tile, sample_in_tile, tile_scores
from jaxspec.kernels.tree_structure import child_token_mask, tree_structure


class VerifyResult(NamedTuple):
    """What one verification step emits, per row b.

    path: int32 [B, N]: accepted node ids from the root (path[:, 0] = 0), -1 after the end.
    num_accepted: int32 [B]: accepted draft tokens.
    next_token: int32 [B]: the token emitted after the accepted path (residual or bonus sample).
    logprobs: float32 [B, N]: log p at the parent node of each emitted token (accepted drafts,
        then next_token), 0 after.
    """

    path: jax.Array
    num_accepted: jax.Array
    next_token: jax.Array
    logprobs: jax.Array


class VerifyNoise(NamedTuple):
    """uniforms float32 [B, N] in [0, 1); tile_seeds, token_seeds int32 [B, N] (Gumbel race seeds)."""

    uniforms: jax.Array
    tile_seeds: jax.Array
    token_seeds: jax.Array


def key_layout(key: jax.Array) -> str:
    """How `tree_verify`'s key is laid out: "call" (one key), "row" (one key per row: typed keys [B],
    raw uint32 keys [B, 2]) or "node" (one key per node: typed [B, N], raw [B, N, 2])."""
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    layouts = ("call", "row", "node") if typed else (None, "call", "row", "node")
    if jnp.ndim(key) >= len(layouts) or layouts[jnp.ndim(key)] is None:
        raise ValueError(f"tree_verify key must be one key, one per row or one per node, got shape {key.shape}")
    return layouts[jnp.ndim(key)]


def per_row_keys(key: jax.Array) -> bool:
    """Whether `key` is one key per row (typed keys [B] or raw uint32 keys [B, 2]) rather than one key."""
    return key_layout(key) == "row"


def verification_noise(key: jax.Array, batch: int, num_nodes: int) -> VerifyNoise:
    """The noise of `batch` rows of `num_nodes` nodes from one key, from one key per row (row b
    then draws what it would draw alone, as row 0 of a batch of one, under its key) or from one key
    per node (node n of row b draws what the root of a lone one-node tree draws under its key)."""
    layout = key_layout(key)
    if layout == "node":
        if tuple(key.shape[:2]) != (batch, num_nodes):
            raise ValueError(f"tree_verify got node keys for {key.shape[:2]} (rows, nodes), not {(batch, num_nodes)}")
        words = jax.vmap(jax.vmap(lambda k: node_hashes(k, 1, 1, streams=3)[:, 0, 0]))(key)  # [B, N, 3]
        uniform_bits, tile_seeds, token_seeds = jnp.moveaxis(words, 2, 0)
    elif layout == "row":
        if key.shape[0] != batch:
            raise ValueError(f"tree_verify got {key.shape[0]} per-row keys for {batch} rows")
        words = jax.vmap(lambda k: node_hashes(k, 1, num_nodes, streams=3)[:, 0])(key)  # [B, 3, N]
        uniform_bits, tile_seeds, token_seeds = jnp.moveaxis(words, 1, 0)
    else:
        uniform_bits, tile_seeds, token_seeds = node_hashes(key, batch, num_nodes, streams=3)
    return VerifyNoise(uniform_from_bits(uniform_bits), tile_seeds, token_seeds)


def stats_num_nodes(num_nodes: jax.Array, coupled: bool) -> jax.Array:
    """The node counts the vocabulary pass sees: a coupled verification races every node over all
    of p (as if it had no children), the others over the tokens that are not children."""
    return jnp.ones_like(num_nodes) if coupled else num_nodes


class NodeStats(NamedTuple):
    """Per-node vocabulary reductions, the only part of verification that reads all of the logits.

    lse: float32 [B, N]: logsumexp of logits * inv_t at each node (log of p's normaliser).
    residual_mass: float32 [B, N]: p mass of the tokens that are not children of the node
        (temperature > 0; 1 for greedy, where it is unused).
    sample: int32 [B, N]: temperature > 0: the residual sample (p restricted to non-children);
        greedy: argmax of the logits (first on ties).
    """

    lse: jax.Array
    residual_mass: jax.Array
    sample: jax.Array


def combine_blocks(
    block_max, block_total, block_candidates, block_score, sample_block, temperature: float
) -> NodeStats:
    """`NodeStats` from per-block reductions [B, N, K] (vocabulary tiles, or a kernel's splits).

    block_max: max of x = logits * inv_t in the block; block_total / block_candidates: sum of
    exp(x - block_max) over all / candidate tokens; block_score: the block's best tile race score.
    sample_block(winner int32 [B, N]) -> int32 [B, N]: the sample of each node's winning block
    (the first with the highest score).
    """
    top = jnp.max(block_max, axis=-1, keepdims=True)
    scale = jnp.exp2((block_max - jnp.where(top == -jnp.inf, 0.0, top)) * LOG2E)
    total = jnp.sum(block_total * scale, axis=-1)
    lse = top[..., 0] + jnp.log(total)
    sample = sample_block(jnp.argmax(block_score, axis=-1).astype(jnp.int32))
    if temperature == 0:
        return NodeStats(lse, jnp.ones_like(lse), sample)
    return NodeStats(lse, jnp.sum(block_candidates * scale, axis=-1) / total, sample)


def node_stats_reference(
    logits, parents, draft_tokens, num_nodes, noise: VerifyNoise, temperature: float, tile: int = RACE_TILE
) -> NodeStats:
    """`NodeStats` from jnp reductions over the whole [B, N, V] logits, viewed as tiles of `tile`
    tokens (padded with -inf), in the kernel's arithmetic (exp2 of log2-scaled differences)."""
    batch, n, vocab = logits.shape
    tile = race_tile(vocab, tile)
    num_tiles = -(-vocab // tile)
    pad = ((0, 0), (0, 0), (0, num_tiles * tile - vocab))
    x = jnp.pad(logits.astype(jnp.float32) * inverse_temperature(temperature), pad, constant_values=-jnp.inf)
    x = x.reshape(batch, n, num_tiles, tile)
    tile_max = jnp.max(x, axis=-1)
    weights = jnp.exp2((x - jnp.where(tile_max == -jnp.inf, 0.0, tile_max)[..., None]) * LOG2E)
    tile_total = jnp.sum(weights, axis=-1)
    tile_id = jnp.arange(num_tiles, dtype=jnp.int32)
    if temperature == 0:
        tile_candidates = tile_total
    else:
        child = jnp.pad(child_token_mask(parents, draft_tokens, num_nodes, vocab), pad).reshape(x.shape)
        tile_candidates = jnp.sum(jnp.where(child, 0.0, weights), axis=-1)
    score = tile_scores(tile_max, tile_candidates, tile_id, noise.tile_seeds[..., None], temperature)

    def sample_tile(winner):
        return sample_in_tile(
            logits,
            winner,
            parents,
            draft_tokens,
            num_nodes,  # noqa: E731
            noise.token_seeds,
            temperature,
            tile,
        )

    return combine_blocks(tile_max, tile_total, tile_candidates, score, sample_tile, temperature)


def _child_logprobs(logits, lse, parent, draft_tokens, is_child, inv_t) -> jax.Array:
    """float32 [B, N]: log p at its parent of each node's token (0 where not a child)."""
    rows = jnp.arange(logits.shape[0])[:, None]
    token = jnp.where(is_child, draft_tokens, 0)
    logit = logits[rows, parent, token].astype(jnp.float32)
    return jnp.where(is_child, logit * inv_t - jnp.take_along_axis(lse, parent, axis=1), 0.0)


def _first(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(any, index of the first True) along the last axis."""
    return jnp.any(mask, axis=-1), jnp.argmax(mask, axis=-1).astype(jnp.int32)


def chosen_children(stats: NodeStats, child_logp, parents, draft_tokens, num_nodes, uniforms, match: bool) -> jax.Array:
    """int32 [B, N]: the child each node accepts if the walk reaches it, -1 if it accepts none.
    match: a node accepts its first child whose token is the node's sample (greedy, and coupled
    draws, whose sample is a race over all of p); else the sibling rule of the module docstring."""
    n = parents.shape[1]
    is_child, parent, child_of = tree_structure(parents, num_nodes)
    if match:
        hit = is_child & (draft_tokens == jnp.take_along_axis(stats.sample, parent, axis=1))
        found, first = _first(child_of & hit[:, None, :])
        return jnp.where(found, first, -1)
    idx = jnp.arange(n)
    sibling = is_child[:, :, None] & is_child[:, None, :] & (parent[:, :, None] == parent[:, None, :])  # [B, m, j]
    same_token = draft_tokens[:, None, :] == draft_tokens[:, :, None]
    repeated = jnp.any(sibling & (idx[None, :] < idx[:, None]) & same_token, -1)
    prob = jnp.where(is_child & ~repeated, jnp.exp(child_logp), 0.0)
    running = jnp.sum(jnp.where(sibling & (idx[None, :] <= idx[:, None]), prob[:, None, :], 0.0), -1)  # over j <= m
    children_mass = jnp.sum(jnp.where(child_of, prob[:, None, :], 0.0), -1)
    threshold = uniforms * (stats.residual_mass + children_mass)
    hit = is_child & (jnp.take_along_axis(threshold, parent, axis=1) < running)
    found, first = _first(child_of & hit[:, None, :])
    # With no residual mass all-rejected has probability 0; if rounding put the threshold at the
    # total, take the last child with mass instead of sampling from an empty residual.
    has_mass, last_reversed = _first((child_of & (prob > 0)[:, None, :])[..., ::-1])
    fallback = jnp.where((stats.residual_mass <= 0) & has_mass, n - 1 - last_reversed, -1)
    return jnp.where(found, first, fallback)


def walk(chosen: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Follows chosen children from the root: (path int32 [B, N], num_accepted int32 [B]).

    path[:, i] = chosen applied i times to the root, by pointer doubling: ceil(log2 N) gathers
    instead of a loop of N - 1 dependent steps (a nested loop inside the rollout's while_loop).
    """
    batch, n = chosen.shape
    sink = n  # the end of the path; maps to itself
    jump = jnp.concatenate([jnp.where(chosen >= 0, chosen, sink), jnp.full((batch, 1), sink, jnp.int32)], axis=1)
    path = jnp.zeros((batch, 1), jnp.int32)  # the first `width` nodes of the path; jump = chosen^width
    while path.shape[1] < n:
        path = jnp.concatenate([path, jnp.take_along_axis(jump, path, axis=1)], axis=1)
        jump = jnp.take_along_axis(jump, jump, axis=1)
    path = jnp.where(path[:, :n] == sink, -1, path[:, :n]).astype(jnp.int32)
    return path, jnp.sum(path[:, 1:] >= 0, axis=1).astype(jnp.int32)


def assemble(logits, lse, child_logp, path, num_accepted, next_token, inv_t) -> VerifyResult:
    """Adds the log-probabilities of the emitted tokens to a walked path."""
    batch, n = path.shape
    rows = jnp.arange(batch)
    end = jnp.take_along_axis(path, num_accepted[:, None], axis=1)[:, 0]
    end_logp = logits[rows, end, next_token].astype(jnp.float32) * inv_t - lse[rows, end]
    accepted_logp = jnp.take_along_axis(child_logp, jnp.maximum(path[:, 1:], 0), axis=1)
    accepted_logp = jnp.concatenate([accepted_logp, jnp.zeros((batch, 1), jnp.float32)], axis=1)
    pos = jnp.arange(n)[None, :]
    logprobs = jnp.where(pos < num_accepted[:, None], accepted_logp, 0.0)
    logprobs = jnp.where(pos == num_accepted[:, None], end_logp[:, None], logprobs)
    return VerifyResult(path, num_accepted, next_token.astype(jnp.int32), logprobs)


def verify_from_stats(
    stats: NodeStats, logits, parents, draft_tokens, num_nodes, uniforms, temperature, coupled: bool = False
) -> VerifyResult:
    """Deterministic-draft or greedy verification given the per-node reductions (for coupled draws,
    reductions made with `stats_num_nodes(num_nodes, True)`)."""
    inv_t = inverse_temperature(temperature)
    is_child, parent, _ = tree_structure(parents, num_nodes)
    child_logp = _child_logprobs(logits, stats.lse, parent, draft_tokens, is_child, inv_t)
    match = coupled or temperature == 0
    chosen = chosen_children(stats, child_logp, parents, draft_tokens, num_nodes, uniforms, match)
    path, num_accepted = walk(chosen)
    end = jnp.take_along_axis(path, num_accepted[:, None], axis=1)[:, 0]
    next_token = jnp.take_along_axis(stats.sample, end[:, None], axis=1)[:, 0]
    return assemble(logits, stats.lse, child_logp, path, num_accepted, next_token, inv_t)


def rejection_update(r, q, rejected, r_total, q_total) -> tuple[jax.Array, jax.Array]:
    """(r_{k+1}, q_{k+1}) after a sampled child is rejected, elementwise (any broadcastable shapes):
    norm((r - q)+) and q with the rejected token zeroed (`rejected` bool), renormalised, given
    r_total = sum (r - q)+ and q_total = sum of q without that token; each stays as it was when its
    sum is 0. Shared with the stochastic-draft kernel, which rebuilds r and q token by token."""
    r_next = jnp.where(r_total > 0, jnp.maximum(r - q, 0.0) / jnp.where(r_total > 0, r_total, 1.0), r)
    q_next = jnp.where(q_total > 0, jnp.where(rejected, 0.0, q) / jnp.where(q_total > 0, q_total, 1.0), q)
    return r_next, q_next


def stochastic_normalisers(logits, draft_probs, temperature: float) -> tuple[jax.Array, jax.Array]:
    """(lse, q_total) float32 [B, N]: logsumexp of logits * inv_t and the sum of draft_probs at every
    node (p = exp(logits * inv_t - lse), q = draft_probs / q_total); shared with the kernel."""
    scaled = logits.astype(jnp.float32) * inverse_temperature(temperature)
    return jax.nn.logsumexp(scaled, axis=-1), jnp.sum(draft_probs.astype(jnp.float32), axis=-1)


def verify_stochastic(
    logits, draft_probs, parents, draft_tokens, num_nodes, uniforms, seeds, temperature
) -> VerifyResult:
    """Verification of children drawn from q = draft_probs without replacement (temperature > 0)."""
    batch, n, vocab = logits.shape
    inv_t = inverse_temperature(temperature)
    scaled = logits.astype(jnp.float32) * inv_t
    lse, q_total = stochastic_normalisers(logits, draft_probs, temperature)
    is_child, parent, child_of = tree_structure(parents, num_nodes)
    child_logp = _child_logprobs(logits, lse, parent, draft_tokens, is_child, inv_t)
    rows = jnp.arange(batch)
    idx = jnp.arange(n)
    tokens = jnp.arange(vocab, dtype=jnp.int32)

    def p_at(node):
        return jnp.exp(scaled[rows, node] - lse[rows, node][:, None])

    def q_at(node):
        return draft_probs[rows, node].astype(jnp.float32) / q_total[rows, node][:, None]

    def unfinished(state):
        return ~jnp.all(state["done"])

    def step(s):
        cur, live = s["cur"], ~s["done"]
        candidates = child_of[rows, cur] & (idx[None, :] > s["last"][:, None])
        has_child, m = _first(candidates)
        x = draft_tokens[rows, m]
        accept = live & has_child & (uniforms[rows, m] * s["q"][rows, x] < s["r"][rows, x])
        reject = live & has_child & ~accept
        finish = live & ~has_child
        race = jnp.where(s["r"] > 0, jnp.log2(s["r"]) + race_noise(seeds[rows, cur][:, None], tokens), -jnp.inf)
        rejected = tokens[None, :] == x[:, None]
        r_rejected, q_rejected = rejection_update(
            s["r"],
            s["q"],
            rejected,
            jnp.sum(jnp.maximum(s["r"] - s["q"], 0.0), axis=-1, keepdims=True),
            jnp.sum(jnp.where(rejected, 0.0, s["q"]), axis=-1, keepdims=True),
        )
        a, j = accept[:, None], reject[:, None]
        return {
            "cur": jnp.where(accept, m, cur),
            "last": jnp.where(accept | reject, m, s["last"]),
            "r": jnp.where(a, p_at(m), jnp.where(j, r_rejected, s["r"])),
            "q": jnp.where(a, q_at(m), jnp.where(j, q_rejected, s["q"])),
            "path": s["path"].at[rows, jnp.where(accept, s["depth"] + 1, n)].set(m, mode="drop"),
            "depth": s["depth"] + accept,
            "next": jnp.where(finish, jnp.argmax(race, axis=-1).astype(jnp.int32), s["next"]),
            "done": s["done"] | finish,
        }

    root = jnp.zeros((batch,), jnp.int32)
    state = {
        "cur": root,
        "last": root,
        "r": p_at(root),
        "q": q_at(root),
        "path": jnp.full((batch, n), -1, jnp.int32).at[:, 0].set(0),
        "depth": root,
        "next": root,
        "done": jnp.zeros((batch,), bool),
    }
    state = lax.while_loop(unfinished, step, state)
    return assemble(logits, lse, child_logp, state["path"], state["depth"], state["next"], inv_t)


@functools.partial(jax.jit, static_argnames=("temperature", "tile"))
def verify_reference(
    logits, parents, draft_tokens, num_nodes, key, *, temperature: float, draft_probs=None, tile: int = RACE_TILE
) -> VerifyResult:
    """Reference tree verification (arguments as `jaxspec.kernels.tree_verify`, already validated).

    tile: vocabulary tile of the two-level residual race (a power of 2): it selects which sample a
    key gives, never the law; the Triton kernels give the same samples for the same tile.
    """
    batch, n, _ = logits.shape
    noise = verification_noise(key, batch, n)
    if draft_probs is not None and temperature > 0:
        return verify_stochastic(
            logits, draft_probs, parents, draft_tokens, num_nodes, noise.uniforms, noise.token_seeds, temperature
        )
    coupled = key_layout(key) == "node"
    stats_nodes = stats_num_nodes(num_nodes, coupled)
    stats = node_stats_reference(logits, parents, draft_tokens, stats_nodes, noise, temperature, tile)
    return verify_from_stats(stats, logits, parents, draft_tokens, num_nodes, noise.uniforms, temperature, coupled)
