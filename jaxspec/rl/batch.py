"""Host-side assembly of a rollout batch: right-padded training rows, minibatch splits, and the
packing of a minibatch's rows into few full-width rows for the trainer's forward."""

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


SEQUENCE_FIELDS = ("resp_tokens", "resp_mask", "advantages", "old_logp", "loss_mask", "ref_logp", "rollout_logp",
                   "loss_denominator")


def packed_row_count(filled: int, multiple_of: int = 1) -> int:
    """R for `filled` occupied rows: the smallest 2^k or 3 * 2^k (1, 2, 3, 4, 6, 8, 12, ...) times
    `multiple_of` that holds them, so at most a third of the rows are padding (powers of two alone
    waste up to half, and a trainer over packed rows costs what its rows cost)."""
    groups = -(-max(filled, 1) // multiple_of)
    size = 1 << (groups - 1).bit_length()
    if size >= 4 and size // 4 * 3 >= groups:
        size = size // 4 * 3
    return multiple_of * size


def packed_row_counts(num_seqs: int, width: int, shortest: int, multiple_of: int = 1) -> list[int]:
    """Every R (ascending) that `pack_rows` can give S = num_seqs sequences of at least `shortest`
    tokens in rows of width W: from the rows their tokens fill at the least (S * shortest / W) to
    one row per sequence."""
    counts = [packed_row_count(-(-num_seqs * shortest // width), multiple_of)]
    while counts[-1] < packed_row_count(num_seqs, multiple_of):
        counts.append(packed_row_count(counts[-1] + 1, multiple_of))
    return counts


def pack_rows(rows: dict[str, np.ndarray], multiple_of: int = 1) -> dict[str, np.ndarray]:
    """The trainer's input for a set of S training rows (`training_rows` fields plus per-sequence
    ones): the sequences packed first-fit-decreasing into R rows of the same width W.

    RL responses are mostly far shorter than max_new_tokens, so right-padded rows are mostly
    padding; packed, the forward costs what the tokens cost. R is the smallest `packed_row_count`
    (a multiple of `multiple_of`, e.g. the mesh's batch-axis size) that holds them, so a run
    compiles the trainer for the few row counts of `packed_row_counts` only.
    Returns
      tokens int32 [R, W]; segment_ids int32 [R, W]: 1, 2, ... per sequence within a row, 0 = padding;
      seq_resp_mask bool [R, W] (when given): positions holding response tokens;
      resp_index int32 [S, N]: flat position (row * W + column) of the logits that predict
          response token j of sequence s;
    and the per-sequence fields ([S] or [S, N]: resp_tokens, advantages, ...) unchanged.
    """
    tokens = rows["tokens"]
    num_seqs, width = tokens.shape
    lengths = rows["attn_mask"].sum(axis=1)
    free, placed = [], np.zeros((num_seqs, 2), np.int64)  # free columns per packed row; (row, start)
    for s in sorted(range(num_seqs), key=lambda i: (-lengths[i], i)):
        row = next((r for r, room in enumerate(free) if room >= lengths[s]), len(free))
        if row == len(free):
            free.append(width)
        placed[s] = row, width - free[row]
        free[row] -= lengths[s]
    num_rows = packed_row_count(len(free), multiple_of)
    packed = {"tokens": np.zeros((num_rows, width), np.int32), "segment_ids": np.zeros((num_rows, width), np.int32)}
    if "seq_resp_mask" in rows:
        packed["seq_resp_mask"] = np.zeros((num_rows, width), bool)
    segment = np.zeros(num_rows, np.int32)
    for s in range(num_seqs):
        (row, start), n = placed[s], lengths[s]
        segment[row] += 1
        packed["tokens"][row, start:start + n] = tokens[s, :n]
        packed["segment_ids"][row, start:start + n] = segment[row]
        if "seq_resp_mask" in rows:
            packed["seq_resp_mask"][row, start:start + n] = rows["seq_resp_mask"][s, :n]
    columns = np.minimum(placed[:, 1:] + rows["resp_index"], width - 1)  # past-the-end tokens stay in the row
    packed["resp_index"] = (placed[:, :1] * width + columns).astype(np.int32)
    packed.update({k: rows[k] for k in SEQUENCE_FIELDS if k in rows})
    return packed
