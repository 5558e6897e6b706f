"""benchmarks/occupancy.py: rows running per decode step of staged calls and of slots, from the
recorded lengths, against step-by-step simulations."""

import json
import sys

import numpy as np
import pytest

from tests.benchmarks.scripts import load_script

occupancy = load_script("occupancy")


def simulate_slots(lengths, slots):
    """Rows decoding at each step, one step at a time: free slots take the next rows in order, every
    decoding row emits one token, a row that has emitted its length leaves its slot."""
    queue, decoding, counts = list(lengths), [], []
    while queue or decoding:
        while len(decoding) < slots and queue:
            decoding.append(queue.pop(0))
        counts.append(len(decoding))
        decoding = [n - 1 for n in decoding if n > 1]
    return np.array(counts)


@pytest.mark.parametrize("slots", [1, 3, 8, 40])
def test_slot_occupancy_is_the_step_by_step_simulation(slots):
    lengths = np.random.default_rng(slots).integers(1, 200, 40)
    got = occupancy.slot_running(lengths, slots)
    np.testing.assert_array_equal(got, simulate_slots(lengths, slots))
    assert got.sum() == lengths.sum() and got.max() == min(slots, len(lengths))


def test_staged_occupancy_counts_the_rows_longer_than_each_step():
    lengths = np.random.default_rng(0).integers(1, 300, 64)
    running = occupancy.running_rows(lengths)
    assert len(running) == lengths.max()
    np.testing.assert_array_equal(running, [(lengths > t).sum() for t in range(lengths.max())])
    np.testing.assert_array_equal(occupancy.slot_running(lengths, 64), running)  # as many slots as rows
    # stages of 64 and 32 rows: the loop decodes 64 rows until 32 or fewer run
    widths = occupancy.stage_widths(running, 64)
    np.testing.assert_array_equal(widths, np.where(running > 32, 64, 32))


def test_the_command_reads_a_bench_spec_result(tmp_path, monkeypatch, capsys):
    lengths = [10, 2, 3, 4, 1, 1, 1, 6]
    result = {
        "baseline": {"sub_batch": 4},
        "rows": [
            {"config": "ar", "slots": None, "lengths": lengths},
            {"config": "ar slots=2", "slots": 2, "lengths": lengths, "seconds": 0.017, "step_ms": 1.0},
        ],
    }
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(result))
    out = tmp_path / "occupancy.json"
    monkeypatch.setattr(sys, "argv", ["occupancy", str(path), "--slots-config", "ar slots=2", "--out", str(out)])
    assert occupancy.main() == 0
    assert "idealised: 17 decode steps (the measured run: 17)" in capsys.readouterr().out
    summary = json.loads(out.read_text())
    first, second = summary["calls"]  # rows [10, 2, 3, 4] and [1, 1, 1, 6]
    assert (first["steps"], second["steps"]) == (10, 6)
    assert first["mean_occupancy"] == pytest.approx((10 + 2 + 3 + 4) / (10 * 4))
    assert second["steps_at_most_0.25"] == pytest.approx(5 / 6)
    assert summary["slots"]["steps"] == 17 and summary["slots"]["measured_steps"] == 17

    monkeypatch.setattr(sys, "argv", ["occupancy", str(path), "--config", "eagle3"])
    with pytest.raises(SystemExit, match="spec.json: no configuration 'eagle3'"):
        occupancy.main()
    monkeypatch.setattr(sys, "argv", ["occupancy", str(path), "--slots-config", "ar"])
    with pytest.raises(SystemExit, match="'ar' is not a slot configuration"):
        occupancy.main()


def test_admission_orders_and_their_steps():
    """Two slots, groups of two rows: in row order the long row comes last and runs alone; longest
    first (known, or predicted by a history whose long prompt is the same) ends at the longest row;
    a history that predicts the wrong prompt long does not."""
    lengths = np.array([2, 2, 3, 1, 1, 9])
    assert len(occupancy.slot_running(lengths, 2)) == 13  # the 9 starts at step 4
    right, wrong = np.array([1, 1, 1, 1, 5, 7]), np.array([8, 8, 1, 1, 1, 1])
    orders = occupancy.admission_orders(lengths, 2, {"right": right, "wrong": wrong})
    steps = {name: len(occupancy.slot_running(lengths, 2, order)) for name, order in orders.items()}
    assert steps == {
        "row order": 13,
        "longest first (known lengths)": 9,
        "by right's mean per prompt": 9,
        "by wrong's mean per prompt": 13,
    }
    for order in orders.values():  # every row admitted once: the same tokens decoded
        assert occupancy.slot_running(lengths, 2, order).sum() == lengths.sum()


def test_the_command_compares_admission_orders(tmp_path, monkeypatch, capsys):
    result = {
        "baseline": {"sub_batch": None, "samples_per_prompt": 2},
        "rows": [
            {"config": "ar", "slots": None, "lengths": [1, 1, 1, 1, 5, 7]},
            {"config": "ar slots=2", "slots": 2, "lengths": [2, 2, 3, 1, 1, 9], "seconds": 0.013, "step_ms": 1.0},
        ],
    }
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(result))
    argv = ["occupancy", str(path), "--slots-config", "ar slots=2", "--admission-history", "ar"]
    monkeypatch.setattr(sys, "argv", argv)
    assert occupancy.main() == 0
    out = capsys.readouterr().out
    assert "| row order | 13 | 1.000 |" in out and "| by ar's mean per prompt | 9 | 0.692 |" in out
    monkeypatch.setattr(sys, "argv", ["occupancy", str(path), "--admission-history", "ar"])
    with pytest.raises(SystemExit, match="needs --slots-config"):
        occupancy.main()
