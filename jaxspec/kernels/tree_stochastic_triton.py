"""Verification of stochastic drafts in a Triton kernel (called through jax-triton), one program per row.

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
kernel does the reference's elementwise arithmetic step by step (`rejection_update`, written out
at each of the kernel's three uses: a Triton kernel that runs on demand in the interpreter calls
no helper functions, see `jaxspec.kernels.triton_call`), so the two agree up to the summation
order of R and Q.

In Triton's interpreter the arithmetic is the reference's (normalisers up to float summation order,
transcendentals up to numpy's last bit); compiled, library transcendentals may differ in the last
bit. Either can only change a decision that lands within rounding of a boundary.
"""

from __future__ import annotations

import functools

import jax
import triton.language as tl

from jaxspec.kernels.tree_decide_triton import NO_INDEX, padded_lanes, per_row_outputs
from jaxspec.kernels.tree_race import inverse_temperature, next_power_of_2
from jaxspec.kernels.tree_verify_reference import VerifyResult, stochastic_normalisers, verification_noise
from jaxspec.kernels.triton_call import MAX, MIN, SUM, call

STOCHASTIC_TILE = 1024  # vocabulary tokens per step of a pass (a speed knob: it never changes a sample)
_NO_INDEX = tl.constexpr(NO_INDEX)  # a global a Triton kernel reads must be a constexpr


