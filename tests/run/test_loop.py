"""The run loop every training command shares, driven by a stand-in program: records written once,
evaluations before the first and after the last step, a stop by signal or time limit that
checkpoints without exporting, metrics cut back on resume, and the first error kept."""

import json
import os
import signal

import pytest

from jaxspec.run import RunLoop
from jaxspec.run.deadline import Deadline


class _Checkpointer:
    def __init__(self, latest=None):
        self.saved, self.closed, self.longest_write_s, self.latest = [], False, None, latest

    def latest_step(self):
        return self.saved[-1] if self.saved else self.latest

    def close(self):
        self.closed = True


class _Program:
    """`steps` steps from `step`; a record per step, a checkpoint every 2 steps; `during_step`
    runs inside each step."""

    name = "fake"

    def __init__(self, steps=3, step=0, resumed=False, during_step=lambda step: None):
        self.steps, self.step, self.resumed = steps, step, resumed
        self.checkpointer = _Checkpointer(latest=step if resumed else None)
        self.during_step, self.calls = during_step, []

    def run_step(self):
        self.step += 1
        self.calls.append(("step", self.step))
        self.during_step(self.step)
        if self.step % 2 == 0 or self.step == self.steps:
            self.save()
        return [{"step": self.step, "loss": 1.0 / self.step}], {"loss": f"{1.0 / self.step:.2f}"}

    def save(self):
        self.checkpointer.saved.append(self.step)

    def evaluate(self, final):
        self.calls.append(("evaluate", final))
        return {"step": self.step, "eval_accuracy": 0.5 if final else 0.25}

    def export(self, seconds):
        self.calls.append(("export", seconds >= 0))

    def close(self):
        self.calls.append(("close", self.checkpointer.closed))


def _lines(run_dir):
    return (run_dir / "metrics.jsonl").read_text().splitlines()


def test_a_run_logs_each_record_once_and_evaluates_and_exports_at_the_ends(tmp_path, capsys):
    seen = []
    loop = RunLoop(tmp_path, progress=False, time_stamps=False, on_record=seen.append)
    program = _Program(steps=3)
    outcome = loop.run(program)
    records = [
        {"step": 0, "eval_accuracy": 0.25},
        {"step": 1, "loss": 1.0},
        {"step": 2, "loss": 0.5},
        {"step": 3, "loss": 1.0 / 3},
        {"step": 3, "eval_accuracy": 0.5},
    ]
    assert _lines(tmp_path) == [json.dumps(r) for r in records]  # as written: no time stamp
    assert seen == records and outcome.finished and outcome.last == records[-1]
    assert program.calls == [
        ("evaluate", False),
        ("step", 1),
        ("step", 2),
        ("step", 3),
        ("evaluate", True),
        ("close", False),  # the program's resources first, the checkpointer after them
        ("export", True),
    ]
    assert program.checkpointer.saved == [2, 3] and program.checkpointer.closed
    assert "checkpointed" not in capsys.readouterr().out


def test_a_signal_checkpoints_at_the_step_boundary_and_skips_the_export(tmp_path, capsys):
    def terminate_at_3(step):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    program = _Program(steps=6, during_step=terminate_at_3)
    outcome = RunLoop(tmp_path, progress=False).run(program)
    assert not outcome.finished and program.step == 3
    assert program.checkpointer.saved == [2, 3]  # step 3 saved by the loop: not on the schedule
    assert ("export", True) not in program.calls and ("evaluate", True) not in program.calls
    assert f"SIGTERM: checkpointed step 3 in {tmp_path / 'checkpoints'}; continue with --resume" in (
        capsys.readouterr().out
    )
    assert [json.loads(line)["step"] for line in _lines(tmp_path)] == [0, 1, 2, 3]


def test_the_time_limit_stops_where_a_step_and_a_checkpoint_would_overrun(tmp_path, capsys):
    """Steps of 10 s by the clock and stop_by at 35 s: after step 2 (20 s) one more step and a
    checkpoint (as long as a step while none was measured) end at 40 s."""
    now = [0.0]

    def ten_seconds(step):
        now[0] += 10.0

    loop = RunLoop(tmp_path, progress=False)
    loop.deadline = Deadline(stop_by=35.0, clock=lambda: now[0])
    program = _Program(steps=6, during_step=ten_seconds)
    assert not loop.run(program).finished
    assert program.step == 2 and program.checkpointer.saved == [2]
    assert "time limit (the job must stop by" in capsys.readouterr().out


def test_a_resumed_run_keeps_the_records_up_to_its_checkpoint_and_a_new_one_none(tmp_path):
    earlier = [{"step": 0, "eval_accuracy": 0.1}, {"step": 1, "loss": 9.0}, {"step": 2, "loss": 8.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier + [{"step": 3}]))
    RunLoop(tmp_path, progress=False, time_stamps=False).run(_Program(steps=3, step=2, resumed=True))
    assert [json.loads(line) for line in _lines(tmp_path)] == earlier + [
        {"step": 3, "loss": 1.0 / 3},
        {"step": 3, "eval_accuracy": 0.5},
    ]
    RunLoop(tmp_path, progress=False, time_stamps=False).run(_Program(steps=1))
    assert [json.loads(line)["step"] for line in _lines(tmp_path)] == [0, 1, 1]


def test_a_failing_step_is_the_error_raised_and_everything_is_closed(tmp_path):
    def fail(step):
        raise RuntimeError(f"step {step} failed")

    program = _Program(steps=3, during_step=fail)

    def failing_close():
        program.checkpointer.closed = True
        raise OSError("the checkpoint in flight failed too")

    program.checkpointer.close = failing_close
    with pytest.raises(RuntimeError, match="step 1 failed"):
        RunLoop(tmp_path, progress=False).run(program)
    assert program.checkpointer.closed and ("close", False) in program.calls


def test_a_failing_close_after_the_last_step_is_raised_and_nothing_is_exported(tmp_path):
    program = _Program(steps=2)

    def failing_close():
        raise OSError("the last checkpoint could not be written")

    program.checkpointer.close = failing_close
    with pytest.raises(OSError, match="the last checkpoint could not be written"):
        RunLoop(tmp_path, progress=False).run(program)
    assert ("export", True) not in program.calls
