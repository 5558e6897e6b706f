"""Packing examples into rows (`jaxspec.pretrain.data`)."""

import numpy as np

from jaxspec.models import packed_attention
from jaxspec.pretrain.data import PackedSet, pack


def test_pack_layout():
    examples = [([1, 2, 3, 4], 2), ([5, 6, 7], 1), ([8] * 12, 3), ([9, 9], 1)]
    packed = pack(examples, max_len=7, pad_id=0, seed=0)
    assert packed.dropped == 1 and packed.num_examples == 3  # the 12-token example does not fit
    assert packed.tokens.shape[1] == 8 and packed.weights.shape[1] == 7
    rows = []
    for tokens, segments, weights in zip(packed.tokens, packed.segment_ids, packed.weights):
        for seg in range(1, segments.max() + 1):
            where = np.flatnonzero(segments == seg)
            assert np.array_equal(where, np.arange(where[0], where[-1] + 1))  # contiguous
            ids = tokens[where].tolist()
            rows.append(ids)
            prompt_len = dict((tuple(e), p) for e, p in examples)[tuple(ids)]
            counted = np.flatnonzero(weights[where[0] : where[-1]]) + where[0] + 1  # target positions
            assert counted.tolist() == list(range(where[0] + prompt_len, where[-1] + 1))
        assert not tokens[segments == 0].any()
        assert weights[segments[:-1] == 0].sum() == 0
    assert sorted(rows) == sorted(e for e, _ in examples if len(e) <= 7)


def test_pack_keeps_to_the_packed_layout_s_sequences_per_row(monkeypatch):
    examples = [([7, 7], 1)] * 20  # 40 tokens: one row of 64 by tokens, three at 8 per row
    monkeypatch.delenv(packed_attention.ENV, raising=False)
    assert pack(examples, max_len=64, pad_id=0, seed=0).segment_ids.max(axis=1).tolist() == [20]  # no GPU: no bound
    monkeypatch.setenv(packed_attention.ENV, "packed")
    monkeypatch.setattr(packed_attention, "hopper_or_newer", lambda: True)  # where the layout runs
    packed = pack(examples, max_len=64, pad_id=0, seed=0)
    assert packed_attention.segment_cap(64) == 8 and packed.segment_ids.max(axis=1).tolist() == [8, 8, 4]
    assert packed.num_examples == 20


def test_packed_set_takes_rows():
    n, width = 10, 5
    data = PackedSet(
        tokens=np.arange(n * width, dtype=np.int32).reshape(n, width),
        segment_ids=np.arange(n * width, dtype=np.int32).reshape(n, width) + 1,
        weights=np.arange(n * (width - 1), dtype=np.float32).reshape(n, width - 1),
        num_examples=n,
        dropped=0,
    )
    rows = np.array([7, 2, 2])
    batch = data.take(rows)
    for name in ("tokens", "segment_ids", "weights"):
        np.testing.assert_array_equal(batch[name], getattr(data, name)[rows])
