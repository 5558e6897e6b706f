"""The verification decisions after the vocabulary pass, one Pallas program per row (Triton on GPU).

Given the node-statistics kernel's per-(node, split) partials and each node's sample, one program
per row does what `combine_blocks` and `verify_from_stats` do in jnp: it combines the splits into
each node's normaliser and residual mass, decides each node's accepted child from its uniform
(the rule of `chosen_children`), walks down the tree from the root (one step per level, a short
serial loop) and writes the path, the count, the next token and the log-probs. It reads the
logits only at 2 positions per node (each draft token at its parent, the emitted token at the
path's end). At small batches this replaces about ten small XLA kernels, whose launches cost more
than their work.

Nodes are padded to a power of 2 of at least `MIN_LANES` inside the program (Triton's block
shapes); every gather from a vector is a one-hot sum over the padded nodes, which is exact (one
term is not 0). The floor matters: compiled for an H200, the program of a 2-node tree (a k=1
chain, padded to 2 lanes) reported no accepted token while its path held one, so every k=1
rollout accepted nothing (`tests/gpu/test_spec.py` is the guard). In interpret
mode the arithmetic is the jnp reference's; compiled, only float summation order and library
transcendentals can differ, which can only change a decision within rounding of a boundary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.kernels.tree_noise import LOG2E
from jaxspec.kernels.tree_race import inverse_temperature
from jaxspec.kernels.tree_verify_reference import VerifyResult

NO_INDEX = 1 << 30  # "no index" for min-reductions over node indices
MIN_LANES = 16  # the fewest padded node lanes a program runs with (see the module docstring)


def load_row_tree(parents_ref, tokens_ref, num_nodes_ref, lanes, nodes: int):
    """(is_child bool [P], parent int32 [P], token int32 [P]) of one row's tree over padded node lanes
    (`tree_structure` inside a program): parent and token are 0 where the lane is not a valid child."""
    node = jnp.minimum(lanes, nodes - 1)  # a safe load index for the padding lanes
    is_child = (lanes > 0) & (lanes < num_nodes_ref[...])
    parent = jnp.where(is_child, plgpu.load(parents_ref.at[node]), 0)
    token = jnp.where(is_child, plgpu.load(tokens_ref.at[node]), 0)
    return is_child, parent, token


def _at(values, index, lanes):
    """values[index] for a padded vector [P] and an index vector [P]: a one-hot sum."""
    return jnp.sum(jnp.where(lanes[None, :] == index[:, None], values[None, :], 0), axis=1)


def _decide_kernel(
    peak_ref,
    total_ref,
    candidates_ref,
    sample_ref,
    logits_ref,
    parents_ref,
    tokens_ref,
    num_nodes_ref,
    uniforms_ref,
    path_ref,
    accepted_ref,
    next_ref,
    logprobs_ref,
    *,
    temperature: float,
    nodes: int,
    splits: int,
    vocab: int,
    padded: int,
):
    lanes = jnp.arange(padded, dtype=jnp.int32)
    valid = lanes < nodes
    node = jnp.minimum(lanes, nodes - 1)  # a safe load index for the padding lanes
    inv_t = inverse_temperature(temperature)

    def load(ref, index, fill):
        return jnp.where(valid, plgpu.load(ref.at[index]), fill)

    # Combine the vocabulary splits as `combine_blocks` does: the top, then the rescaled sums.
    top = lax.fori_loop(
        0,
        splits,
        lambda s, m: jnp.maximum(m, load(peak_ref, node * splits + s, -jnp.inf)),
        jnp.full((padded,), -jnp.inf, jnp.float32),
    )
    shift = jnp.where(top == -jnp.inf, 0.0, top)

    def fold(s, carry):
        total, candidates = carry
        at = node * splits + s
        scale = jnp.exp2((load(peak_ref, at, -jnp.inf) - shift) * LOG2E)
        return total + load(total_ref, at, 0.0) * scale, candidates + load(candidates_ref, at, 0.0) * scale

    zeros = jnp.zeros((padded,), jnp.float32)
    total, candidates = lax.fori_loop(0, splits, fold, (zeros, zeros))
    sample = load(sample_ref, node, 0)
    lse = top + jnp.log(total)
    residual = jnp.ones_like(total) if temperature == 0 else candidates / total

    # The tree (`tree_structure`): child_of[n, m] = node m is a valid child of node n.
    is_child, parent, token = load_row_tree(parents_ref, tokens_ref, num_nodes_ref, lanes, nodes)
    child_of = is_child[None, :] & (parent[None, :] == lanes[:, None])
    # log p of each draft token at its parent (`_child_logprobs`)
    logit = plgpu.load(logits_ref.at[parent * vocab + token]).astype(jnp.float32)
    child_logp = jnp.where(is_child, logit * inv_t - _at(lse, parent, lanes), 0.0)

    # The accepted child of every node (`chosen_children`), -1 for none.
    later = lanes[None, :] > lanes[:, None]  # [n, m]: m after n
    if temperature == 0:
        hit = is_child & (token == _at(sample, parent, lanes))
        first = jnp.min(jnp.where(child_of & hit[None, :], lanes[None, :], NO_INDEX), axis=1)
        chosen = jnp.where(first < NO_INDEX, first, -1)
    else:
        sibling = is_child[:, None] & is_child[None, :] & (parent[:, None] == parent[None, :])  # [m, j]
        repeated = (
            jnp.max(
                jnp.where(
                    sibling & ~later & (lanes[None, :] != lanes[:, None]) & (token[None, :] == token[:, None]), 1, 0
                ),
                axis=1,
            )
            > 0
        )
        prob = jnp.where(is_child & ~repeated, jnp.exp(child_logp), 0.0)
        running = jnp.sum(jnp.where(sibling & ~later, prob[None, :], 0.0), axis=1)  # over j <= m
        children_mass = jnp.sum(jnp.where(child_of, prob[None, :], 0.0), axis=1)
        threshold = load(uniforms_ref, node, 0.0) * (residual + children_mass)
        hit = is_child & (_at(threshold, parent, lanes) < running)
        first = jnp.min(jnp.where(child_of & hit[None, :], lanes[None, :], NO_INDEX), axis=1)
        # no residual mass: all-rejected has probability 0; take the last child with mass instead
        last = jnp.max(jnp.where(child_of & (prob > 0)[None, :], lanes[None, :], -1), axis=1)
        chosen = jnp.where(first < NO_INDEX, first, jnp.where((residual <= 0) & (last >= 0), last, -1))

    # Walk down the tree (`walk`, `assemble`): step d follows the chosen child of the node at d - 1.
    def step(d, carry):
        current, path, logprobs = carry
        nxt = jnp.where(current >= 0, jnp.sum(jnp.where(lanes == current, chosen, 0)), -1)
        path = jnp.where((lanes == d) & (nxt >= 0), nxt, path)
        logprobs = jnp.where((lanes == d - 1) & (nxt >= 0), jnp.sum(jnp.where(lanes == nxt, child_logp, 0.0)), logprobs)
        return jnp.where(nxt >= 0, nxt, -1), path, logprobs

    path = jnp.where(lanes == 0, 0, -1)
    _, path, logprobs = lax.fori_loop(1, nodes, step, (jnp.int32(0), path, zeros))
    accepted = jnp.sum(jnp.where((lanes > 0) & (path >= 0), 1, 0))
    end = jnp.sum(jnp.where(lanes == accepted, path, 0))
    next_token = jnp.sum(jnp.where(lanes == end, sample, 0))
    end_logit = plgpu.load(logits_ref.at[end * vocab + next_token]).astype(jnp.float32)
    end_logp = end_logit * inv_t - jnp.sum(jnp.where(lanes == end, lse, 0.0))
    logprobs = jnp.where(lanes == accepted, end_logp, jnp.where(lanes < accepted, logprobs, 0.0))
    path_ref[...] = path
    logprobs_ref[...] = logprobs
    accepted_ref[...] = accepted
    next_ref[...] = next_token


def decide_pallas(
    peak,
    total,
    candidates,
    sample,
    logits,
    parents,
    draft_tokens,
    num_nodes,
    uniforms,
    temperature: float,
    *,
    interpret: bool = False,
    num_warps: int = 4,
) -> VerifyResult:
    """`VerifyResult` from the node-statistics kernel's partials (float32 [B, N, S]: per split, max
    of x = logits * inv_t and the sums of exp(x - max) over all / candidate tokens), each node's
    sample (int32 [B, N], `NodeStats.sample`), logits [B, N, V], the tree (parents, draft_tokens
    int32 [B, N], num_nodes int32 [B]) and uniforms float32 [B, N]."""
    batch, n, vocab = logits.shape
    splits, padded = peak.shape[-1], max(pl.next_power_of_2(n), MIN_LANES)
    flat = lambda x: x.reshape(batch, n * splits)  # noqa: E731
    kernel = functools.partial(
        _decide_kernel, temperature=temperature, nodes=n, splits=splits, vocab=vocab, padded=padded
    )
    row = row_spec
    return per_row_verify_call(
        kernel,
        n,
        padded,
        [row(n * splits)] * 3 + [row(n), row(n * vocab), row(n), row(n), SCALAR_SPEC, row(n)],
        (
            flat(peak),
            flat(total),
            flat(candidates),
            sample,
            logits.reshape(batch, n * vocab),
            parents,
            draft_tokens,
            num_nodes,
            uniforms,
        ),
        name="tree_verify_decide",
        interpret=interpret,
        num_warps=num_warps,
        num_stages=1,
    )


SCALAR_SPEC = pl.BlockSpec((None,), lambda b: (b,))  # one value per row


def row_spec(size: int) -> pl.BlockSpec:
    """One row's `size` values per program."""
    return pl.BlockSpec((None, size), lambda b: (b, 0))


def per_row_verify_call(
    kernel,
    nodes: int,
    padded: int,
    in_specs: list,
    args: tuple,
    *,
    name: str,
    interpret: bool,
    num_warps: int,
    num_stages: int,
) -> VerifyResult:
    """`kernel` run as one program per row (grid = the batch, args [B, ...]) writing a
    `VerifyResult`: path and logprobs on `padded` node lanes (sliced back to `nodes`), num_accepted
    and next_token one value per row."""
    batch = args[0].shape[0]
    path, accepted, next_token, logprobs = pl.pallas_call(
        kernel,
        grid=(batch,),
        in_specs=in_specs,
        out_specs=[row_spec(padded), SCALAR_SPEC, SCALAR_SPEC, row_spec(padded)],
        out_shape=[
            jax.ShapeDtypeStruct((batch, padded), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32),
            jax.ShapeDtypeStruct((batch, padded), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*args)
    return VerifyResult(path[:, :nodes], accepted, next_token, logprobs[:, :nodes])
