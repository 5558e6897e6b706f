"""Stopping before a time limit: one more step and a checkpoint, as long as the longest measured,
must end by JAXSPEC_STOP_BY."""

import pytest

from jaxspec.run.deadline import Deadline


def test_the_last_step_that_fits_is_taken_and_the_next_is_not():
    now = [1000.0]
    deadline = Deadline(stop_by=1400.0, clock=lambda: now[0])
    assert not deadline.too_late()  # nothing measured: only a time already up stops the run
    deadline.record([{"step": 0, "eval_accuracy": 0.5}, {"step": 1, "time_step_s": 100.0}])
    assert deadline.needed_s() == (100.0, 100.0)  # no checkpoint measured: as long as a step
    deadline.checkpoint_written(None)
    deadline.checkpoint_written(50.0)
    assert deadline.needed_s() == (100.0, 50.0)
    now[0] = 1250.0
    assert not deadline.too_late()  # 1250 + 150 = 1400: ends just in time
    now[0] = 1250.5
    assert deadline.too_late()
    assert deadline.reason().endswith("one more step (~100 s) and a checkpoint (~50 s) would end after it")


def test_the_step_estimate_is_the_longest_of_the_last_three():
    deadline = Deadline(stop_by=0.0)
    deadline.record([{"time_step_s": s} for s in (500.0, 20.0, 30.0, 10.0)])
    assert deadline.needed_s()[0] == 30.0
    deadline.checkpoint_written(40.0)
    deadline.checkpoint_written(5.0)
    assert deadline.needed_s() == (30.0, 40.0)


def test_no_stop_by_never_stops_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.delenv("JAXSPEC_STOP_BY", raising=False)
    deadline = Deadline.from_env()
    deadline.record([{"time_step_s": 1e9}])
    assert not deadline.too_late()
    monkeypatch.setenv("JAXSPEC_STOP_BY", "2024-05-01T12:00")
    with pytest.raises(
        ValueError,
        match=r"JAXSPEC_STOP_BY='2024-05-01T12:00': expected the time to stop by, in "
        r"seconds since the epoch",
    ):
        Deadline.from_env()
    monkeypatch.setenv("JAXSPEC_STOP_BY", "1700000000")
    assert Deadline.from_env().stop_by == 1.7e9
