"""Attention of a few new tokens per row over that row's pages of a paged KV cache (Pallas Mosaic
GPU, Hopper).

The semantics are those of `jaxspec.models.paged.paged_attention` (its jnp reference): row b's
query rows see its prefix, positions [0, prefix_len[b]), and those of its num_new new tokens at
positions new_start[b] + j that their tree-mask bits name (`new_token_bits`, as in the dense
ragged kernel `jaxspec.kernels.ragged_attention`). Position p of row b lives in page
page_table[b, p // page_size]; an entry >= num_pages (`NO_PAGE`) is a page that holds zeros, as
the reference's gather reads it.

One program per (row, kv head, split), a single warpgroup. Its query rows (the new tokens x the
query heads of the kv head, padded to a multiple of 64: one wgmma tile) stay in shared memory;
the row's KV blocks of `block_kv` positions stream from the page pools into a ring of
`max_concurrent_steps` shared-memory slots, each block gathered by one TMA copy per page and
awaited on one barrier per slot (K and V apart, so scores start while V still lands). Per block:
scores = q k^T on the tensor cores (float32 accumulate), the mask, an online softmax in float32,
o += p v on the tensor cores (p staged in shared memory: Mosaic GPU's interpreter runs a wgmma
only on shared-memory operands); then the slot is refilled with the block `max_concurrent_steps`
ahead. A program reads only the blocks up to its row's last new token (a finished row: its new
tokens' blocks only); the `splits` programs of a (row, kv head) share those blocks in contiguous
runs, and return flash-attention partials (`Partials`) that `merge` combines.
"""

from __future__ import annotations

import functools
import inspect
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxspec.kernels.ragged_attention import WORD_BITS, Partials

ROW_TILE = 64  # query rows per wgmma tile (one warpgroup)
MAX_ROWS = 128  # query rows a program holds (new tokens x query heads per kv head, padded)
BLOCK_KV = 64  # positions per pipeline step (pages per step = BLOCK_KV / page_size)
MAX_CONCURRENT_STEPS = 4  # shared-memory slots of the KV ring, at most (fewer where they do not fit)
SMEM_BYTES = 227 * 1024  # dynamic shared memory of one Hopper (sm90) block
SWIZZLE_BYTES = 128
TARGET_PROGRAMS = 1024  # (row, kv head, split) programs that keep an H100's 132 SMs busy
MIN_BLOCKS_PER_SPLIT = 4


# Mosaic GPU interpret mode runs this kernel from JAX 0.12: older interpreters cannot run a wgmma on
# a transposed shared-memory operand (the k^T of the scores).
INTERPRET_SUPPORTED = jax.__version_info__ >= (0, 12)


def interpret_params():
    """Mosaic GPU interpret mode: the kernel's own code, run on the CPU with simulated shared memory,
    TMA copies and barriers; uninitialised shared memory reads as NaN, and a read of a buffer
    before the barrier of its copy is awaited raises (race detection)."""
    if not INTERPRET_SUPPORTED:
        raise NotImplementedError(
            f"the paged attention kernel's interpret mode needs JAX >= 0.12 (this is {jax.__version__}: its "
            "Mosaic GPU interpreter cannot run a wgmma on a transposed shared-memory operand)"
        )
    return plgpu.InterpretGPUParams(detect_races=True)


def smem_bytes(rows: int, head_dim: int, block_kv: int, max_concurrent_steps: int, words: int, dtype) -> int:
    """Shared memory of one program: the query rows, the K and V ring, the tree-mask words, the
    probabilities of a block and the float32 staging of its partials."""
    item = jnp.dtype(dtype).itemsize
    return (
        rows * head_dim * item
        + 2 * max_concurrent_steps * block_kv * head_dim * item
        + words * rows * 4
        + rows * block_kv * item
        + rows * head_dim * 4
        + 2 * rows * 4
    )


def ring_depth(rows: int, head_dim: int, block_kv: int, words: int, dtype) -> int:
    """The most KV slots, up to MAX_CONCURRENT_STEPS, whose program fits in SMEM_BYTES (0: none)."""
    fits = [
        d
        for d in range(1, MAX_CONCURRENT_STEPS + 1)
        if smem_bytes(rows, head_dim, block_kv, d, words, dtype) <= SMEM_BYTES
    ]
    return max(fits, default=0)


