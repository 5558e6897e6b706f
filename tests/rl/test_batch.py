"""The typed training batch: training rows, their selection, packing, and the step's rollouts."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxspec.models import packed_attention
from jaxspec.rl.batch import (
    PackedRows,
    Rollouts,
    TrainingRows,
    minibatch_indices,
    pack_rows,
    packed_row_counts,
    training_rows,
)
from jaxspec.rl.compilation import packed_inputs
from jaxspec.rl.config import GRPOLossConfig
from jaxspec.run.placement import MeshConfig, Placement


def test_training_rows_layout():
    prompts = [[5, 6, 7], [8]]
    tokens = np.array([[9, 2, 0, 0], [10, 11, 12, 13]])
    rows = training_rows(prompts, tokens, np.array([2, 4]), pad_id=0)
    assert rows.tokens.shape == (2, 16 + 4)
    assert rows.tokens[0, :6].tolist() == [5, 6, 7, 9, 2, 0]
    assert rows.tokens[1, :6].tolist() == [8, 10, 11, 12, 13, 0]
    assert rows.attn_mask.sum(axis=1).tolist() == [5, 5]
    assert rows.resp_index.tolist() == [[2, 3, 4, 5], [0, 1, 2, 3]]
    assert rows.resp_mask.tolist() == [[True, True, False, False], [True] * 4]
    assert np.flatnonzero(rows.seq_resp_mask[0]).tolist() == [3, 4]
    with pytest.raises(ValueError, match="width 6"):
        training_rows(prompts, tokens, np.array([2, 4]), pad_id=0, width=6)
    chunks = list(minibatch_indices(8, 2, np.random.default_rng(0)))
    assert sorted(np.concatenate(chunks).tolist()) == list(range(8)) and all(len(c) == 4 for c in chunks)


def test_pack_rows_layout():
    """First-fit-decreasing packing: every sequence's tokens, segment and response positions."""
    prompts = [[5, 6, 7], [8], [9, 9, 9, 9]]
    tokens = np.array([[9, 2, 0, 0], [10, 11, 12, 13], [14, 0, 0, 0]])
    rows = training_rows(prompts, tokens, np.array([2, 4, 1]), pad_id=0, width=10)
    rows = rows.replace(advantages=np.array([1.0, 2.0, 3.0], np.float32))
    packed = pack_rows(rows)
    # Lengths 5, 5, 5 in width 10: sequences 0 and 1 share row 0 (by length, then id), 2 takes row 1.
    assert packed.tokens.tolist() == [[5, 6, 7, 9, 2, 8, 10, 11, 12, 13], [9, 9, 9, 9, 14, 0, 0, 0, 0, 0]]
    assert packed.segment_ids.tolist() == [[1] * 5 + [2] * 5, [1] * 5 + [0] * 5]
    assert packed.seq_resp_mask[0].tolist() == [False] * 3 + [True] * 2 + [False] + [True] * 4
    flat = packed.tokens.reshape(-1)
    for s in range(3):  # the logits at resp_index predict the response token that follows them
        for j in range(rows.resp_mask[s].sum()):
            assert flat[packed.resp_index[s, j] + 1] == rows.resp_tokens[s, j]
    assert packed.resp_index.max() < packed.tokens.size  # past-the-end entries stay in range
    np.testing.assert_array_equal(packed.advantages, rows.advantages)
    assert pack_rows(rows, multiple_of=4).tokens.shape == (4, 10)
    assert pack_rows(rows, multiple_of=3).tokens.shape == (3, 10)


def test_pack_rows_keeps_to_the_packed_layout_s_sequences_per_row(monkeypatch):
    """40 sequences of 3 tokens fill 2 rows of 64 by their tokens; where the packed layout is selected,
    at most segment_cap(64) = 8 per row, they take 5 (6 with packed_row_count's rounding), a count the
    precompiled set holds."""
    width, seqs = 64, 40
    attn_mask = np.arange(width)[None, :] < 3
    rows = TrainingRows(
        tokens=np.ones((seqs, width), np.int32),
        attn_mask=np.repeat(attn_mask, seqs, axis=0),
        resp_index=np.zeros((seqs, 2), np.int32),
        resp_tokens=np.zeros((seqs, 2), np.int32),
        resp_mask=np.ones((seqs, 2), bool),
    )
    monkeypatch.delenv(packed_attention.ENV, raising=False)
    assert pack_rows(rows).segment_ids.max(axis=1).tolist() == [21, 19]  # the mask takes any number
    monkeypatch.setenv(packed_attention.ENV, "packed")
    monkeypatch.setattr(packed_attention, "hopper_or_newer", lambda: True)  # where the layout runs
    packed = pack_rows(rows)
    assert packed_attention.segment_cap(width) == 8 and packed.segment_ids.max(axis=1).tolist() == [8] * 5 + [0]
    assert (packed.segment_ids > 0).sum() == 3 * seqs
    assert packed.tokens.shape[0] in packed_row_counts(seqs, width, 3)


