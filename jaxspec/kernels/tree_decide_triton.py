"""The verification decisions after the vocabulary pass, one Triton program per row.

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
term is not 0). The floor matters: compiled for an H200, a program of a 2-node tree (a k=1
chain, padded to 2 lanes) once reported no accepted token while its path held one, so every k=1
rollout accepted nothing (`tests/gpu/test_spec.py` is the guard). In Triton's interpreter the
arithmetic is the jnp reference's up to the last bit of numpy's transcendentals; compiled, float
summation order and library transcendentals can differ too, which can only change a decision
within rounding of a boundary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton.language as tl

from jaxspec.kernels.tree_noise import LOG2E
from jaxspec.kernels.tree_race import inverse_temperature, next_power_of_2
from jaxspec.kernels.tree_verify_reference import VerifyResult
from jaxspec.kernels.triton_call import MAX, MIN, SUM, call

NO_INDEX = 1 << 30  # "no index" for min-reductions over node indices
MIN_LANES = 16  # the fewest padded node lanes a program runs with (see the module docstring)
_LOG2E = tl.constexpr(LOG2E)  # a global a Triton kernel reads must be a constexpr
_NO_INDEX = tl.constexpr(NO_INDEX)


def tree_verify_decide(
    peak_ptr,
    total_ptr,
    candidates_ptr,
    sample_ptr,
    logits_ptr,
    parents_ptr,
    tokens_ptr,
    num_nodes_ptr,
    uniforms_ptr,
    path_ptr,
    accepted_ptr,
    next_ptr,
    logprobs_ptr,
    NODES: tl.constexpr,
    SPLITS: tl.constexpr,
    VOCAB: tl.constexpr,
    PADDED: tl.constexpr,
    INV_T: tl.constexpr,
    GREEDY: tl.constexpr,
    MATCH: tl.constexpr,
):
    """One row's program; shapes as `decide_triton`'s arguments (path and logprobs [B, PADDED])."""
    b = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, PADDED)
    valid = lanes < NODES
    node = b * NODES + tl.minimum(lanes, NODES - 1)  # a safe load index for the padding lanes

    # Combine the vocabulary splits as `combine_blocks` does: the top, then the rescaled sums.
    top = tl.full((PADDED,), float("-inf"), tl.float32)
    for s in range(SPLITS):
        top = tl.maximum(top, tl.where(valid, tl.load(peak_ptr + node * SPLITS + s), float("-inf")))
    shift = tl.where(top == float("-inf"), 0.0, top)
    total = tl.full((PADDED,), 0.0, tl.float32)
    candidates = tl.full((PADDED,), 0.0, tl.float32)
    for s in range(SPLITS):
        at = node * SPLITS + s
        scale = tl.exp2((tl.where(valid, tl.load(peak_ptr + at), float("-inf")) - shift) * _LOG2E)
        total = total + tl.where(valid, tl.load(total_ptr + at), 0.0) * scale
        candidates = candidates + tl.where(valid, tl.load(candidates_ptr + at), 0.0) * scale
    sample = tl.where(valid, tl.load(sample_ptr + node), 0)
    lse = top + tl.log(total)
    if GREEDY:
        residual = tl.full((PADDED,), 1.0, tl.float32)
    else:
        residual = candidates / total

    # The tree (`tree_structure`): child_of[n, m] = node m is a valid child of node n.
    is_child = (lanes > 0) & (lanes < tl.load(num_nodes_ptr + b))
    parent = tl.where(is_child, tl.load(parents_ptr + node), 0)
    token = tl.where(is_child, tl.load(tokens_ptr + node), 0)
    child_of = is_child[None, :] & (parent[None, :] == lanes[:, None])
    at_parent = lanes[None, :] == parent[:, None]  # [m, n]: one-hot of each node's parent
    # log p of each draft token at its parent (`_child_logprobs`)
    logit = tl.load(logits_ptr + (b * NODES + parent) * VOCAB + token).to(tl.float32)
    parent_lse = tl.reduce(tl.where(at_parent, lse[None, :], 0.0), 1, SUM)
    child_logp = tl.where(is_child, logit * INV_T - parent_lse, 0.0)

    # The accepted child of every node (`chosen_children`), -1 for none.
    if MATCH:
        hit = is_child & (token == tl.reduce(tl.where(at_parent, sample[None, :], 0), 1, SUM))
        first = tl.reduce(tl.where(child_of & hit[None, :], lanes[None, :], _NO_INDEX), 1, MIN)
        chosen = tl.where(first < _NO_INDEX, first, -1)
    else:
        not_later = lanes[None, :] <= lanes[:, None]  # [m, j]: j at or before m
        sibling = is_child[:, None] & is_child[None, :] & (parent[:, None] == parent[None, :])  # [m, j]
        same = sibling & not_later & (lanes[None, :] != lanes[:, None]) & (token[None, :] == token[:, None])
        repeated = tl.reduce(tl.where(same, 1, 0), 1, MAX) > 0
        prob = tl.where(is_child & ~repeated, tl.exp(child_logp), 0.0)
        running = tl.reduce(tl.where(sibling & not_later, prob[None, :], 0.0), 1, SUM)  # over j <= m
        children_mass = tl.reduce(tl.where(child_of, prob[None, :], 0.0), 1, SUM)
        threshold = tl.where(valid, tl.load(uniforms_ptr + node), 0.0) * (residual + children_mass)
        hit = is_child & (tl.reduce(tl.where(at_parent, threshold[None, :], 0.0), 1, SUM) < running)
        first = tl.reduce(tl.where(child_of & hit[None, :], lanes[None, :], _NO_INDEX), 1, MIN)
        # no residual mass: all-rejected has probability 0; take the last child with mass instead
        last = tl.reduce(tl.where(child_of & (prob > 0)[None, :], lanes[None, :], -1), 1, MAX)
        chosen = tl.where(first < _NO_INDEX, first, tl.where((residual <= 0) & (last >= 0), last, -1))

    # Walk down the tree (`walk`, `assemble`): step d follows the chosen child of the node at d - 1.
    current = tl.full((), 0, tl.int32)
    path = tl.where(lanes == 0, 0, -1)
    logprobs = tl.full((PADDED,), 0.0, tl.float32)
    for d in range(1, NODES):
        nxt = tl.where(current >= 0, tl.reduce(tl.where(lanes == current, chosen, 0), 0, SUM), -1)
        path = tl.where((lanes == d) & (nxt >= 0), nxt, path)
        nxt_logp = tl.reduce(tl.where(lanes == nxt, child_logp, 0.0), 0, SUM)
        logprobs = tl.where((lanes == d - 1) & (nxt >= 0), nxt_logp, logprobs)
        current = tl.where(nxt >= 0, nxt, -1)
    accepted = tl.reduce(tl.where((lanes > 0) & (path >= 0), 1, 0), 0, SUM)
    end = tl.reduce(tl.where(lanes == accepted, path, 0), 0, SUM)
    next_token = tl.reduce(tl.where(lanes == end, sample, 0), 0, SUM)
    end_logit = tl.load(logits_ptr + (b * NODES + end) * VOCAB + next_token).to(tl.float32)
    end_logp = end_logit * INV_T - tl.reduce(tl.where(lanes == end, lse, 0.0), 0, SUM)
    logprobs = tl.where(lanes == accepted, end_logp, tl.where(lanes < accepted, logprobs, 0.0))
    tl.store(path_ptr + b * PADDED + lanes, path)
    tl.store(logprobs_ptr + b * PADDED + lanes, logprobs)
    tl.store(accepted_ptr + b, accepted)
    tl.store(next_ptr + b, next_token)


def padded_lanes(nodes: int) -> int:
    """Node lanes of a per-row program: the next power of 2, at least MIN_LANES."""
    return max(next_power_of_2(nodes), MIN_LANES)


def per_row_outputs(batch: int, padded: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """A per-row kernel's outputs: path int32 [B, padded], num_accepted and next_token int32 [B],
    logprobs float32 [B, padded]."""
    return (
        jax.ShapeDtypeStruct((batch, padded), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((batch, padded), jnp.float32),
    )


def decide_constants(logits, splits: int, temperature: float, coupled: bool = False) -> dict:
    """The decision kernel's constexpr arguments for logits [B, N, V] (array or ShapeDtypeStruct);
    coupled: each node accepts the child whose token is its sample (`chosen_children`'s match)."""
    _, n, vocab = logits.shape
    return dict(
        NODES=n,
        SPLITS=splits,
        VOCAB=vocab,
        PADDED=padded_lanes(n),
        INV_T=float(inverse_temperature(temperature)),
        GREEDY=temperature == 0,
        MATCH=temperature == 0 or coupled,
    )


def decide_triton(
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
    coupled: bool = False,
    interpret: bool = False,
    num_warps: int = 4,
) -> VerifyResult:
    """`VerifyResult` from the node-statistics kernel's partials (float32 [B, N, S]: per split, max
    of x = logits * inv_t and the sums of exp(x - max) over all / candidate tokens), each node's
    sample (int32 [B, N], `NodeStats.sample`), logits [B, N, V], the tree (parents, draft_tokens
    int32 [B, N], num_nodes int32 [B]) and uniforms float32 [B, N]. coupled: the samples are races
    over all of p under node keys, and each node accepts the child that matches its sample (the
    rule greedy verification uses). interpret runs the kernel in Triton's interpreter on the host."""
    batch, n, _ = logits.shape
    constants = decide_constants(logits, peak.shape[-1], temperature, coupled)
    path, accepted, next_token, logprobs = call(
        tree_verify_decide,
        (peak, total, candidates, sample, logits, parents, draft_tokens, num_nodes, uniforms),
        per_row_outputs(batch, constants["PADDED"]),
        grid=(batch,),
        constants=constants,
        name=tree_verify_decide.__name__,
        interpret=interpret,
        num_warps=num_warps,
        num_stages=1,
    )
    return VerifyResult(path[:, :n], accepted, next_token, logprobs[:, :n])