def _tiled(dtype) -> tuple:
    """The swizzled tiling wgmma and TMA want for a ref of `dtype`."""
    return (
        plgpu.TilingTransform((8, SWIZZLE_BYTES // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(SWIZZLE_BYTES),
    )


def _load_row_vector(ref):
    """ref [R] (shared memory) as registers laid out like a row reduction of a wgmma tile."""
    layout = plgpu.Layout.WGMMA.reduce(1)
    if "idx" in inspect.signature(plgpu.load).parameters:  # JAX < 0.12
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def _kernel(
    lens_ref,
    table_ref,
    bits_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    m_ref,
    l_ref,
    q_smem,
    k_smem,
    v_smem,
    bits_smem,
    p_smem,
    o_smem,
    m_smem,
    l_smem,
    q_barrier,
    k_barriers,
    v_barriers,
    *,
    num_new: int,
    max_len: int,
    splits: int,
    depth: int,
):
    """One (row, kv head, split) program; shapes as in `paged_attention_partials`."""
    num_pages, page_size = k_ref.shape[0], k_ref.shape[1]
    rows, head_dim = q_smem.shape
    block_kv = k_smem.shape[1]
    pages_per_block = block_kv // page_size
    b, h, s = lax.axis_index("row"), lax.axis_index("head"), lax.axis_index("split")
    prefix_len, new_start = lens_ref[b, 0], lens_ref[b, 1]

    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_barrier.at[0])
    plgpu.copy_gmem_to_smem(bits_ref.at[b], bits_smem, q_barrier.at[0])

    # This program's run of the row's blocks: those up to its last new token (past the last
    # position they were dropped), from block 0, or, for a finished row, from its new tokens.
    end = jnp.minimum(new_start + num_new, max_len)
    lo = jnp.where(prefix_len > 0, 0, lax.div(new_start, block_kv))
    hi = lax.div(end + block_kv - 1, block_kv)
    per_split = lax.div(jnp.maximum(hi - lo, 0) + splits - 1, splits)
    first = lo + s * per_split
    count = jnp.clip(jnp.minimum(hi, first + per_split) - first, 0, per_split)

    def page(block, i):
        """Page i of KV block `block`, and whether the table has one (else page 0 is read, finite
        data whose columns act as the zeros the reference reads)."""
        entry = table_ref[b, block * pages_per_block + i]
        valid = (entry >= 0) & (entry < num_pages)
        return jnp.where(valid, entry, 0), valid

    def fetch(step):
        slot = lax.rem(step, depth)
        for i in range(pages_per_block):
            index, _ = page(first + step, i)
            rows_of_page = pl.ds(i * page_size, page_size)
            plgpu.copy_gmem_to_smem(k_ref.at[index, :, h], k_smem.at[slot, rows_of_page], k_barriers.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[index, :, h], v_smem.at[slot, rows_of_page], v_barriers.at[slot])

    for step in range(depth):
        pl.when(step < count)(functools.partial(fetch, step))

    plgpu.barrier_wait(q_barrier.at[0])
    words = [_load_row_vector(bits_smem.at[w]) for w in range(bits_smem.shape[0])]
    column = plgpu.broadcasted_iota(jnp.int32, (rows, block_kv), 1, layout=plgpu.Layout.WGMMA)

    def visible(block):
        """bool [rows, block_kv]: which positions of this block each query row sees."""
        position = block * block_kv + column
        rel = position - new_start
        sees = position < prefix_len
        for w, word in enumerate(words):
            in_word = (rel >= w * WORD_BITS) & (rel < min((w + 1) * WORD_BITS, num_new))
            shift = jnp.clip(rel - w * WORD_BITS, 0, WORD_BITS - 1)
            bit = lax.shift_right_logical(lax.broadcast_in_dim(word, (rows, block_kv), [0]), shift) & 1
            sees = sees | (in_word & (bit == 1))
        return sees & (position < max_len)

    def has_page(block):
        """bool [rows, block_kv]: the columns whose page the table holds."""
        page_of_column = lax.div(column, page_size)
        held = page_of_column < 0  # all False, in the columns' layout
        for i in range(pages_per_block):
            _, valid = page(block, i)
            held = held | ((page_of_column == i) & valid)
        return held

    def body(step, carry):
        o, m, l = carry
        slot = lax.rem(step, depth)
        block = first + step
        plgpu.barrier_wait(k_barriers.at[slot])

        def scores_of(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
            return acc_ref[...]

        scores = pl.run_scoped(scores_of, plgpu.ACC((rows, block_kv), jnp.float32)) * (head_dim**-0.5)
        held = has_page(block)
        scores = jnp.where(held, scores, 0.0)  # a position without a page has k = 0
        scores = jnp.where(visible(block), scores, -jnp.inf)
        m_next = jnp.maximum(m, scores.max(axis=1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # a query row that has seen nothing yet
        rescale = jnp.exp(m - m_safe)
        p = jnp.exp(scores - lax.broadcast_in_dim(m_safe, scores.shape, [0]))
        l = rescale * l + p.sum(axis=1)
        p_smem[...] = jnp.where(held, p, 0.0).astype(p_smem.dtype)  # ... and v = 0
        plgpu.commit_smem()
        plgpu.barrier_wait(v_barriers.at[slot])

        def weighted_values(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
            return acc_ref[...]  # awaits the wgmma: the slot is free

        pv = pl.run_scoped(weighted_values, plgpu.ACC((rows, head_dim), jnp.float32))
        o = o * lax.broadcast_in_dim(rescale, o.shape, [0]) + pv
        pl.when(step + depth < count)(functools.partial(fetch, step + depth))
        return o, m_next, l

    init = (
        plgpu.layout_cast(jnp.zeros((rows, head_dim), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
    )
    o, m, l = lax.fori_loop(0, count, body, init)
    o_smem[...] = o
    m_smem[...] = m
    l_smem[...] = l
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h, s])
    plgpu.copy_smem_to_gmem(m_smem, m_ref.at[b, h, s])
    plgpu.copy_smem_to_gmem(l_smem, l_ref.at[b, h, s])
    plgpu.wait_smem_to_gmem(0)


def default_splits(batch: int, kv_heads: int, table_blocks: int) -> int:
    """Splits of each (row, kv head)'s blocks that make about TARGET_PROGRAMS programs, with at
    least MIN_BLOCKS_PER_SPLIT of a full table's `table_blocks` per split: a split writes partials
    of R x D float32, as many bytes as it reads with one block of K and V at 64 rows."""
    return max(1, min(TARGET_PROGRAMS // (batch * kv_heads), table_blocks // MIN_BLOCKS_PER_SPLIT))


@functools.partial(jax.jit, static_argnames=("num_new", "interpret", "block_kv", "splits", "max_concurrent_steps"))
def paged_attention_partials(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    page_table: jax.Array,
    prefix_len: jax.Array,
    new_start: jax.Array,
    new_bits: jax.Array,
    *,
    num_new: int,
    interpret: bool = False,
    block_kv: int = BLOCK_KV,
    splits: int | None = None,
    max_concurrent_steps: int | None = None,
) -> Partials:
    """Partials of q [B, Nk, R, D] over the pages of k/v_pool [num_pages, page_size, Nk, D] that
    page_table int32 [B, M] names: row b's query rows see positions [0, prefix_len[b]) and, of the
    num_new positions from new_start[b] (both int32 [B]), those their bits new_bits int32
    [B, W, R] name (`new_token_bits`); positions >= M * page_size are seen by no one.

    q and the pools share a 16-bit dtype; R is a multiple of 64, at most MAX_ROWS; D a multiple of
    64; page_size divides block_kv (or is a multiple of 64 up to 256, then the block is one page).
    Scale 1/sqrt(D). splits (default: `default_splits`; at most one per block of the table) and
    max_concurrent_steps (the KV ring's slots; default: `ring_depth`) tune the GPU kernel. Returns
    o [B, Nk, splits, R, D], m and l [B, Nk, splits, R], float32.
    """
    batch, kv_heads, rows, head_dim = q.shape
    num_pages, page_size = k_pool.shape[:2]
    max_len = page_table.shape[1] * page_size
    words = new_bits.shape[1]
    block_kv = max(block_kv, page_size)
    if max_concurrent_steps is None:
        max_concurrent_steps = max(1, ring_depth(rows, head_dim, block_kv, words, q.dtype))
    _check_shapes(q, k_pool, v_pool, block_kv, max_concurrent_steps, words)
    pages_per_block = block_kv // page_size
    table_blocks = -(-max_len // block_kv)
    splits = default_splits(batch, kv_heads, table_blocks) if splits is None else max(1, min(splits, table_blocks))
    padded = -(-page_table.shape[1] // pages_per_block) * pages_per_block
    table = jnp.pad(
        page_table.astype(jnp.int32), ((0, 0), (0, padded - page_table.shape[1])), constant_values=num_pages
    )
    lens = jnp.stack([prefix_len, new_start], axis=1).astype(jnp.int32)

    kernel = plgpu.kernel(
        functools.partial(_kernel, num_new=num_new, max_len=max_len, splits=splits, depth=max_concurrent_steps),
        out_type=(
            jax.ShapeDtypeStruct((batch, kv_heads, splits, rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, splits, rows), jnp.float32),
        ),
        scratch_types=(
            plgpu.SMEM((rows, head_dim), q.dtype, transforms=_tiled(q.dtype)),
            plgpu.SMEM((max_concurrent_steps, block_kv, head_dim), q.dtype, transforms=_tiled(q.dtype)),
            plgpu.SMEM((max_concurrent_steps, block_kv, head_dim), q.dtype, transforms=_tiled(q.dtype)),
            plgpu.SMEM((words, rows), jnp.int32),
            plgpu.SMEM((rows, block_kv), q.dtype, transforms=_tiled(q.dtype)),
            plgpu.SMEM((rows, head_dim), jnp.float32, transforms=_tiled(jnp.float32)),
            plgpu.SMEM((rows,), jnp.float32),
            plgpu.SMEM((rows,), jnp.float32),
            plgpu.Barrier(num_arrivals=2, num_barriers=1),
            plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=max_concurrent_steps),
            plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=max_concurrent_steps),
        ),
        grid=(batch, kv_heads, splits),
        grid_names=("row", "head", "split"),
        interpret=interpret_params() if interpret else None,
    )
    o, m, l = kernel(lens, table, new_bits, q, k_pool, v_pool)
    return Partials(o, m, l)


def _check_shapes(q, k_pool, v_pool, block_kv: int, max_concurrent_steps: int, words: int) -> None:
    batch, kv_heads, rows, head_dim = q.shape
    page_size = k_pool.shape[1]
    if not (q.dtype == k_pool.dtype == v_pool.dtype) or jnp.dtype(q.dtype).itemsize != 2:
        raise ValueError(
            "paged attention kernel needs one 16-bit dtype for q and the pools (wgmma transposes only "
            f"16-bit operands), got q {q.dtype}, k_pool {k_pool.dtype}, v_pool {v_pool.dtype}"
        )
    if k_pool.shape != v_pool.shape or k_pool.shape[2:] != (kv_heads, head_dim):
        raise ValueError(
            f"paged attention pools must both be [num_pages, page_size, Nk={kv_heads}, D={head_dim}] "
            f"(from q [B, Nk, R, D] = {q.shape}), got k_pool {k_pool.shape}, v_pool {v_pool.shape}"
        )
    if rows % ROW_TILE or not ROW_TILE <= rows <= MAX_ROWS:
        raise ValueError(f"paged attention query rows R must be a multiple of {ROW_TILE} up to {MAX_ROWS}, got {rows}")
    if head_dim % 64:
        raise ValueError(f"paged attention head dim must be a multiple of 64, got {head_dim}")
    if page_size % 8 or block_kv % page_size or block_kv % 64 or block_kv > 256:
        raise ValueError(
            f"paged attention page_size {page_size} must be a multiple of 8 dividing block_kv {block_kv}, "
            "itself a multiple of 64 up to 256"
        )
    need = smem_bytes(rows, head_dim, block_kv, max_concurrent_steps, words, q.dtype)
    if need > SMEM_BYTES:
        raise ValueError(
            f"paged attention needs {need} bytes of shared memory (rows {rows}, head dim {head_dim}, block_kv "
            f"{block_kv}, max_concurrent_steps {max_concurrent_steps}), over the {SMEM_BYTES} of one block"
        )
    if max_concurrent_steps < 1 or math.prod(q.shape) == 0:
        raise ValueError(f"paged attention needs max_concurrent_steps >= 1 and a non-empty q, got {q.shape}")
