"""How `jaxspec train` ends when something is wrong: bad data refused naming file, line and field; a
reward that cannot grade stopped with its reason; a full disk reported as the last line; each with
the exit status of its kind (`jaxspec.exits`) and one line `jaxspec train: error: ...`."""

import json
import logging
import os
import subprocess
import sys

import pytest

from jaxspec.exits import EXIT_INPUT, EXIT_REWARD, EXIT_STORAGE
from jaxspec.rewards.registry import register_reward, registered_rewards
from tests.rl.runs import LIGHT, REPO, read_metrics, train_cli, write_config

ONE_STEP = [*LIGHT, "train.steps=1", "eval.every=0", "data.num_eval=0", "train.checkpoint_every=1"]


def _last_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("jaxspec train: error: "), err
    return err[-1][len("jaxspec train: error: ") :]


@pytest.mark.parametrize(
    "lines, error",
    [
        (
            ['{"question": "1+1?", "answer": "2"}', '{"question": "2+2?"}'],
            "line 2: the record has no 'answer' (or it is null)",
        ),
        (
            ['{"question": "1+1?", "answer": "2"}', '{"question": "2+2?", "answer": "4"'],
            "line 2: not valid JSON (Expecting ',' delimiter, column 35)",
        ),
    ],
)
def test_bad_data_is_refused_naming_file_line_and_field(tiny_policy, tmp_path, capsys, lines, error):
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(lines) + "\n")
    config = write_config(tmp_path / "run.yaml", tiny_policy[0])
    assert train_cli("--config", config, "--run-dir", tmp_path / "run", *ONE_STEP, f"data.train={data}") == EXIT_INPUT
    assert _last_line(capsys) == f"{data}: {error}"
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def always_zero(response: str, example: dict) -> float:
    return 0.0


CALLS = {"n": 0}


def every_third_fails(response: str, example: dict) -> float:
    CALLS["n"] += 1
    if CALLS["n"] % 3 == 0:
        raise KeyError("no such field")
    return 1.0


def always_fails(response: str, example: dict) -> float:
    raise KeyError("solution")


if "test_always_zero_grader" not in registered_rewards():
    register_reward("test_always_zero_grader", checks=[(r"\boxed{2}", {"answer": "2"}, 1.0)])(always_zero)
    register_reward("test_every_third_fails")(every_third_fails)
    register_reward("test_always_fails")(always_fails)


def test_a_reward_that_cannot_grade_stops_the_run_before_it_starts(tiny_policy, tmp_path, capsys):
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], reward="test_always_zero_grader")
    assert train_cli("--config", config, "--run-dir", tmp_path / "run", *ONE_STEP) == EXIT_REWARD
    assert _last_line(capsys) == (
        "reward 'test_always_zero_grader' cannot grade: its self-test scored 0 instead of 1 "
        "for '\\\\boxed{2}' against the answer '2'"
    )
    assert not (tmp_path / "run").exists()


def test_reward_failures_are_counted_and_a_batch_of_failures_stops_the_run(tiny_policy, tmp_path, capsys, caplog):
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], reward="test_every_third_fails")
    CALLS["n"] = 0
    with caplog.at_level(logging.WARNING, logger="jaxspec.rewards"):
        assert train_cli("--config", config, "--run-dir", tmp_path / "some", *ONE_STEP) == 0
    assert [r["reward_failures"] for r in read_metrics(tmp_path / "some")] == [10]  # calls 3, 6, ..., 30 of 32
    assert [r.message for r in caplog.records] == [
        "reward test_every_third_fails failed on 10 of 32 responses, scored 0 (the first: KeyError: 'no such field')"
    ]

    config = write_config(tmp_path / "all.yaml", tiny_policy[0], reward="test_always_fails")
    assert train_cli("--config", config, "--run-dir", tmp_path / "all", *ONE_STEP) == EXIT_REWARD
    assert _last_line(capsys) == (
        "reward 'test_always_fails' failed on all 32 responses of a batch (the first: KeyError: 'solution')"
    )
    assert not (tmp_path / "all" / "checkpoints" / "1").exists()


def test_a_full_disk_is_the_last_line_of_a_failed_run(tiny_policy, tmp_path):
    """A file-size limit makes every checkpoint write fail as a full disk would (orbax writes in
    background threads, which print their own errors): the run ends with one line naming the
    checkpoint and the system's reason, and nothing after it."""
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], reward="arithmetic")
    run = tmp_path / "run"
    limit_kib = 64  # above the config, data and metrics files; below the checkpoint's arrays
    command = [
        sys.executable,
        "-m",
        "jaxspec.cli",
        "train",
        "--config",
        config,
        "--run-dir",
        str(run),
        *ONE_STEP,
        "train.steps=2",
        "train.compilation_cache=false",
    ]
    proc = subprocess.run(
        ["bash", "-c", f'ulimit -f {limit_kib} && exec "$@"', "bash", *command],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == EXIT_STORAGE, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"jaxspec train: error: writing the checkpoint of step 1 in {run / 'checkpoints'} failed: File too large"
    )
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()][:1] == [1]
