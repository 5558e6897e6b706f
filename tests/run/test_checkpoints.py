"""Resume from the newest checkpoint that restores: damaged ones are reported, moved aside, never deleted."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.run import Checkpointer, truncate_metrics
from tests.run.damage import empty_metadata, truncate_largest_data_file


def _state(step: int) -> dict:
    return {
        "params": {"w": jnp.arange(4096, dtype=jnp.float32) * step, "b": jnp.full((3,), step, jnp.float32)},
        "step": jnp.int32(step),
    }


def _run(directory, steps=(10, 20)) -> Checkpointer:
    checkpointer = Checkpointer(directory, keep=5)
    for step in steps:
        checkpointer.save(_state(step))
    checkpointer.close()
    return Checkpointer(directory, keep=5)


@pytest.mark.parametrize("damage", [truncate_largest_data_file, empty_metadata])
def test_a_damaged_newest_checkpoint_is_moved_aside_and_the_older_one_resumes(tmp_path, damage):
    checkpoints = tmp_path / "checkpoints"
    checkpointer = _run(checkpoints)
    damage(checkpoints / "20")
    lines = []
    state = checkpointer.resume(_state(0), report=lines.append)
    assert int(state["step"]) == 10
    np.testing.assert_array_equal(np.asarray(state["params"]["w"]), np.asarray(_state(10)["params"]["w"]))
    assert len(lines) == 1 and f"checkpoint {checkpoints / '20'} is damaged (" in lines[0], lines
    assert "resuming from step 10" in lines[0]
    aside = [p.name for p in checkpoints.iterdir() if p.name.startswith("20.damaged-")]
    assert len(aside) == 1 and aside[0] in lines[0] and not (checkpoints / "20").exists()
    # The run goes on: step 20 is written again beside the damaged copy, and is the one resumed next.
    checkpointer.save(_state(20))
    checkpointer.close()
    again = Checkpointer(checkpoints, keep=5)
    assert int(again.resume(_state(0), report=lines.append)["step"]) == 20 and len(lines) == 1
    again.close()
    assert (checkpoints / aside[0]).is_dir()
    damage(checkpoints / "20")  # damaged again: a second copy is kept beside the first
    third = Checkpointer(checkpoints, keep=5)
    assert int(third.resume(_state(0), report=lines.append)["step"]) == 10 and len(lines) == 2
    assert len(list(checkpoints.glob("20.damaged-*"))) == 2 and sorted(third.manager.all_steps()) == [10]


def test_when_no_checkpoint_restores_the_error_lists_them_and_nothing_moves(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    checkpointer = _run(checkpoints)
    empty_metadata(checkpoints / "20")
    truncate_largest_data_file(checkpoints / "10")
    with pytest.raises(ValueError) as err:
        checkpointer.resume(_state(0), report=print)
    message = str(err.value)
    assert message.startswith(f"--resume: no checkpoint in {checkpoints} restores (tried {checkpoints / '20'}: ")
    assert f"; {checkpoints / '10'}: " in message and "nothing was moved or deleted" in message
    assert sorted(p.name for p in checkpoints.iterdir()) == ["10", "20"]


def test_resume_without_checkpoints_says_so_and_starts_fresh(tmp_path):
    lines = []
    checkpointer = Checkpointer(tmp_path / "new" / "checkpoints", keep=2)
    assert checkpointer.resume(_state(0), report=lines.append) is None
    assert lines == [f"--resume: no checkpoint in {tmp_path / 'new' / 'checkpoints'}; starting a new run"]


def test_truncate_metrics_keeps_records_up_to_the_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in (0, 1, 2, 3, 2)))
    truncate_metrics(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 2]
    truncate_metrics(path, -1)
    assert path.read_text() == ""
    truncate_metrics(tmp_path / "absent.jsonl", 3)
    assert not (tmp_path / "absent.jsonl").exists()


def test_a_torn_last_line_is_dropped_and_a_bad_line_before_it_is_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "rew')
    reports = []
    assert truncate_metrics(path, 5, reports.append) == [{"step": 1}, {"step": 2}]
    assert reports == [
        f"{path}: dropped its last line, cut short while it was written (Unterminated string starting "
        f"at: line 1 column 13 (char 12))"
    ]
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    path.write_text('{"step": 1}\n{"step": 2, "rew\n{"step": 3}\n')
    with pytest.raises(ValueError, match=rf"{path}: line 2 is not a JSON record \(Unterminated string"):
        truncate_metrics(path, 5, reports.append)


def test_each_save_is_timed_until_it_is_on_disk(tmp_path, monkeypatch):
    """longest_write_s measures a save from its start until orbax reports it complete in the
    background, not only the part `save` blocks for."""
    import time

    import orbax.checkpoint as ocp

    checkpointer = Checkpointer(tmp_path / "checkpoints", keep=5)
    assert checkpointer.longest_write_s is None
    checkpointer.save(_state(1))
    checkpointer.close()
    assert 0 < checkpointer.longest_write_s < 60

    finalize = ocp.CompositeCheckpointHandler.finalize

    def slow_finalize(self, directory):  # a slow disk: the save completes 2 s after `save` returned
        time.sleep(2.0)
        return finalize(self, directory)

    monkeypatch.setattr(ocp.CompositeCheckpointHandler, "finalize", slow_finalize)
    checkpointer = Checkpointer(tmp_path / "checkpoints", keep=5)
    start = time.perf_counter()
    checkpointer.save(_state(2))
    assert time.perf_counter() - start < 2.0 and checkpointer.longest_write_s is None  # still being written
    checkpointer.close()
    assert checkpointer.longest_write_s >= 2.0