def tree_verify_stochastic(
    logits_ptr,
    q_ptr,
    lse_ptr,
    q_total_ptr,
    parents_ptr,
    tokens_ptr,
    num_nodes_ptr,
    uniforms_ptr,
    seeds_ptr,
    path_ptr,
    accepted_ptr,
    next_ptr,
    logprobs_ptr,
    NODES: tl.constexpr,
    VOCAB: tl.constexpr,
    PADDED: tl.constexpr,
    TILE: tl.constexpr,
    NUM_TILES: tl.constexpr,
    INV_T: tl.constexpr,
):
    """One row's program; shapes as `verify_stochastic_triton`'s arrays (path, logprobs [B, PADDED])."""
    b = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, PADDED)
    offsets = tl.arange(0, TILE)
    node = b * NODES + tl.minimum(lanes, NODES - 1)  # the padding lanes are never picked
    is_child = (lanes > 0) & (lanes < tl.load(num_nodes_ptr + b))
    parent = tl.where(is_child, tl.load(parents_ptr + node), 0)
    token = tl.where(is_child, tl.load(tokens_ptr + node), 0)
    uniforms = tl.load(uniforms_ptr + node)
    seeds = tl.load(seeds_ptr + node)
    node_lse = tl.load(lse_ptr + node)
    node_q_total = tl.load(q_total_ptr + node)

    cur = tl.full((), 0, tl.int32)
    last = tl.full((), 0, tl.int32)
    depth = tl.full((), 0, tl.int32)
    count = tl.full((), 0, tl.int32)
    done = tl.full((), 0, tl.int32)
    lse = tl.reduce(tl.where(lanes == 0, node_lse, 0.0), 0, SUM)
    q_total = tl.reduce(tl.where(lanes == 0, node_q_total, 0.0), 0, SUM)
    rejected = tl.full((PADDED,), 0, tl.int32)
    r_totals = tl.full((PADDED,), 0.0, tl.float32)
    q_totals = tl.full((PADDED,), 0.0, tl.float32)
    path = tl.where(lanes == 0, 0, -1)
    logprobs = tl.full((PADDED,), 0.0, tl.float32)
    for _ in range(NODES - 1):
        m = tl.reduce(tl.where(is_child & (parent == cur) & (lanes > last), lanes, _NO_INDEX), 0, MIN)
        test = (done == 0) & (m < _NO_INDEX)
        x = tl.reduce(tl.where(lanes == m, token, 0), 0, SUM)
        base = (b * NODES + cur) * VOCAB
        scaled_x = tl.load(logits_ptr + base + x).to(tl.float32) * INV_T
        r_x = tl.exp(scaled_x - lse)
        q_x = tl.load(q_ptr + base + x).to(tl.float32) / q_total
        for k in range(count):  # (r_j, q_j) at x: `rejection_update` after each earlier rejection
            r_k = tl.reduce(tl.where(lanes == k, r_totals, 0.0), 0, SUM)
            q_k = tl.reduce(tl.where(lanes == k, q_totals, 0.0), 0, SUM)
            x_k = tl.reduce(tl.where(lanes == k, rejected, 0), 0, SUM)
            r_next = tl.where(r_k > 0, tl.maximum(r_x - q_x, 0.0) / tl.where(r_k > 0, r_k, 1.0), r_x)
            q_x = tl.where(q_k > 0, tl.where(x == x_k, 0.0, q_x) / tl.where(q_k > 0, q_k, 1.0), q_x)
            r_x = r_next
        u = tl.reduce(tl.where(lanes == m, uniforms, 0.0), 0, SUM)
        accept = test & (u * q_x < r_x)
        reject = test & ~accept

        # (R, Q) of rejecting x: sums of (r_j - q_j)+ and of q_j with x zeroed, over the vocabulary
        r_total = tl.full((), 0.0, tl.float32)
        q_total_x = tl.full((), 0.0, tl.float32)
        for t in range(NUM_TILES * reject.to(tl.int32)):
            v = t * TILE + offsets
            inside = v < VOCAB
            r = tl.exp(tl.load(logits_ptr + base + v, mask=inside, other=float("-inf")).to(tl.float32) * INV_T - lse)
            q = tl.load(q_ptr + base + v, mask=inside, other=0.0).to(tl.float32) / q_total
            for k in range(count):
                r_k = tl.reduce(tl.where(lanes == k, r_totals, 0.0), 0, SUM)
                q_k = tl.reduce(tl.where(lanes == k, q_totals, 0.0), 0, SUM)
                x_k = tl.reduce(tl.where(lanes == k, rejected, 0), 0, SUM)
                r_next = tl.where(r_k > 0, tl.maximum(r - q, 0.0) / tl.where(r_k > 0, r_k, 1.0), r)
                q = tl.where(q_k > 0, tl.where(v == x_k, 0.0, q) / tl.where(q_k > 0, q_k, 1.0), q)
                r = r_next
            r_total += tl.reduce(tl.maximum(r - q, 0.0), 0, SUM)
            q_total_x += tl.reduce(tl.where(v == x, 0.0, q), 0, SUM)

        at_count = reject & (lanes == count)
        logprobs = tl.where(accept & (lanes == depth), scaled_x - lse, logprobs)
        path = tl.where(accept & (lanes == depth + 1), m, path)
        lse = tl.where(accept, tl.reduce(tl.where(lanes == m, node_lse, 0.0), 0, SUM), lse)
        q_total = tl.where(accept, tl.reduce(tl.where(lanes == m, node_q_total, 0.0), 0, SUM), q_total)
        rejected = tl.where(at_count, x, rejected)
        r_totals = tl.where(at_count, r_total, r_totals)
        q_totals = tl.where(at_count, q_total_x, q_totals)
        count = tl.where(accept, 0, count + reject.to(tl.int32))
        cur = tl.where(accept, m, cur)
        last = tl.where(test, m, last)
        depth = depth + accept.to(tl.int32)
        done = tl.where(test, done, 1)

    # The emitted token: a flat Gumbel race over r_j at the last node (the first best on ties).
    seed = tl.reduce(tl.where(lanes == cur, seeds, 0), 0, SUM)
    base = (b * NODES + cur) * VOCAB
    best = tl.full((), float("-inf"), tl.float32)
    next_token = tl.full((), 0, tl.int32)
    for t in range(NUM_TILES):
        v = t * TILE + offsets
        inside = v < VOCAB
        r = tl.exp(tl.load(logits_ptr + base + v, mask=inside, other=float("-inf")).to(tl.float32) * INV_T - lse)
        q = tl.load(q_ptr + base + v, mask=inside, other=0.0).to(tl.float32) / q_total
        for k in range(count):
            r_k = tl.reduce(tl.where(lanes == k, r_totals, 0.0), 0, SUM)
            q_k = tl.reduce(tl.where(lanes == k, q_totals, 0.0), 0, SUM)
            x_k = tl.reduce(tl.where(lanes == k, rejected, 0), 0, SUM)
            r_next = tl.where(r_k > 0, tl.maximum(r - q, 0.0) / tl.where(r_k > 0, r_k, 1.0), r)
            q = tl.where(q_k > 0, tl.where(v == x_k, 0.0, q) / tl.where(q_k > 0, q_k, 1.0), q)
            r = r_next
        # race_noise(seed, v): the triple32 hash of (v * golden) ^ seed in 32-bit words
        h = ((v * -1640531535) ^ seed).to(tl.uint32, bitcast=True)
        h = (h ^ (h >> 17)) * 0xED5AD4BB
        h = (h ^ (h >> 11)) * 0xAC4C1B51
        h = (h ^ (h >> 15)) * 0x31848BAB
        h = h ^ (h >> 14)
        u = (h >> 8).to(tl.float32) * (1.0 / (1 << 24)) + 0.5 / (1 << 24)
        score = tl.where(r > 0, tl.log2(r) - tl.log2(-tl.log2(u)), float("-inf"))
        tile_best = tl.reduce(score, 0, MAX)
        tile_token = tl.reduce(tl.where(score == tile_best, v, _NO_INDEX), 0, MIN)
        better = tile_best > best
        best = tl.where(better, tile_best, best)
        next_token = tl.where(better, tile_token, next_token)
    end_logp = tl.load(logits_ptr + base + next_token).to(tl.float32) * INV_T - lse
    tl.store(path_ptr + b * PADDED + lanes, path)
    tl.store(logprobs_ptr + b * PADDED + lanes, tl.where(lanes == depth, end_logp, logprobs))
    tl.store(accepted_ptr + b, depth)
    tl.store(next_ptr + b, next_token)


