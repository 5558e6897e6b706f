"""Tree verification with the vocabulary reductions in a Pallas kernel (Triton on GPU).

The kernel streams each node's logits once, in vocabulary tiles, computing per tile its maximum,
its sum of exp(x - max) over all tokens and over the candidate tokens (not children of the node),
and the tile's race score of the two-level residual race (`jaxspec.kernels.tree_race`); it folds these
online into per-(row, node, split) partials. The grid is (rows, nodes, vocabulary splits): splits
keep the GPU busy when rows x nodes is small. jnp then draws the token race inside each node's
winning tile (one tile re-read per node), and a second kernel, one program per row
(`jaxspec.kernels.tree_decide_pallas`), combines the splits' normalisers, makes the reference's sibling
decisions and walks down the tree. Per token the first kernel does one exp2 and a compare per
child of the node, so it streams at memory speed; the per-token hash and logs of a flat Gumbel
race are only spent on one tile per node. (Drawing that race inside the streaming loop instead,
on the leading tile kept in registers or behind a branch, slowed the kernel on an H100:
benchmarks/LABLOG.md.)

In interpret mode the arithmetic is the reference's, so the two return identical results for the
same key and tile (normalisers up to float summation order). Compiled, library and XLA
transcendentals may differ in the last bit, which can only change a decision that lands within
rounding of a boundary.

Stochastic drafts (draft_probs given) do not use this kernel: their residual update needs whole
vocabulary vectors per tested child, and `jaxspec.kernels.tree_verify` sends them to the jnp reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.kernels.tree_decide_pallas import decide_pallas
from jaxspec.kernels.tree_noise import LOG2E
from jaxspec.kernels.tree_race import RACE_TILE, inverse_temperature, race_tile, sample_in_tile, tile_scores
from jaxspec.kernels.tree_structure import children_lists
from jaxspec.kernels.tree_verify_reference import (
    NodeStats,
    VerifyNoise,
    VerifyResult,
    combine_blocks,
    verification_noise,
)

TARGET_PROGRAMS = 2048  # enough (row, node, split) programs to fill a GPU when rows x nodes is small


def _stats_kernel(
    logits_ref,
    seed_ref,
    children_ref,
    count_ref,
    peak_ref,
    total_ref,
    candidates_ref,
    best_ref,
    best_tile_ref,
    *,
    temperature: float,
    tile: int,
    tiles_per_split: int,
    vocab: int,
):
    """One (row, node, split) program over `tiles_per_split` vocabulary tiles; scalar outputs:
    peak = max of x = logits * inv_t; total / candidates = sum of exp(x - peak) over all /
    candidate tokens; best = the best tile race score; best_tile = its tile index (the first on
    ties; the split's first tile while none scores above -inf)."""
    split = pl.program_id(2)
    inv_t = inverse_temperature(temperature)
    race = temperature > 0
    seed = seed_ref[...]
    count = count_ref[...] if race else 0
    lanes = jnp.arange(tile, dtype=jnp.int32)

    def body(i, carry):
        peak, total, candidates, best, best_tile = carry
        t = split * tiles_per_split + i
        token = t * tile + lanes
        x = plgpu.load(logits_ref.at[token], mask=token < vocab, other=-jnp.inf).astype(jnp.float32) * inv_t
        tile_max = jnp.max(x)
        weight = jnp.exp2((x - jnp.where(tile_max == -jnp.inf, 0.0, tile_max)) * LOG2E)
        tile_total = jnp.sum(weight)
        if race:
            child = lax.fori_loop(
                0, count, lambda j, hit: hit | (token == children_ref[j]), jnp.zeros((tile,), jnp.bool_)
            )
            tile_candidates = jnp.sum(jnp.where(child, 0.0, weight))
        else:
            tile_candidates = tile_total
        score = tile_scores(tile_max, tile_candidates, t, seed, temperature)
        new_peak = jnp.maximum(peak, tile_max)
        shift = jnp.where(new_peak == -jnp.inf, 0.0, new_peak)
        old_scale = jnp.exp2((peak - shift) * LOG2E)
        tile_scale = jnp.exp2((tile_max - shift) * LOG2E)
        better = score > best
        return (
            new_peak,
            total * old_scale + tile_total * tile_scale,
            candidates * old_scale + tile_candidates * tile_scale,
            jnp.where(better, score, best),
            jnp.where(better, t, best_tile),
        )

    neg_inf, zero = jnp.float32(-jnp.inf), jnp.float32(0.0)
    peak, total, candidates, best, best_tile = lax.fori_loop(
        0, tiles_per_split, body, (neg_inf, zero, zero, neg_inf, split * tiles_per_split)
    )
    peak_ref[...] = peak
    total_ref[...] = total
    candidates_ref[...] = candidates
    best_ref[...] = best
    best_tile_ref[...] = best_tile


def _split_plan(batch: int, nodes: int, vocab: int, tile: int, programs: int = TARGET_PROGRAMS) -> tuple[int, int]:
    """(splits, tiles per split) for a [batch, nodes, vocab] problem: about `programs` (row, node,
    split) programs in all, at least one split and at most one per vocabulary tile."""
    num_tiles = pl.cdiv(vocab, tile)
    splits = max(1, min(num_tiles, pl.cdiv(programs, batch * nodes)))
    per_split = pl.cdiv(num_tiles, splits)
    return pl.cdiv(num_tiles, per_split), per_split


def split_partials_pallas(
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
    programs: int = TARGET_PROGRAMS,
) -> tuple[jax.Array, ...]:
    """The kernel's per-(row, node, split) partials [B, N, S] (peak, total, candidates, best,
    best_tile; see `_stats_kernel`); logits float [B, N, V] (read in their own dtype)."""
    batch, n, vocab = logits.shape
    tile = race_tile(vocab, tile)
    splits, per_split = _split_plan(batch, n, vocab, tile, programs)
    children, count = children_lists(parents, draft_tokens, num_nodes)
    kernel = functools.partial(
        _stats_kernel, temperature=temperature, tile=tile, tiles_per_split=per_split, vocab=vocab
    )

    def per_node(b, i, s):
        return (b, i)

    scalar_out = pl.BlockSpec((None, None, None), lambda b, i, s: (b, i, s))
    f32 = jax.ShapeDtypeStruct((batch, n, splits), jnp.float32)
    return tuple(
        pl.pallas_call(
            kernel,
            grid=(batch, n, splits),
            in_specs=[
                pl.BlockSpec((None, None, vocab), lambda b, i, s: (b, i, 0)),
                pl.BlockSpec((None, None), per_node),
                pl.BlockSpec((None, None, n), lambda b, i, s: (b, i, 0)),
                pl.BlockSpec((None, None), per_node),
            ],
            out_specs=[scalar_out] * 5,
            out_shape=[f32, f32, f32, f32, jax.ShapeDtypeStruct((batch, n, splits), jnp.int32)],
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            interpret=interpret,
            name="tree_verify_node_stats",
        )(logits, noise.tile_seeds, children, count)
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


def node_stats_pallas(
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
    `split_partials_pallas`."""
    tile = race_tile(logits.shape[-1], tile)
    peak, total, candidates, best, best_tile = split_partials_pallas(
        logits, parents, draft_tokens, num_nodes, noise, temperature, tile=tile, **kernel_options
    )
    sample = _sample_split(best_tile, logits, parents, draft_tokens, num_nodes, noise, temperature, tile)
    return combine_blocks(peak, total, candidates, best, sample, temperature)


@functools.partial(jax.jit, static_argnames=("temperature", "interpret", "tile", "num_warps", "num_stages", "programs"))
def verify_pallas(
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
    programs: int = TARGET_PROGRAMS,
) -> VerifyResult:
    """Deterministic-draft or greedy tree verification: the vocabulary pass in a Pallas kernel
    (`split_partials_pallas`), the token race inside each node's winning tile in jnp, and the
    decisions and walk in a second Pallas kernel, one program per row (`jaxspec.kernels.tree_decide_pallas`);
    arguments as `jaxspec.kernels.tree_verify`, already validated; no draft_probs. tile, num_warps,
    num_stages and programs (about how many (row, node, vocabulary split) programs the vocabulary
    pass runs) tune the GPU kernel; tile also selects the sample a key gives (see
    `verify_reference`), programs does not."""
    batch, n, vocab = logits.shape
    tile = race_tile(vocab, tile)
    noise = verification_noise(key, batch, n)
    peak, total, candidates, best, best_tile = split_partials_pallas(
        logits,
        parents,
        draft_tokens,
        num_nodes,
        noise,
        temperature,
        interpret=interpret,
        tile=tile,
        num_warps=num_warps,
        num_stages=num_stages,
        programs=programs,
    )
    sample = _sample_split(best_tile, logits, parents, draft_tokens, num_nodes, noise, temperature, tile)
    return decide_pallas(
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
        interpret=interpret,
    )
