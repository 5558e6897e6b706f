"""The training batch of a GRPO step, typed: the rollouts of a step (`Rollouts`), their right-padded
training rows with the loss inputs added step by step (`TrainingRows`), minibatch splits, and the
packing of a minibatch's rows into few full-width rows for the trainer's forward (`PackedRows`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jaxspec.models.packed_attention import packing_cap
from jaxspec.rollout.prompts import prompt_bucket


@dataclasses.dataclass(frozen=True)
class Rollouts:
    """A step's B rollouts (samples_per_prompt of each prompt, groups contiguous) and their rewards,
    on the host.

    prompts: B prompt token lists; records: B prompt records (the reward functions' examples);
    tokens int32 [B, N]; lengths int32 [B] (tokens emitted); logprobs float32 [B, N] (the rollout's
    log-probs of its tokens); scores float64 [B] (the reward functions'); rewards float64 [B]
    (scores with the overlong penalty); stats: the generation's statistics; generated_tokens: tokens
    generated for the step (every generation round's); reward_failures: responses whose grading
    failed and scored 0 (every round's); staleness / rollout_version
    (rollout.mode async, else None): trained version - the batch's weights version, and that version;
    experts: the experts the rollout routed each position to, [B, P + N, L_sparse, k]
    (`RolloutOutput.experts`), or None when not recorded (`jaxspec.rl.routing.records_experts`).
    """

    prompts: list
    records: list
    tokens: np.ndarray
    lengths: np.ndarray
    logprobs: np.ndarray
    scores: np.ndarray
    rewards: np.ndarray
    stats: dict
    generated_tokens: int
    reward_failures: int = 0
    staleness: int | None = None
    rollout_version: int | None = None
    experts: np.ndarray | None = None

    def take(self, rows: np.ndarray) -> Rollouts:
        """The rollouts `rows` (int [B']), in that order; statistics and counts unchanged."""
        return dataclasses.replace(
            self,
            prompts=[self.prompts[i] for i in rows],
            records=[self.records[i] for i in rows],
            tokens=self.tokens[rows],
            lengths=self.lengths[rows],
            logprobs=self.logprobs[rows],
            scores=self.scores[rows],
            rewards=self.rewards[rows],
            experts=None if self.experts is None else self.experts[rows],
        )

    @staticmethod
    def concatenate(rounds: Sequence[Rollouts]) -> Rollouts:
        """The rollouts of several generation rounds one after the other: the first round's
        statistics, every round's generated tokens."""
        return dataclasses.replace(
            rounds[0],
            prompts=[p for r in rounds for p in r.prompts],
            records=[x for r in rounds for x in r.records],
            tokens=np.concatenate([r.tokens for r in rounds]),
            lengths=np.concatenate([r.lengths for r in rounds]),
            logprobs=np.concatenate([r.logprobs for r in rounds]),
            scores=np.concatenate([r.scores for r in rounds]),
            rewards=np.concatenate([r.rewards for r in rounds]),
            generated_tokens=sum(r.generated_tokens for r in rounds),
            reward_failures=sum(r.reward_failures for r in rounds),
            experts=None if rounds[0].experts is None else np.concatenate([r.experts for r in rounds]),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainingRows:
    """B rollouts as right-padded training rows of width W (N = max_new_tokens), host arrays.

    `training_rows` makes the row fields; the step adds the loss inputs with `replace` (fields left
    None are absent: a pytree without those leaves).
      tokens int32 [B, W]: prompt, the emitted response tokens, then pad_id;
      attn_mask bool [B, W]: the prompt and response tokens;
      resp_index int32 [B, N]: position of the logits that predict response token j
          (prompt_len - 1 + j, clamped into the row for j past the length);
      resp_tokens int32 [B, N]: the response tokens (pad_id past the length);
      resp_mask bool [B, N]: j < length;
      seq_resp_mask bool [B, W]: positions holding response tokens (None: no online head reads it);
      advantages float32 [B]: the group-relative advantages;
      prox_logp float32 [B, N]: the proximal log-probs, the clip's anchor (the trainer's
          recomputation, or the rollout's own without loss.recompute_logprobs);
      loss_mask bool [B, N]: response tokens of the rollouts that count in the loss;
      loss_denominator float32 [B]: the step-level token count `jaxspec.rl.loss.loss_denominator`,
          repeated (None: each minibatch its own);
      ref_logp float32 [B, N]: the reference's temperature-only log-probs (loss.kl_beta > 0);
      behaviour_logp float32 [B, N]: the rollout's log-probs where prox_logp is the trainer's
          recomputation (`GRPOLossConfig.weighs_behaviour`);
      experts [B, W, L_sparse, k]: the experts the rollout routed each position to, column for
          column with tokens (`jaxspec.rl.routing`; None: not recorded, or not replayed).
    """

    tokens: np.ndarray
    attn_mask: np.ndarray
    resp_index: np.ndarray
    resp_tokens: np.ndarray
    resp_mask: np.ndarray
    seq_resp_mask: np.ndarray | None = None
    advantages: np.ndarray | None = None
    prox_logp: np.ndarray | None = None
    loss_mask: np.ndarray | None = None
    loss_denominator: np.ndarray | None = None
    ref_logp: np.ndarray | None = None
    behaviour_logp: np.ndarray | None = None
    experts: np.ndarray | None = None

    def replace(self, **fields: Any) -> TrainingRows:
        return dataclasses.replace(self, **fields)

    def take(self, rows: np.ndarray) -> TrainingRows:
        """The rows `rows` (int [B']) of every field."""
        return jax.tree.map(lambda x: x[rows], self)

    def response_rows(self) -> TrainingRows:
        """The token rows and their recorded experts (what log-prob scoring packs): no loss inputs,
        no seq_resp_mask."""
        return TrainingRows(
            self.tokens, self.attn_mask, self.resp_index, self.resp_tokens, self.resp_mask, experts=self.experts
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedRows:
    """The trainer's input: S training rows packed into R rows of width W (`pack_rows`); N =
    max_new_tokens. The per-sequence fields are those of the `TrainingRows` packed (None where
    they were None).
      tokens int32 [R, W]; segment_ids int32 [R, W]: 1, 2, ... per sequence within a row, 0 = padding;
      resp_index int32 [S, N]: flat position (row * W + column) of the logits that predict
          response token j of sequence s;
      resp_tokens int32 [S, N];
      seq_resp_mask bool [R, W]: positions holding response tokens (the online head's loss);
      advantages float32 [S]; prox_logp float32 [S, N]; loss_mask bool [S, N];
      loss_denominator float32 [S]; ref_logp float32 [S, N]; behaviour_logp float32 [S, N];
      experts [R, W, L_sparse, k]: the recorded experts packed like the tokens (expert 0 at padding).
    """

    tokens: Any
    segment_ids: Any
    resp_index: Any
    resp_tokens: Any
    seq_resp_mask: Any = None
    advantages: Any = None
    prox_logp: Any = None
    loss_mask: Any = None
    loss_denominator: Any = None
    ref_logp: Any = None
    behaviour_logp: Any = None
    experts: Any = None

    def replace(self, **fields: Any) -> PackedRows:
        return dataclasses.replace(self, **fields)


def row_width(longest_prompt: int, max_new_tokens: int) -> int:
    """Training row width W for prompts of up to `longest_prompt` tokens: the prompt bucket + N.

    A run fixes W from its whole prompt set, so the trainer compiles once.
    """
    return prompt_bucket(longest_prompt) + max_new_tokens


def training_rows(
    prompts: Sequence[Sequence[int]], tokens: np.ndarray, lengths: np.ndarray, pad_id: int, width: int | None = None
) -> TrainingRows:
    """Prompt + response rows for the trainer's forward: the row fields of `TrainingRows`
    (seq_resp_mask included), no loss inputs yet.

    prompts: B token lists; tokens int32 [B, N] rollout tokens; lengths int32 [B] tokens emitted.
    width: W (default `row_width` of these prompts); must hold the longest prompt + N.
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
        rows[b, : prompt_lens[b]] = prompt
        rows[b, prompt_lens[b] : prompt_lens[b] + max_new] = resp_tokens[b]
    positions = np.arange(width)
    total = prompt_lens + lengths
    return TrainingRows(
        tokens=rows,
        attn_mask=positions[None, :] < total[:, None],
        resp_index=np.minimum(prompt_lens[:, None] - 1 + j[None, :], width - 1).astype(np.int32),
        resp_tokens=resp_tokens,
        resp_mask=resp_mask,
        seq_resp_mask=(positions[None, :] >= prompt_lens[:, None]) & (positions[None, :] < total[:, None]),
    )


def minibatch_indices(num_rows: int, num_minibatches: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Row ids of `num_minibatches` equal minibatches of one shuffled pass over the rows (sorted ids)."""
    if num_rows % num_minibatches:
        raise ValueError(f"{num_minibatches} minibatches do not divide {num_rows} rows")
    order = rng.permutation(num_rows) if num_minibatches > 1 else np.arange(num_rows)
    for chunk in np.split(order, num_minibatches):
        yield np.sort(chunk)


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
    tokens in rows of width W: from the rows their tokens fill at the least (S * shortest / W, and
    S / `packing_cap(W)`) to one row per sequence."""
    cap = packing_cap(width) or num_seqs
    least = max(-(-num_seqs * shortest // width), -(-num_seqs // cap))
    counts = [packed_row_count(least, multiple_of)]
    while counts[-1] < packed_row_count(num_seqs, multiple_of):
        counts.append(packed_row_count(counts[-1] + 1, multiple_of))
    return counts


def pack_rows(rows: TrainingRows, multiple_of: int = 1) -> PackedRows:
    """The trainer's input for a set of S training rows: the sequences packed first-fit-decreasing
    into R rows of the same width W (see `PackedRows`).

    RL responses are mostly far shorter than max_new_tokens, so right-padded rows are mostly
    padding; packed, the forward costs what the tokens cost. A row holds at most
    `packed_attention.packing_cap(W)` sequences (the bound of cuDNN's packed layout, where selected).
    R is the smallest `packed_row_count`
    (a multiple of `multiple_of`, e.g. the mesh's batch-axis size) that holds them, so a run
    compiles the trainer for the few row counts of `packed_row_counts` only. The per-sequence
    fields ([S] or [S, N]) pass unchanged; seq_resp_mask and experts are packed like the tokens when
    given.
    """
    tokens = rows.tokens
    num_seqs, width = tokens.shape
    lengths = rows.attn_mask.sum(axis=1)
    cap = packing_cap(width) or num_seqs
    free, held = [], []  # free columns and sequences per packed row
    placed = np.zeros((num_seqs, 2), np.int64)  # (row, start)
    for s in sorted(range(num_seqs), key=lambda i: (-lengths[i], i)):
        row = next((r for r, room in enumerate(free) if room >= lengths[s] and held[r] < cap), len(free))
        if row == len(free):
            free.append(width)
            held.append(0)
        placed[s] = row, width - free[row]
        free[row] -= lengths[s]
        held[row] += 1
    num_rows = packed_row_count(len(free), multiple_of)
    packed_tokens, segment_ids = np.zeros((num_rows, width), np.int32), np.zeros((num_rows, width), np.int32)
    seq_resp_mask = None if rows.seq_resp_mask is None else np.zeros((num_rows, width), bool)
    experts = None if rows.experts is None else np.zeros((num_rows, *rows.experts.shape[1:]), rows.experts.dtype)
    segment = np.zeros(num_rows, np.int32)
    for s in range(num_seqs):
        (row, start), n = placed[s], lengths[s]
        segment[row] += 1
        packed_tokens[row, start : start + n] = tokens[s, :n]
        segment_ids[row, start : start + n] = segment[row]
        if seq_resp_mask is not None:
            seq_resp_mask[row, start : start + n] = rows.seq_resp_mask[s, :n]
        if experts is not None:
            experts[row, start : start + n] = rows.experts[s, :n]
    columns = np.minimum(placed[:, 1:] + rows.resp_index, width - 1)  # past-the-end tokens stay in the row
    return PackedRows(
        tokens=packed_tokens,
        segment_ids=segment_ids,
        resp_index=(placed[:, :1] * width + columns).astype(np.int32),
        resp_tokens=rows.resp_tokens,
        seq_resp_mask=seq_resp_mask,
        advantages=rows.advantages,
        prox_logp=rows.prox_logp,
        loss_mask=rows.loss_mask,
        loss_denominator=rows.loss_denominator,
        ref_logp=rows.ref_logp,
        behaviour_logp=rows.behaviour_logp,
        experts=experts,
    )