def launch(logits, temperature: float, tile: int = STOCHASTIC_TILE) -> dict:
    """The kernel's constexpr arguments for logits [B, N, V] (array or jax.ShapeDtypeStruct); grid (B,)."""
    if tile < 1 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of 2, got {tile}")
    _, n, vocab = logits.shape
    tile = min(tile, next_power_of_2(vocab))
    return dict(
        NODES=n,
        VOCAB=vocab,
        PADDED=padded_lanes(n),
        TILE=tile,
        NUM_TILES=-(-vocab // tile),
        INV_T=float(inverse_temperature(temperature)),
    )


@functools.partial(jax.jit, static_argnames=("temperature", "interpret", "tile", "num_warps", "num_stages"))
def verify_stochastic_triton(
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
    (`stochastic_normalisers`), then the walk in one Triton program per row; arguments as
    `jaxspec.kernels.tree_verify` (already validated), draft_probs float [B, N, V] (any float dtype, each
    node's q up to normalisation). The same key gives `verify_reference`'s result. interpret runs
    the kernel in Triton's interpreter on the host. tile (a power of 2), num_warps and num_stages
    tune the GPU program and never change a result."""
    if temperature <= 0:
        raise ValueError(f"verify_stochastic_triton needs temperature > 0, got {temperature}")
    batch, n, _ = logits.shape
    constants = launch(logits, temperature, tile)
    noise = verification_noise(key, batch, n)
    lse, q_total = stochastic_normalisers(logits, draft_probs, temperature)
    path, accepted, next_token, logprobs = call(
        tree_verify_stochastic,
        (logits, draft_probs, lse, q_total, parents, draft_tokens, num_nodes, noise.uniforms, noise.token_seeds),
        per_row_outputs(batch, constants["PADDED"]),
        grid=(batch,),
        constants=constants,
        name=tree_verify_stochastic.__name__,
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return VerifyResult(path[:, :n], accepted, next_token, logprobs[:, :n])
