"""Host-side assembly of a rollout batch into right-padded training rows, and minibatch splits."""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from jaxspec.rollout.prompts import prompt_bucket


def row_width(longest_prompt: int, max_new_tokens: int) -> int:
    """Training row width W for prompts of up to `longest_prompt` tokens: the prompt bucket + N.

    A run fixes W from its whole prompt set, so the trainer compiles once.
    """
    return prompt_bucket(longest_prompt) + max_new_tokens


def training_rows(prompts: Sequence[Sequence[int]], tokens: np.ndarray, lengths: np.ndarray, pad_id: int,
                  width: int | None = None) -> dict[str, np.ndarray]:
    """Prompt + response rows for the trainer's forward.

    prompts: B token lists; tokens int32 [B, N] rollout tokens; lengths int32 [B] tokens emitted.
    width: W (default `row_width` of these prompts); must hold the longest prompt + N.
    Returns
      tokens int32 [B, W]: prompt, the emitted response tokens, then pad_id;
      attn_mask bool [B, W]: the prompt and response tokens;
      resp_index int32 [B, N]: position of the logits that predict response token j
          (prompt_len - 1 + j, clamped into the row for j past the length);
      resp_tokens int32 [B, N]: the response tokens (pad_id past the length);
      resp_mask bool [B, N]: j < length;
      seq_resp_mask bool [B, W]: positions holding response tokens.
    """
    tokens = np.asarray(tokens)
    lengths = np.asarray(lengths)
    num_rows, max_new = tokens.shape
    prompt_lens = np.array([len(p) for p in prompts], np.int32)
    needed = int(prompt_lens.max()) + max_new
    width = row_width(int(prompt_lens.max()), max_new) if width is None else width
    if width < needed:
        raise ValueError(f"width {width} cannot hold a {int(prompt_lens.max())}-token prompt and {max_new} new tokens")
    rows = np.full((num_rows, width), pad_id, np.int32)
    j = np.arange(max_new)
    resp_mask = j[None, :] < lengths[:, None]
    resp_tokens = np.where(resp_mask, tokens, pad_id).astype(np.int32)
    for b, prompt in enumerate(prompts):
        rows[b, :prompt_lens[b]] = prompt
        rows[b, prompt_lens[b]:prompt_lens[b] + max_new] = resp_tokens[b]
    positions = np.arange(width)
    total = prompt_lens + lengths
    return {
        "tokens": rows,
        "attn_mask": positions[None, :] < total[:, None],
        "resp_index": np.minimum(prompt_lens[:, None] - 1 + j[None, :], width - 1).astype(np.int32),
        "resp_tokens": resp_tokens,
        "resp_mask": resp_mask,
        "seq_resp_mask": (positions[None, :] >= prompt_lens[:, None]) & (positions[None, :] < total[:, None]),
    }


def minibatch_indices(num_rows: int, num_minibatches: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Row ids of `num_minibatches` equal minibatches of one shuffled pass over the rows (sorted ids)."""
    if num_rows % num_minibatches:
        raise ValueError(f"{num_minibatches} minibatches do not divide {num_rows} rows")
    order = rng.permutation(num_rows) if num_minibatches > 1 else np.arange(num_rows)
    for chunk in np.split(order, num_minibatches):
        yield np.sort(chunk)


def take_rows(batch: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, np.ndarray]:
    return {name: value[rows] for name, value in batch.items()}
