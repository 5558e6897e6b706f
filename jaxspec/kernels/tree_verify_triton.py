"""Tree verification with the vocabulary reductions in a Triton kernel (called through jax-triton).

The kernel streams each node's logits once, in vocabulary tiles, computing per tile its maximum,
its sum of exp(x - max) over all tokens and over the candidate tokens (not children of the node),
and the tile's race score of the two-level residual race (`jaxspec.kernels.tree_race`); it folds these
online into per-(row, node, split) partials. The grid is (rows, nodes, vocabulary splits): splits
keep the GPU busy when rows x nodes is small. jnp then draws the token race inside each node's
winning tile (one tile re-read per node), and a second kernel, one program per row
(`jaxspec.kernels.tree_decide_triton`), combines the splits' normalisers, makes the reference's sibling
decisions and walks down the tree. Per token the first kernel does one exp2 and a compare per
child of the node, so it streams at memory speed; the per-token hash and logs of a flat Gumbel
race are only spent on one tile per node. (Drawing that race inside the streaming loop instead,
on the leading tile kept in registers or behind a branch, slowed the kernel on an H100:
benchmarks/LABLOG.md.)

The kernel does the reference's arithmetic step by step (the noise hash in 32-bit words, exp2 of
log2-scaled differences), so in Triton's interpreter the two return the same samples and
decisions for the same key and tile (normalisers up to float summation order; numpy's and XLA's
transcendentals may differ in the last bit, as the GPU's do). That can only change a decision
that lands within rounding of a boundary.

Coupled draws (one key per node) run the same two kernels: the vocabulary pass races every node
over all of p (it is given no children), and the decision kernel accepts the child that matches
the node's sample, as it does for greedy verification.

Stochastic drafts (draft_probs given) do not use this kernel: their residual update needs whole
vocabulary vectors per tested child; they have their own (`jaxspec.kernels.tree_stochastic_triton`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import triton.language as tl

from jaxspec.kernels.tree_decide_triton import decide_triton
from jaxspec.kernels.tree_noise import LOG2E
from jaxspec.kernels.tree_race import RACE_TILE, inverse_temperature, race_tile, sample_in_tile
from jaxspec.kernels.tree_structure import children_lists
from jaxspec.kernels.tree_verify_reference import (
    NodeStats,
    VerifyNoise,
    VerifyResult,
    combine_blocks,
    key_layout,
    stats_num_nodes,
    verification_noise,
)
from jaxspec.kernels.triton_call import MAX, SUM, call

TARGET_PROGRAMS = 8192  # (row, node, split) programs: the best of 2048-8192 on an H200 (BENCHMARKS.md)
_LOG2E = tl.constexpr(LOG2E)  # a global a Triton kernel reads must be a constexpr


def tree_verify_node_stats(
    logits_ptr,
    seeds_ptr,
    children_ptr,
    count_ptr,
    peak_ptr,
    total_ptr,
    candidates_ptr,
    best_ptr,
    best_tile_ptr,
    NODES: tl.constexpr,
    VOCAB: tl.constexpr,
    SPLITS: tl.constexpr,
    TILE: tl.constexpr,
    TILES_PER_SPLIT: tl.constexpr,
    INV_T: tl.constexpr,
    RACE: tl.constexpr,
):
    """One (row, node, split) program over TILES_PER_SPLIT vocabulary tiles of logits [B, N, V];
    scalar outputs [B, N, SPLITS]: peak = max of x = logits * INV_T; total / candidates = sum of
    exp(x - peak) over all / candidate tokens; best = the best tile race score; best_tile = its
    tile index (the first on ties; the split's first tile while none scores above -inf). seeds
    int32 [B, N] (the nodes' tile seeds), children int32 [B, N, N] and count int32 [B, N]
    (`children_lists`). RACE: temperature > 0 (else greedy: the score is the tile maximum)."""
    row = tl.program_id(0).to(tl.int64) * NODES + tl.program_id(1)
    split = tl.program_id(2)
    lanes = tl.arange(0, TILE)
    seed = tl.load(seeds_ptr + row)
    count = tl.load(count_ptr + row)
    peak = tl.full((), float("-inf"), tl.float32)
    total = tl.full((), 0.0, tl.float32)
    candidates = tl.full((), 0.0, tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    best_tile = split * TILES_PER_SPLIT
    for i in range(TILES_PER_SPLIT):
        t = split * TILES_PER_SPLIT + i
        token = t * TILE + lanes
        x = tl.load(logits_ptr + row * VOCAB + token, mask=token < VOCAB, other=float("-inf")).to(tl.float32)
        x = x * INV_T
        tile_max = tl.reduce(x, 0, MAX)
        weight = tl.exp2((x - tl.where(tile_max == float("-inf"), 0.0, tile_max)) * _LOG2E)
        tile_total = tl.reduce(weight, 0, SUM)
        if RACE:
            child = token < 0
            for j in range(count):
                child = child | (token == tl.load(children_ptr + row * NODES + j))
            tile_candidates = tl.reduce(tl.where(child, 0.0, weight), 0, SUM)
            # race_noise(seed, t): the triple32 hash of (t * golden) ^ seed in 32-bit words
            h = ((t * -1640531535) ^ seed).to(tl.uint32, bitcast=True)
            h = (h ^ (h >> 17)) * 0xED5AD4BB
            h = (h ^ (h >> 11)) * 0xAC4C1B51
            h = (h ^ (h >> 15)) * 0x31848BAB
            h = h ^ (h >> 14)
            u = (h >> 8).to(tl.float32) * (1.0 / (1 << 24)) + 0.5 / (1 << 24)
            score = tile_max * _LOG2E + tl.log2(tile_candidates) - tl.log2(-tl.log2(u))
        else:
            tile_candidates = tile_total
            score = tile_max
        new_peak = tl.maximum(peak, tile_max)
        shift = tl.where(new_peak == float("-inf"), 0.0, new_peak)
        old_scale = tl.exp2((peak - shift) * _LOG2E)
        tile_scale = tl.exp2((tile_max - shift) * _LOG2E)
        better = score > best
        peak = new_peak
        total = total * old_scale + tile_total * tile_scale
        candidates = candidates * old_scale + tile_candidates * tile_scale
        best = tl.where(better, score, best)
        best_tile = tl.where(better, t, best_tile)
    out = row * SPLITS + split
    tl.store(peak_ptr + out, peak)
    tl.store(total_ptr + out, total)
    tl.store(candidates_ptr + out, candidates)
    tl.store(best_ptr + out, best)
    tl.store(best_tile_ptr + out, best_tile)


def _split_plan(batch: int, nodes: int, vocab: int, tile: int, programs: int) -> tuple[int, int]:
    """(splits, tiles per split) for a [batch, nodes, vocab] problem: about `programs` (row, node,
    split) programs in all, at least one split and at most one per vocabulary tile."""
    num_tiles = -(-vocab // tile)
    splits = max(1, min(num_tiles, -(-programs // (batch * nodes))))
    per_split = -(-num_tiles // splits)
    return -(-num_tiles // per_split), per_split


def launch(logits, temperature: float, *, tile: int = RACE_TILE, programs: int = TARGET_PROGRAMS):
    """(grid, the kernel's constexpr arguments) of the node-statistics kernel for logits [B, N, V]
    (an array or jax.ShapeDtypeStruct); tile already capped by `race_tile`."""
    batch, n, vocab = logits.shape
    splits, per_split = _split_plan(batch, n, vocab, tile, programs)
    constants = dict(
        NODES=n,
        VOCAB=vocab,
        SPLITS=splits,
        TILE=tile,
        TILES_PER_SPLIT=per_split,
        INV_T=float(inverse_temperature(temperature)),
        RACE=temperature > 0,
    )
    return (batch, n, splits), constants


def split_partials_triton(
    logits,
    parents,
    draft_tokens,
    num_nodes,
    noise: VerifyNoise,
    temperature: float,
    *,
    interpret: bool = False,
    tile: int = RACE_TILE,
    num_warps: int = 4,
    num_stages: int = 3,
    programs: int | None = None,
) -> tuple[jax.Array, ...]:
    """The kernel's per-(row, node, split) partials [B, N, S] (peak, total, candidates, best,
    best_tile; see `tree_verify_node_stats`); logits float [B, N, V] (read in their own dtype). programs:
    about how many (row, node, split) programs to run (default TARGET_PROGRAMS on a GPU, one
    split per node in the interpreter, which runs programs one after another)."""
    batch, n, vocab = logits.shape
    tile = race_tile(vocab, tile)
    if programs is None:
        programs = 1 if interpret else TARGET_PROGRAMS
    grid, constants = launch(logits, temperature, tile=tile, programs=programs)
    children, count = children_lists(parents, draft_tokens, num_nodes)
    f32 = jax.ShapeDtypeStruct(grid, jnp.float32)
    return call(
        tree_verify_node_stats,
        (logits, noise.tile_seeds, children, count),
        (f32, f32, f32, f32, jax.ShapeDtypeStruct(grid, jnp.int32)),
        grid=grid,
        constants=constants,
        name=tree_verify_node_stats.__name__,
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )


def _sample_split(
    best_tile, logits, parents, draft_tokens, num_nodes, noise: VerifyNoise, temperature: float, tile: int
):
    """sample_block for `combine_blocks` (winner int32 [B, N] -> int32 [B, N]): the token race
    inside the winning split's best tile."""

    def sample(winner: jax.Array) -> jax.Array:
        winner_tile = jnp.take_along_axis(best_tile, winner[..., None], axis=-1)[..., 0]
        return sample_in_tile(
            logits, winner_tile, parents, draft_tokens, num_nodes, noise.token_seeds, temperature, tile
        )

    return sample


def node_stats_triton(
    logits,
    parents,
    draft_tokens,
    num_nodes,
    noise: VerifyNoise,
    temperature: float,
    *,
    tile: int = RACE_TILE,
    **kernel_options,
) -> NodeStats:
    """`NodeStats` from the kernel's partials, combined in jnp (`combine_blocks`); options as
    `split_partials_triton`."""
    tile = race_tile(logits.shape[-1], tile)
    peak, total, candidates, best, best_tile = split_partials_triton(
        logits, parents, draft_tokens, num_nodes, noise, temperature, tile=tile, **kernel_options
    )
    sample = _sample_split(best_tile, logits, parents, draft_tokens, num_nodes, noise, temperature, tile)
    return combine_blocks(peak, total, candidates, best, sample, temperature)


@functools.partial(jax.jit, static_argnames=("temperature", "interpret", "tile", "num_warps", "num_stages", "programs"))
def verify_triton(
    logits,
    parents,
    draft_tokens,
    num_nodes,
    key,
    *,
    temperature: float,
    interpret: bool = False,
    tile: int = RACE_TILE,
    num_warps: int = 4,
    num_stages: int = 3,
    programs: int | None = None,
) -> VerifyResult:
    """Deterministic-draft or greedy tree verification: the vocabulary pass in a Triton kernel
    (`split_partials_triton`), the token race inside each node's winning tile in jnp, and the
    decisions and walk in a second Triton kernel, one program per row
    (`jaxspec.kernels.tree_decide_triton`); arguments as `jaxspec.kernels.tree_verify`, already
    validated; no draft_probs. interpret runs both kernels in Triton's interpreter on the host.
    tile, num_warps, num_stages and programs (about how many (row, node, vocabulary split)
    programs the vocabulary pass runs) tune the GPU kernel; tile also selects the sample a key
    gives (see `verify_reference`), programs does not."""
    batch, n, vocab = logits.shape
    tile = race_tile(vocab, tile)
    noise = verification_noise(key, batch, n)
    coupled = key_layout(key) == "node"
    stats_nodes = stats_num_nodes(num_nodes, coupled)
    peak, total, candidates, best, best_tile = split_partials_triton(
        logits,
        parents,
        draft_tokens,
        stats_nodes,
        noise,
        temperature,
        interpret=interpret,
        tile=tile,
        num_warps=num_warps,
        num_stages=num_stages,
        programs=programs,
    )
    sample = _sample_split(best_tile, logits, parents, draft_tokens, stats_nodes, noise, temperature, tile)
    return decide_triton(
        peak,
        total,
        candidates,
        sample(jnp.argmax(best, axis=-1).astype(jnp.int32)),
        logits,
        parents,
        draft_tokens,
        num_nodes,
        noise.uniforms,
        temperature,
        coupled=coupled,
        interpret=interpret,
    )
