"""Prompt batches: validation, shared-prefill grouping of identical prompts, shape buckets.

Shapes that reach compiled code are rounded up to buckets so that new prompt lengths or a new
number of distinct prompts inside a bucket reuse the compiled programs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from jaxspec.models.config import ModelConfig

MIN_PROMPT_BUCKET = 16
LARGEST_POWER_OF_TWO_BUCKET = 1024


def prompt_bucket(length: int) -> int:
    """Padded prompt length: the next power of two >= 16 up to 1024, then a multiple of 1024."""
    if length <= LARGEST_POWER_OF_TWO_BUCKET:
        return max(MIN_PROMPT_BUCKET, 1 << max(0, length - 1).bit_length())
    return -(-length // LARGEST_POWER_OF_TWO_BUCKET) * LARGEST_POWER_OF_TWO_BUCKET


def count_bucket(count: int, batch: int) -> int:
    """Padded number of distinct prompts: the next power of two, at most the batch size."""
    return min(batch, 1 << max(0, count - 1).bit_length())


class PromptBatch(NamedTuple):
    """Distinct prompts, right-padded, and the map from batch rows to them.

    tokens: int32 [U, P] distinct prompts padded with 0 (U, P bucketed; rows past the real
        distinct count are filler of length 1).
    lengths: int32 [U] real length of each distinct prompt.
    row_prompt: int32 [B] index into the distinct prompts of each batch row.
    row_lengths: int32 [B] prompt length of each batch row.
    num_distinct: number of real distinct prompts.
    row_max_new: int32 [B] the most tokens each batch row may emit (`row_limits`).
    """

    tokens: np.ndarray
    lengths: np.ndarray
    row_prompt: np.ndarray
    row_lengths: np.ndarray
    num_distinct: int
    row_max_new: np.ndarray


def validate_prompts(cfg: ModelConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[tuple[int, ...]]:
    """Checks token ids and lengths; returns the prompts as tuples of Python ints."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray)):
        raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: pass at least one prompt")
    checked = []
    for i, prompt in enumerate(prompts):
        ids = np.asarray(prompt)
        if ids.ndim != 1:
            raise ValueError(f"prompts[{i}] must be a flat list of token ids, got shape {ids.shape}")
        if ids.size == 0:
            raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompts[{i}] must hold integer token ids, got dtype {ids.dtype}")
        bad = (ids < 0) | (ids >= cfg.vocab_size)
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(f"prompts[{i}][{j}] = {int(ids[j])} is outside the vocabulary [0, {cfg.vocab_size})")
        if ids.size + max_new_tokens > cfg.max_position_embeddings:
            raise ValueError(
                f"prompts[{i}] has {ids.size} tokens; with max_new_tokens={max_new_tokens} that exceeds the "
                f"model context max_position_embeddings={cfg.max_position_embeddings}"
            )
        checked.append(tuple(ids.tolist()))
    return checked


def row_limits(limits: Sequence[int] | None, num_rows: int, max_new_tokens: int) -> np.ndarray:
    """Each row's limit on emitted tokens, int32 [B]: `limits` checked (B integers in [1,
    max_new_tokens]), or max_new_tokens for every row when None."""
    if limits is None:
        return np.full((num_rows,), max_new_tokens, np.int32)
    values = np.asarray(limits)
    if values.shape != (num_rows,) or not np.issubdtype(values.dtype, np.integer):
        raise ValueError(
            f"row_max_new_tokens must hold one integer per prompt ({num_rows}), got shape {values.shape} "
            f"of dtype {values.dtype}"
        )
    bad = (values < 1) | (values > max_new_tokens)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"row_max_new_tokens[{i}] = {int(values[i])} is outside [1, max_new_tokens={max_new_tokens}] "
            "(sampling.max_new_tokens is every row's upper bound)"
        )
    return values.astype(np.int32)


def group_prompts(prompts: Sequence[tuple[int, ...]], row_max_new: np.ndarray, min_width: int = 1) -> PromptBatch:
    """Groups identical prompts so each distinct prompt is prefilled once (in first-seen order).
    The padded width is the bucket of the longest prompt, or of `min_width` tokens if longer.
    row_max_new: int32 [B] each row's limit on emitted tokens (`row_limits`)."""
    index: dict[tuple[int, ...], int] = {}
    row_prompt = np.array([index.setdefault(p, len(index)) for p in prompts], np.int32)
    distinct = list(index)
    num_rows = count_bucket(len(distinct), len(prompts))
    width = prompt_bucket(max(min_width, *(len(p) for p in distinct)))
    tokens = np.zeros((num_rows, width), np.int32)
    lengths = np.ones((num_rows,), np.int32)
    for u, p in enumerate(distinct):
        tokens[u, : len(p)] = p
        lengths[u] = len(p)
    return PromptBatch(
        tokens=tokens,
        lengths=lengths,
        row_prompt=row_prompt,
        row_lengths=lengths[row_prompt],
        num_distinct=len(distinct),
        row_max_new=row_max_new,
    )
