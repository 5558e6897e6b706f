"""Verification of stochastic drafts in a Pallas kernel (Triton on GPU), one program per row.

Children drawn from q without replacement are verified by the sequential rule of
`jaxspec.kernels.tree_verify_reference.verify_stochastic`: at the current node the next untested child x
is accepted iff u * q_j(x) < r_j(x); on rejection r_{j+1} = norm((r_j - q_j)+) and q_{j+1} = q_j
with x zeroed, renormalised; after the last rejected child the emitted token is a flat Gumbel race
over r_j (the node's token seed). The reference carries r_j and q_j over the whole vocabulary; the
kernel carries only scalars and rebuilds them per token from the node's logits and q:

    r_0 = exp(logits * inv_t - lse),  q_0 = q / sum(q),
    r_{k+1} = (r_k - q_k)+ / R_{k+1} (r_k if R_{k+1} = 0),  q_{k+1} = q_k·1[v != x_{k+1}] / Q_{k+1} (likewise),

with the rejected tokens x_k and the normalisers R_k, Q_k (at most N - 1 of each) in registers.
Every node's lse and sum(q) come from `stochastic_normalisers`, the reference's own XLA
reductions, computed for all nodes at once before the kernel, so an accepted child costs the
kernel no vocabulary pass; each rejected child costs one pass (its R and Q, over the current
node's logits and q) and the end one race pass; a pass not taken runs 0 tiles. Per token the
kernel does the reference's elementwise arithmetic step by step (`rejection_update`), so the two
agree up to the summation order of R and Q.

In interpret mode the arithmetic is the reference's (normalisers up to float summation order);
compiled, library transcendentals may differ in the last bit. Either can only change a decision
that lands within rounding of a boundary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.kernels.tree_decide_pallas import (
    MIN_LANES,
    NO_INDEX,
    SCALAR_SPEC,
    load_row_tree,
    per_row_verify_call,
    row_spec,
)
from jaxspec.kernels.tree_noise import race_noise
from jaxspec.kernels.tree_race import inverse_temperature
from jaxspec.kernels.tree_verify_reference import (
    VerifyResult,
    rejection_update,
    stochastic_normalisers,
    verification_noise,
)

STOCHASTIC_TILE = 1024  # vocabulary tokens per step of a pass (a speed knob: it never changes a sample)


def _pick(values, lanes, k):
    """values[k] for a register vector [P] (a one-hot sum, exact)."""
    return jnp.sum(jnp.where(lanes == k, values, jnp.zeros_like(values)))


def _residual(scaled, q, token, lse, q_total, rejected, r_totals, q_totals, count, lanes):
    """(r_j, q_j) at `token` (any shape; scaled = logits * inv_t, q = raw draft probs, float32)
    after `count` rejections at a node whose lse and sum(q) are given."""

    def reject(k, rq):
        return rejection_update(
            *rq, token == _pick(rejected, lanes, k), _pick(r_totals, lanes, k), _pick(q_totals, lanes, k)
        )

    return lax.fori_loop(0, count, reject, (jnp.exp(scaled - lse), q / q_total))


def _stochastic_kernel(
    logits_ref,
    q_ref,
    lse_ref,
    q_total_ref,
    parents_ref,
    tokens_ref,
    num_nodes_ref,
    uniforms_ref,
    seeds_ref,
    path_ref,
    accepted_ref,
    next_ref,
    logprobs_ref,
    *,
    temperature: float,
    nodes: int,
    vocab: int,
    padded: int,
    tile: int,
):
    lanes = jnp.arange(padded, dtype=jnp.int32)
    inv_t = inverse_temperature(temperature)
    num_tiles = pl.cdiv(vocab, tile)
    offsets = jnp.arange(tile, dtype=jnp.int32)

    is_child, parent, token = load_row_tree(parents_ref, tokens_ref, num_nodes_ref, lanes, nodes)
    node_lane = jnp.minimum(lanes, nodes - 1)  # the padding lanes are never picked
    uniforms, seeds = plgpu.load(uniforms_ref.at[node_lane]), plgpu.load(seeds_ref.at[node_lane])
    node_lse, node_q_total = plgpu.load(lse_ref.at[node_lane]), plgpu.load(q_total_ref.at[node_lane])

    def tile_at(node, t):
        """(tokens, logits * inv_t, raw q) of vocabulary tile t at node; outside V: -inf and 0."""
        v = t * tile + offsets
        inside = v < vocab
        scaled = plgpu.load(logits_ref.at[node * vocab + v], mask=inside, other=-jnp.inf).astype(jnp.float32) * inv_t
        q = plgpu.load(q_ref.at[node * vocab + v], mask=inside, other=0).astype(jnp.float32)
        return v, scaled, q

    def rejection_pass(node, x, lse, q_total, state, tiles):
        """(R, Q) of rejecting token x at node: sums of (r_j - q_j)+ and of q_j with x zeroed."""

        def body(t, carry):
            v, scaled, q = tile_at(node, t)
            r, q = _residual(scaled, q, v, lse, q_total, *state, lanes)
            return carry[0] + jnp.sum(jnp.maximum(r - q, 0.0)), carry[1] + jnp.sum(jnp.where(v == x, 0.0, q))

        zero = jnp.float32(0.0)
        return lax.fori_loop(0, tiles, body, (zero, zero))

    def step(_, carry):
        cur, last, depth, done, lse, q_total, rejected, r_totals, q_totals, count, path, logprobs = carry
        candidates = is_child & (parent == cur) & (lanes > last)
        m = jnp.min(jnp.where(candidates, lanes, NO_INDEX))
        test = ~done & (m < NO_INDEX)
        x = _pick(token, lanes, m)
        scaled_x = plgpu.load(logits_ref.at[cur * vocab + x]).astype(jnp.float32) * inv_t
        q_x = plgpu.load(q_ref.at[cur * vocab + x]).astype(jnp.float32)
        state = (rejected, r_totals, q_totals, count)
        r_x, q_x = _residual(scaled_x, q_x, x, lse, q_total, *state, lanes)
        accept = test & (_pick(uniforms, lanes, m) * q_x < r_x)
        reject = test & ~accept
        # (int32 trip counts: a select of Python ints lowers to an i1 bound that Triton rejects)
        r_total, q_total_x = rejection_pass(cur, x, lse, q_total, state, num_tiles * reject.astype(jnp.int32))
        at_count = reject & (lanes == count)
        logprobs = jnp.where(accept & (lanes == depth), scaled_x - lse, logprobs)
        path = jnp.where(accept & (lanes == depth + 1), m, path)
        return (
            jnp.where(accept, m, cur),
            jnp.where(test, m, last),
            depth + accept.astype(jnp.int32),
            done | ~test,
            jnp.where(accept, _pick(node_lse, lanes, m), lse),
            jnp.where(accept, _pick(node_q_total, lanes, m), q_total),
            jnp.where(at_count, x, rejected),
            jnp.where(at_count, r_total, r_totals),
            jnp.where(at_count, q_total_x, q_totals),
            jnp.where(accept, 0, count + reject.astype(jnp.int32)),
            path,
            logprobs,
        )

    zeros = jnp.zeros((padded,), jnp.float32)
    zero_i = jnp.int32(0)
    carry = (
        zero_i,
        zero_i,
        zero_i,
        jnp.bool_(False),
        _pick(node_lse, lanes, 0),
        _pick(node_q_total, lanes, 0),
        jnp.zeros((padded,), jnp.int32),
        zeros,
        zeros,
        zero_i,
        jnp.where(lanes == 0, 0, -1),
        zeros,
    )
    cur, _, depth, _, lse, q_total, rejected, r_totals, q_totals, count, path, logprobs = lax.fori_loop(
        0, nodes - 1, step, carry
    )

    # The emitted token: a flat Gumbel race over r_j at the last node (the first best on ties).
    seed = _pick(seeds, lanes, cur)
    state = (rejected, r_totals, q_totals, count)

    def race(t, carry):
        best, best_token = carry
        v, scaled, q = tile_at(cur, t)
        r, _ = _residual(scaled, q, v, lse, q_total, *state, lanes)
        score = jnp.where(r > 0, jnp.log2(r) + race_noise(seed, v), -jnp.inf)
        tile_best = jnp.max(score)
        tile_token = jnp.min(jnp.where(score == tile_best, v, NO_INDEX))
        better = tile_best > best
        return jnp.where(better, tile_best, best), jnp.where(better, tile_token, best_token)

    _, next_token = lax.fori_loop(0, num_tiles, race, (jnp.float32(-jnp.inf), zero_i))
    end_logp = plgpu.load(logits_ref.at[cur * vocab + next_token]).astype(jnp.float32) * inv_t - lse
    path_ref[...] = path
    logprobs_ref[...] = jnp.where(lanes == depth, end_logp, logprobs)
    accepted_ref[...] = depth
    next_ref[...] = next_token


@functools.partial(jax.jit, static_argnames=("temperature", "interpret", "tile", "num_warps", "num_stages"))
def verify_stochastic_pallas(
    logits,
    draft_probs,
    parents,
    draft_tokens,
    num_nodes,
    key,
    *,
    temperature: float,
    interpret: bool = False,
    tile: int = STOCHASTIC_TILE,
    num_warps: int = 4,
    num_stages: int = 2,
) -> VerifyResult:
    """Stochastic-draft verification (temperature > 0): every node's normalisers in XLA
    (`stochastic_normalisers`), then the walk in one Pallas program per row; arguments as
    `jaxspec.kernels.tree_verify` (already validated), draft_probs float [B, N, V] (any float dtype, each
    node's q up to normalisation). The same key gives `verify_reference`'s result. tile (a power of
    2), num_warps and num_stages tune the GPU program and never change a result."""
    if temperature <= 0:
        raise ValueError(f"verify_stochastic_pallas needs temperature > 0, got {temperature}")
    if tile < 1 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of 2, got {tile}")
    batch, n, vocab = logits.shape
    tile = min(tile, pl.next_power_of_2(vocab))
    padded = max(pl.next_power_of_2(n), MIN_LANES)
    noise = verification_noise(key, batch, n)
    lse, q_total = stochastic_normalisers(logits, draft_probs, temperature)
    kernel = functools.partial(
        _stochastic_kernel, temperature=temperature, nodes=n, vocab=vocab, padded=padded, tile=tile
    )
    row = row_spec
    return per_row_verify_call(
        kernel,
        n,
        padded,
        [row(n * vocab), row(n * vocab), row(n), row(n), row(n), row(n), SCALAR_SPEC, row(n), row(n)],
        (
            logits.reshape(batch, n * vocab),
            draft_probs.reshape(batch, n * vocab),
            lse,
            q_total,
            parents,
            draft_tokens,
            num_nodes,
            noise.uniforms,
            noise.token_seeds,
        ),
        name="tree_verify_stochastic",
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )
