"""Flash attention over packed rows at the cost of their sequences' own lengths (cuDNN's packed layout).

A trainer packs many sequences into each row of W tokens (`jaxspec.rl.batch.pack_rows`,
`jaxspec.pretrain.data.pack`); each attends causally within itself. Given as a [B, 1, W, W] mask of
equal segment ids, flash attention still computes every causal block of the row, W^2 / 2 scores
where the sequences need the sum of their L^2 / 2 (a GRPO row of 16k tokens holding ~2k-token
answers: ~8x the work), and XLA materialises the mask as a [B, 1, W, W] bias (0.5 GB per row at
W = 16384). cuDNN's packed layout takes each row's sequences as (offset, length) pairs instead and
attends within each sequence alone:

    segment_ids [B, W] (1, 2, ... per sequence, 0 on padding after them)
        -> lengths [B, M], offsets [B, M + 1]     (-1 past a row's last sequence)
        -> cuDNN flash attention, causal within each sequence; padding neither read nor written

M, the most sequences a row may hold, is static: `segment_cap(W)`, which the packers keep to
where the packed layout may run (`packing_cap`); a forward called outside jit on a row holding more
raises an error that names it (`check_segment_cap`).
The layout needs a Hopper GPU or newer. JAXSPEC_PACKED_ATTENTION chooses, read when a forward is
traced: "auto" (the default) the packed layout for rows of AUTO_MIN_WIDTH tokens or more on one
Hopper or newer GPU and the segment mask elsewhere; "packed" the packed layout for any rows, on
meshes of such GPUs too; "mask" the segment mask everywhere. Below AUTO_MIN_WIDTH the mask's bias
is small (32 MB a row at 4096) and the layout's bound of 8 sequences would cut rows of many short
sequences (`small`'s arithmetic answers) into more rows. On one H200 (lease VV) both layouts agree
with XLA's attention to the same bf16 error, and 2 rows of 16384 tokens holding 8 sequences each
cost 1.03x (forward) / 1.17x (forward and backward) the same tokens as 16 rows of 2048, against
3.13x / 3.39x with the mask.
On a mesh JAX's partitioning of the cuDNN call splits it as the rows and heads are split (rows over
data x fsdp, heads over tensor; a row's tokens are never split, so each device's spans are its own
rows'): compiled without a device for 2 and 4 H200s (`benchmarks/compiled_training_attention.py`),
each device's call holds its rows and heads and the layout adds no collective to the step; it
becomes "auto"'s choice on meshes once `JAXSPEC_PACKED_ATTENTION=packed python3 -m
tests.gpu.check_layouts` has passed on several GPUs.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

TOKENS_PER_SEQUENCE = 512  # the mean sequence length down to which segment_cap never cuts a row
AUTO_MIN_WIDTH = 4096  # the narrowest rows "auto" gives the packed layout
ENV = "JAXSPEC_PACKED_ATTENTION"


def segment_cap(width: int) -> int:
    """M for packed rows of `width` tokens: the multiple of 8 that covers width / 512, so that a row
    of sequences of 512 tokens or more on average is never cut by the cap. The cost of the bound is
    M (offset, length) slots per row, which cuDNN skips when empty."""
    return 8 * -(-width // (8 * TOKENS_PER_SEQUENCE))


def run_starts(segment_ids: jax.Array, xp=jnp) -> jax.Array:
    """bool [B, T]: where a run of equal segment ids (a sequence, or padding) begins; xp: the array
    module (numpy for concrete ids read on the host)."""
    first = xp.ones_like(segment_ids[:, :1], bool)
    return xp.concatenate([first, segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)


def segment_spans(segment_ids: jax.Array, slots: int) -> tuple[jax.Array, jax.Array]:
    """(lengths int32 [B, slots], offsets int32 [B, slots + 1]): the sequences (runs of equal
    non-zero segment ids) of packed rows, in order: row b's run r starts at offsets[b, r] and holds
    lengths[b, r] tokens; both are -1 for a run of padding and past a row's last run, and offsets'
    last column is -1 (cuDNN's form).

    segment_ids int32 [B, T]: 1, 2, ... per sequence, each sequence's tokens contiguous, 0 on
    padding; every row's runs up to its last sequence must fit `slots`."""
    run = jnp.cumsum(run_starts(segment_ids), axis=1, dtype=jnp.int32) - 1  # [B, T]: each token's run, from 0
    member = (run[:, :, None] == jnp.arange(slots, dtype=jnp.int32)) & (segment_ids > 0)[:, :, None]
    lengths = member.sum(axis=1, dtype=jnp.int32)  # [B, slots]
    starts = jnp.argmax(member, axis=1).astype(jnp.int32)
    present = lengths > 0
    lengths = jnp.where(present, lengths, -1)
    offsets = jnp.where(present, starts, -1)
    return lengths, jnp.pad(offsets, ((0, 0), (0, 1)), constant_values=-1)


def check_segment_cap(segment_ids: jax.Array) -> None:
    """Raises ValueError naming the row where a row of segment_ids int32 [B, T] holds more runs up to
    its last sequence than `segment_cap(T)`, the most the packed layout reads (the rest would attend
    to nothing). Checked where the ids are concrete (a forward called outside jit, or a jitted one
    that closes over them), in numpy: under a trace even a constant's jnp results are traced. Where
    they are traced the packers' bound (`packing_cap`) holds it: an in-graph check would need a host
    callback, which keeps a step out of JAX's persistent compilation cache."""
    if isinstance(segment_ids, jax.core.Tracer):
        return
    ids = np.asarray(segment_ids)
    runs = np.where(ids > 0, np.cumsum(run_starts(ids, np), axis=1), 0).max(axis=1)  # [B]: up to the last sequence
    width, cap = segment_ids.shape[1], segment_cap(segment_ids.shape[1])
    if runs.max(initial=0) > cap:
        row = int(runs.argmax())
        raise ValueError(
            f"packed row {row} holds {int(runs[row])} runs of segment ids up to its last sequence, more than the "
            f"{cap} that cuDNN's packed layout reads from rows of {width} tokens (segment_cap): pack rows "
            f"with jaxspec's packers, which keep to packing_cap, or set {ENV}=mask"
        )


LAYOUTS = ("auto", "packed", "mask")


def selected_layout() -> str:
    """JAXSPEC_PACKED_ATTENTION: "auto" (the default), "packed" or "mask"."""
    setting = os.environ.get(ENV, "auto")
    if setting not in LAYOUTS:
        raise ValueError(f"{ENV}={setting!r}: expected one of {', '.join(LAYOUTS)}")
    return setting


def packing_cap(width: int) -> int | None:
    """The most sequences a packer may put into a row that a forward reads as `width` tokens:
    `segment_cap(width)` where the packed layout may run on such rows (`packed_layout_here` on one
    device or a mesh), else None (the segment mask takes any number, and a bound would only add
    rows)."""
    return segment_cap(width) if packed_layout_here(width, on_mesh=False) else None


def packed_layout_here(width: int, on_mesh: bool) -> bool:
    """Whether a forward over packed rows of `width` tokens uses cuDNN's packed layout here: this
    process's GPUs take it and JAXSPEC_PACKED_ATTENTION selects it ("packed"; "auto" for rows of
    AUTO_MIN_WIDTH tokens or more off a mesh of several devices). The packed layout on a mesh implies
    it on one device, so `packing_cap` (on_mesh=False) bounds the rows wherever a forward may use it."""
    layout = selected_layout()
    auto = layout == "auto" and width >= AUTO_MIN_WIDTH and not on_mesh
    return hopper_or_newer() and (layout == "packed" or auto)


@functools.cache
def hopper_or_newer() -> bool:
    """Whether this process's GPUs have compute capability 9.0 or newer (no GPU: False)."""
    if jax.default_backend() != "gpu":
        return False
    capability = getattr(jax.devices()[0], "compute_capability", "0.0")
    return tuple(int(x) for x in str(capability).split(".")[:2]) >= (9, 0)


def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Causal grouped-query attention within each sequence of packed rows, by cuDNN.

    q [B, T, Nq, D], k/v [B, T, Nk, D], segment_ids int32 [B, T] as `segment_spans` reads them, at
    most `segment_cap(T)` sequences per row, padding after the last -> [B, T, Nq, D], zero on
    padding. cuDNN neither reads nor writes a position outside every sequence: there its output and
    its q/k/v gradients hold whatever the memory held, so both are selected away (a select, not a
    product, so that not even a NaN there reaches the weights' gradients). Padding costs nothing."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    valid = (segment_ids > 0)[:, :, None, None]
    q, k, v = (jnp.where(valid, x, jax.lax.stop_gradient(x)) for x in (q, k, v))  # no gradient from padding
    lengths, offsets = segment_spans(segment_ids, segment_cap(q.shape[1]))
    out = dot_product_attention(
        q,
        k,
        v,
        q_seqlen=lengths,
        kv_seqlen=lengths,
        q_offsets=offsets,
        kv_offsets=offsets,
        scale=q.shape[-1] ** -0.5,
        mask_type=MaskType.PADDING_CAUSAL,
        qkv_layout="BTNH",
    )
    return jnp.where(valid, out, jnp.zeros((), out.dtype))
