"""Attention of a few new tokens per row over that row's pages of a KV cache (Triton, called from
JAX through `jax_triton.triton_call`): the attention kernel of both engines. The slot engine's
paged cache is a pool of pages; the staged engine's dense cache [B, S, Nk, D] is a pool of B
pages of S positions, row b's table naming page b (`jaxspec.models.attention.cache_attention`).

The contract of `jaxspec.kernels.attention_partials`: row b's query rows see its prefix,
positions [0, prefix_len[b]), and those of its num_new new tokens at positions new_start[b] + j
that their tree-mask bits name (`new_token_bits`); position p lives in page
page_table[b, p // page_size], and an entry outside [0, num_pages) (`NO_PAGE`) is a page of
zeros, as the reference's gather reads it; positions past the table are seen by no one. The
pools are [P, page_size, Nk, D] (the engines' layout: a position's heads adjacent), or with
heads_major [P, Nk, page_size, D] (a head's positions of a page adjacent; `jaxspec bench attention
--heads-major` times the two).

One program per (kv head, row, split), as `default_splits` shares a row's blocks among splits
(`split_runs`); the kv head is the grid's fastest axis, so that a row's heads run side by side
and read each page together (a position's heads are adjacent in the pool). Its query rows (the
new tokens x the query heads of the kv head, padded to a power of two >= 16, `query_rows`) stay
in registers; the loop over its blocks of `block_kv` positions gathers K and V through the page
table (one table entry per position, so any page size works), computes the scores on the tensor
cores (float32 accumulate), applies the mask, and keeps an online softmax in float32; it returns
flash-attention partials (`Partials`) that `merge` combines. A program reads only the blocks up to
its row's last new token (a finished row: its new tokens' blocks), and of those only the
positions some query row sees.

`triton` is imported with this module; `jax_triton` only when the kernel is called for a GPU, and
torch only to run it in Triton's interpreter (`interpret=True`, any backend, slow).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import triton.language as tl

from jaxspec.kernels import triton_call
from jaxspec.kernels.attention_partials import MAX_QUERY_ROWS, WORD_BITS, Partials

BLOCK_KV = 64  # positions per loop step
MIN_ROWS = 16  # the smallest tl.dot operand
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
TARGET_PROGRAMS = 1024  # (kv head, row, split) programs that keep an H100's 132 SMs busy
MIN_BLOCKS_PER_SPLIT = 4
MAX_ROWS = 65535  # the most a CUDA grid's second axis launches
_WORD_BITS = tl.constexpr(WORD_BITS)  # a global a Triton kernel reads must be a constexpr


def _paged_attention(
    prefix_ptr,
    start_ptr,
    table_ptr,
    bits_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    m_ptr,
    l_ptr,
    NUM_PAGES: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TABLE_LEN: tl.constexpr,
    KV_HEADS: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    WORDS: tl.constexpr,
    NUM_NEW: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    SCALE: tl.constexpr,
    DOT_IN_FLOAT32: tl.constexpr,
    HEADS_MAJOR: tl.constexpr,
    SHARED_BITS: tl.constexpr,
):
    """One (kv head, row, split) program; shapes as in `paged_attention_partials`. DOT_IN_FLOAT32
    multiplies float32 copies of the operands (exactly as a 16-bit dot accumulating in float32),
    for an interpreter that cannot multiply bfloat16. HEADS_MAJOR: the pools are [P, Nk, page, D].
    SHARED_BITS: the bits are [1, W, R], every row's."""
    h = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    s = tl.program_id(2)
    prefix_len = tl.load(prefix_ptr + b)
    new_start = tl.load(start_ptr + b)
    bits_row = 0 if SHARED_BITS else b
    max_len = TABLE_LEN * PAGE_SIZE
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, HEAD_DIM)
    columns = tl.arange(0, BLOCK_KV)
    q = tl.load(q_ptr + ((b * KV_HEADS + h) * ROWS + rows[:, None]) * HEAD_DIM + dims[None, :])
    if DOT_IN_FLOAT32:
        q = q.to(tl.float32)

    # This program's run of the row's blocks: those up to its last new token (past the last
    # position they were dropped), from block 0, or, for a finished row, from its new tokens.
    end = tl.minimum(new_start + NUM_NEW, max_len)
    lo = tl.where(prefix_len > 0, 0, new_start // BLOCK_KV)
    hi = (end + BLOCK_KV - 1) // BLOCK_KV
    per_split = (tl.maximum(hi - lo, 0) + SPLITS - 1) // SPLITS
    first = lo + s * per_split
    last = tl.minimum(hi, first + per_split)

    o = tl.full((ROWS, HEAD_DIM), 0.0, tl.float32)
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    l = tl.full((ROWS,), 0.0, tl.float32)
    for block in range(first, last):
        position = block * BLOCK_KV + columns
        index = position // PAGE_SIZE
        entry = tl.load(table_ptr + b * TABLE_LEN + index, mask=index < TABLE_LEN, other=NUM_PAGES)
        held = (entry >= 0) & (entry < NUM_PAGES)  # else the reference reads zeros: score 0, value 0
        read = held & ((position < prefix_len) | ((position >= new_start) & (position < end)))
        if HEADS_MAJOR:
            row_of = ((entry.to(tl.int64) * KV_HEADS + h) * PAGE_SIZE + position % PAGE_SIZE) * HEAD_DIM
        else:
            row_of = ((entry.to(tl.int64) * PAGE_SIZE + position % PAGE_SIZE) * KV_HEADS + h) * HEAD_DIM
        k = tl.load(k_ptr + row_of[:, None] + dims[None, :], mask=read[:, None], other=0.0)
        v = tl.load(v_ptr + row_of[:, None] + dims[None, :], mask=read[:, None], other=0.0)
        if DOT_IN_FLOAT32:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * SCALE  # float32 [ROWS, BLOCK_KV]

        rel = position - new_start
        visible = (position < prefix_len)[None, :] & (rows >= 0)[:, None]
        for w in tl.static_range(WORDS):
            word = tl.load(bits_ptr + (bits_row * WORDS + w) * ROWS + rows)  # int32 [ROWS]
            in_word = (rel >= w * _WORD_BITS) & (rel < (w + 1) * _WORD_BITS) & (rel < NUM_NEW)
            shift = tl.minimum(tl.maximum(rel - w * _WORD_BITS, 0), _WORD_BITS - 1)
            bit = (word[:, None] >> shift[None, :]) & 1
            visible = visible | (in_word[None, :] & (bit == 1))
        visible = visible & (position < max_len)[None, :]
        scores = tl.where(visible, scores, float("-inf"))

        m_next = tl.maximum(m, tl.reduce(scores, 1, triton_call.MAX))
        m_safe = tl.where(m_next == float("-inf"), 0.0, m_next)  # a query row that has seen nothing yet
        rescale = tl.exp(m - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l = rescale * l + tl.reduce(p, 1, triton_call.SUM)
        p = p.to(v.dtype)  # rounded as the 16-bit dot's operand
        if DOT_IN_FLOAT32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        o = o * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_next

    out = ((b * KV_HEADS + h) * SPLITS + s) * ROWS + rows
    tl.store(o_ptr + out[:, None] * HEAD_DIM + dims[None, :], o)
    tl.store(m_ptr + out, m)
    tl.store(l_ptr + out, l)


def query_rows(count: int) -> int:
    """Query rows of a program holding `count` (new tokens x query heads per kv head): the next
    power of two, at least MIN_ROWS."""
    return max(MIN_ROWS, 1 << (count - 1).bit_length())


def kernel_applies(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array) -> bool:
    """Whether the kernel takes q [B, T, Nq, D] over pools [P, page_size, Nk, D] (a paged cache's,
    or a dense cache [B, S, Nk, D] as B pages of S positions): one dtype of DTYPES, D a power of
    two in [16, 256], at most MAX_QUERY_ROWS query rows per kv head, at most MAX_ROWS rows."""
    b, t, nq, d = q.shape
    return (
        b <= MAX_ROWS
        and q.dtype == k_pool.dtype == v_pool.dtype
        and jnp.dtype(q.dtype) in DTYPES
        and 16 <= d <= 256
        and d & (d - 1) == 0
        and t * (nq // k_pool.shape[2]) <= MAX_QUERY_ROWS
    )


@functools.partial(
    jax.jit, static_argnames=("num_new", "interpret", "block_kv", "splits", "num_warps", "num_stages", "heads_major")
)
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
    num_warps: int | None = None,
    num_stages: int = 2,
    heads_major: bool = False,
) -> Partials:
    """Partials of q [B, Nk, R, D] over the pages of k/v_pool [num_pages, page_size, Nk, D] that
    page_table int32 [B, M] names: row b's query rows see positions [0, prefix_len[b]) and, of the
    num_new positions from new_start[b] (both int32 [B]), those their bits new_bits int32
    [B, W, R] name (`new_token_bits`); positions >= M * page_size are seen by no one.

    q and the pools share a dtype of DTYPES; R is a power of two in [MIN_ROWS, MAX_QUERY_ROWS]; D a
    power of two >= 16. Scale 1/sqrt(D). block_kv (a power of two >= 16), splits (default:
    `default_splits`; at most one per block of the table), num_warps (default: `default_num_warps`)
    and num_stages tune the GPU kernel; heads_major: the pools are laid out [num_pages, Nk,
    page_size, D] (each head's positions of a page adjacent); interpret runs it in Triton's
    interpreter on the host (`jax.pure_callback`). Returns o [B, Nk, splits, R, D], m and l
    [B, Nk, splits, R], float32.
    """
    batch, kv_heads, rows, head_dim = q.shape
    _check_shapes(q, k_pool, v_pool, new_bits, block_kv, heads_major)
    grid, constants = launch(
        q, k_pool, page_table, new_bits, num_new=num_new, block_kv=block_kv, splits=splits, heads_major=heads_major
    )
    constants["DOT_IN_FLOAT32"] = interpret and q.dtype == jnp.bfloat16
    splits = grid[2]
    out_shape = (
        jax.ShapeDtypeStruct((batch, kv_heads, splits, rows, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((batch, kv_heads, splits, rows), jnp.float32),
        jax.ShapeDtypeStruct((batch, kv_heads, splits, rows), jnp.float32),
    )
    args = (  # the lengths as two arrays: stacked, they would cost a launch of their own
        prefix_len.astype(jnp.int32),
        new_start.astype(jnp.int32),
        page_table.astype(jnp.int32),
        new_bits.astype(jnp.int32),
        q,
        k_pool,
        v_pool,
    )
    return Partials(
        *triton_call.call(
            _paged_attention,
            args,
            out_shape,
            grid=grid,
            constants=constants,
            name="paged_attention_triton",
            interpret=interpret,
            num_warps=default_num_warps(rows, head_dim) if num_warps is None else num_warps,
            num_stages=num_stages,
        )
    )


def launch(
    q,
    k_pool,
    page_table,
    new_bits,
    *,
    num_new: int,
    block_kv: int = BLOCK_KV,
    splits: int | None = None,
    heads_major: bool = False,
):
    """(grid, the kernel's constexpr arguments) of `paged_attention_partials` for arrays (or
    jax.ShapeDtypeStruct) of these shapes; DOT_IN_FLOAT32 False (the GPU's dot). The grid is
    (kv heads, rows, splits)."""
    batch, kv_heads, rows, head_dim = q.shape
    num_pages, page_size = k_pool.shape[0], k_pool.shape[2 if heads_major else 1]
    table_blocks = -(-page_table.shape[1] * page_size // block_kv)
    splits = default_splits(batch, kv_heads, table_blocks) if splits is None else max(1, min(splits, table_blocks))
    constants = dict(
        NUM_PAGES=num_pages,
        PAGE_SIZE=page_size,
        TABLE_LEN=page_table.shape[1],
        KV_HEADS=kv_heads,
        ROWS=rows,
        HEAD_DIM=head_dim,
        WORDS=new_bits.shape[1],
        NUM_NEW=num_new,
        SPLITS=splits,
        BLOCK_KV=block_kv,
        SCALE=head_dim**-0.5,
        DOT_IN_FLOAT32=False,
        HEADS_MAJOR=heads_major,
        SHARED_BITS=new_bits.shape[0] == 1,
    )
    return (kv_heads, batch, splits), constants


def default_splits(batch: int, kv_heads: int, table_blocks: int) -> int:
    """Splits of each (row, kv head)'s blocks that make about TARGET_PROGRAMS programs, with at
    least MIN_BLOCKS_PER_SPLIT of a full table's `table_blocks` per split: a split writes partials
    of R x D float32, as many bytes as it reads with one block of K and V at 64 rows."""
    return max(1, min(TARGET_PROGRAMS // (batch * kv_heads), table_blocks // MIN_BLOCKS_PER_SPLIT))


def default_num_warps(rows: int, head_dim: int) -> int:
    """4 warps, 8 from 128 x 128 query rows x dims (the float32 accumulator of o alone then takes
    128 registers per thread of 4 warps)."""
    return 8 if rows * head_dim >= 128 * 128 else 4


def _check_shapes(q, k_pool, v_pool, new_bits, block_kv: int, heads_major: bool) -> None:
    batch, kv_heads, rows, head_dim = q.shape
    if batch > MAX_ROWS:
        raise ValueError(f"Triton paged attention takes at most {MAX_ROWS} rows a call (its grid's rows), got {batch}")
    if not (q.dtype == k_pool.dtype == v_pool.dtype) or jnp.dtype(q.dtype) not in DTYPES:
        raise ValueError(
            f"Triton paged attention needs one dtype of {[jnp.dtype(d).name for d in DTYPES]} for q and the pools, "
            f"got q {q.dtype}, k_pool {k_pool.dtype}, v_pool {v_pool.dtype}"
        )
    heads_dims = (k_pool.shape[1], k_pool.shape[3]) if heads_major else k_pool.shape[2:]
    if k_pool.shape != v_pool.shape or k_pool.ndim != 4 or tuple(heads_dims) != (kv_heads, head_dim):
        layout = "[num_pages, Nk, page_size, D]" if heads_major else "[num_pages, page_size, Nk, D]"
        raise ValueError(
            f"Triton paged attention pools must both be {layout} with Nk={kv_heads}, D={head_dim} "
            f"(from q [B, Nk, R, D] = {q.shape}), got k_pool {k_pool.shape}, v_pool {v_pool.shape}"
        )
    if rows != query_rows(rows) or rows > MAX_QUERY_ROWS:
        raise ValueError(
            f"Triton paged attention query rows R must be a power of two in [{MIN_ROWS}, {MAX_QUERY_ROWS}], got {rows}"
        )
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"Triton paged attention head dim must be a power of two >= 16, got {head_dim}")
    if block_kv < 16 or block_kv & (block_kv - 1):
        raise ValueError(f"Triton paged attention block_kv must be a power of two >= 16, got {block_kv}")
    if new_bits.ndim != 3 or new_bits.shape[0] not in (1, batch) or new_bits.shape[2] != rows:
        raise ValueError(f"Triton paged attention new_bits must be [B={batch} or 1, W, R={rows}], got {new_bits.shape}")