def test_take_selects_every_given_field_and_absent_fields_stay_absent():
    prompts = [[5, 6, 7], [8], [9, 9]]
    tokens = np.array([[9, 2, 0, 0], [10, 11, 12, 13], [14, 0, 0, 0]])
    rows = training_rows(prompts, tokens, np.array([2, 4, 1]), pad_id=0, width=10)
    rows = rows.replace(
        advantages=np.array([1.0, 2.0, 3.0], np.float32),
        prox_logp=np.zeros((3, 4), np.float32),
        loss_mask=rows.resp_mask,
        seq_resp_mask=None,
    )
    picked = rows.take(np.array([2, 0]))
    for field in dataclasses.fields(rows):
        value = getattr(rows, field.name)
        if value is None:
            assert getattr(picked, field.name) is None, field.name
        else:
            np.testing.assert_array_equal(getattr(picked, field.name), value[[2, 0]], err_msg=field.name)
    # 5 row fields without seq_resp_mask, 3 loss inputs: the absent ones are no leaves of the pytree
    assert len(jax.tree.leaves(picked)) == 8
    scoring = rows.response_rows()
    assert scoring.seq_resp_mask is None and scoring.advantages is None and scoring.loss_mask is None
    assert pack_rows(scoring).advantages is None and pack_rows(scoring).seq_resp_mask is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        rows.advantages = None


@pytest.mark.parametrize(
    "loss, online",
    [
        (GRPOLossConfig(), False),
        (GRPOLossConfig(kl_beta=0.1), True),
        (GRPOLossConfig(recompute_logprobs=True, tis_cap=2.0), False),
    ],
)
def test_precompiled_minibatch_has_the_structure_of_a_packed_one(loss, online):
    """The abstract minibatch the trainer is compiled for ahead of time has the fields, shapes and
    dtypes of the minibatch the step packs, so the step reuses that compilation."""
    prompts, new = [[5, 6, 7], [8], [9, 9], [4]], 4
    rows = training_rows(prompts, np.full((4, new), 3), np.array([2, 4, 1, 3]), pad_id=0, width=10)
    logp = np.zeros((4, new), np.float32)
    rows = rows.replace(
        advantages=np.ones(4, np.float32),
        prox_logp=logp,
        loss_mask=rows.resp_mask,
        loss_denominator=np.full(4, 8.0, np.float32),
        ref_logp=logp if loss.kl_beta > 0 else None,
        behaviour_logp=logp if loss.weighs_behaviour else None,
        seq_resp_mask=rows.seq_resp_mask if online else None,
    )
    packed = pack_rows(rows)
    expected = packed_inputs(Placement(MeshConfig()), packed.tokens.shape[0], 4, 10, new, loss, seq_resp_mask=online)
    assert jax.tree.structure(packed) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(packed), jax.tree.leaves(expected)):
        assert (got.shape, got.dtype) == (want.shape, want.dtype)
    scoring = packed_inputs(Placement(MeshConfig()), 2, 4, 10, new, None)
    assert jax.tree.structure(pack_rows(rows.response_rows())) == jax.tree.structure(scoring)
    assert isinstance(scoring, PackedRows)


def test_rollouts_of_several_rounds_keep_the_selected_ones():
    """DAPO's refill: the rounds concatenated, then the kept rows; the first round's statistics and
    every round's generated tokens."""

    def round_(offset, stats):
        lengths = np.array([1, 2]) + offset
        return Rollouts(
            prompts=[[offset], [offset + 1]],
            records=[{"i": offset}, {"i": offset + 1}],
            tokens=np.arange(4).reshape(2, 2) + offset,
            lengths=lengths,
            logprobs=np.full((2, 2), -offset, np.float32),
            scores=np.array([0.0, 1.0]) + offset,
            rewards=np.array([0.5, 1.5]) + offset,
            stats=stats,
            generated_tokens=int(lengths.sum()),
        )

    first, second = round_(0, {"steps": 3}), round_(10, {"steps": 5})
    kept = Rollouts.concatenate([first, second]).take(np.array([3, 0]))
    assert kept.prompts == [[11], [0]] and kept.records == [{"i": 11}, {"i": 0}]
    np.testing.assert_array_equal(kept.tokens, [second.tokens[1], first.tokens[0]])
    np.testing.assert_array_equal(kept.lengths, [12, 1])
    np.testing.assert_array_equal(kept.rewards, [11.5, 0.5])
    np.testing.assert_array_equal(kept.scores, [11.0, 0.0])
    np.testing.assert_array_equal(kept.logprobs, [[-10, -10], [0, 0]])
    assert kept.stats == {"steps": 3} and kept.generated_tokens == 3 + 23
