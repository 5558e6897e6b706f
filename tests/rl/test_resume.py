"""`jaxspec train --resume`: exact resume, onto a mesh and over two processes, damaged checkpoints,
SIGTERM and Ctrl-C, a torn metrics file, changed step counts, the job's time limit."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml
from safetensors.numpy import load_file

from jaxspec.exits import EXIT_INPUT
from jaxspec.run import EXIT_CHECKPOINTED
from tests.rl.runs import LIGHT, read_metrics, run_two_processes, train_cli, without_machine_keys, write_config
from tests.run.damage import truncate_largest_data_file

pytestmark = pytest.mark.slow


def test_resume_repeats_the_uninterrupted_run(full_run, tmp_path, capsys):
    config, full = full_run
    # 6 steps, then --resume to 12: identical metrics (timings aside) and identical final weights.
    assert train_cli("--config", config, "--run-dir", tmp_path / "split", "train.steps=6") == 0
    assert train_cli("--config", config, "--run-dir", tmp_path / "split", "--resume") == 0
    assert without_machine_keys(read_metrics(tmp_path / "split")) == without_machine_keys(read_metrics(full))
    for folder in ("policy", "draft"):
        expected = load_file(full / folder / "model.safetensors")
        got = load_file(tmp_path / "split" / folder / "model.safetensors")
        assert all(np.array_equal(expected[k], got[k]) for k in expected)

    # A run killed after step 9 whose step-12 checkpoint is damaged (a truncated data file): resume
    # reports it and moves it aside, and steps 7-9 are redone from checkpoint 6, identically.
    crashed = tmp_path / "crashed"
    shutil.copytree(full, crashed)
    truncate_largest_data_file(crashed / "checkpoints" / "12")
    shutil.rmtree(crashed / "policy")
    shutil.rmtree(crashed / "draft")
    lines = (crashed / "metrics.jsonl").read_text().splitlines()
    (crashed / "metrics.jsonl").write_text("\n".join(lines[:10]) + "\n")
    capsys.readouterr()
    assert train_cli("--config", config, "--run-dir", crashed, "--resume") == 0
    out = capsys.readouterr().out
    assert f"checkpoint {crashed / 'checkpoints' / '12'} is damaged (ValueError: OUT_OF_RANGE" in out
    assert "resumed from step 6" in out
    assert without_machine_keys(read_metrics(crashed)) == without_machine_keys(read_metrics(full))
    assert len(list((crashed / "checkpoints").glob("12.damaged-*"))) == 1


def test_resume_onto_a_mesh_continues_the_run(full_run, tmp_path, capsys):
    """The step-6 checkpoint restored onto a data x fsdp x tensor = 2 x 2 x 2 mesh: steps 7-8 (the
    policy, its optimizer state and the rollouts sharded) follow the single-device run. Sharded
    reductions round differently, and at this test's learning rate (2e-2) Adam turns rounding in
    near-zero gradient entries into whole steps, so the runs drift apart after a few updates (the
    loss of step 9 differs by ~1e-2 relative); two steps stay within 1e-5 here."""
    config, full = full_run
    run = tmp_path / "mesh"
    shutil.copytree(full, run)
    for folder in ("checkpoints/12", "policy", "draft"):
        shutil.rmtree(run / folder)
    (run / "metrics.jsonl").write_text("\n".join((full / "metrics.jsonl").read_text().splitlines()[:7]) + "\n")
    assert (
        train_cli(
            "--config",
            config,
            "--run-dir",
            run,
            "--resume",
            "train.steps=8",
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.tensor=2",
        )
        == 0
    )
    assert "on the mesh {'data': 2, 'fsdp': 2, 'tensor': 2}" in capsys.readouterr().out
    want, got = without_machine_keys(read_metrics(full))[7:9], without_machine_keys(read_metrics(run))[7:9]
    for w, g in zip(want, got, strict=True):
        assert g["step"] == w["step"] and g["data_position"] == w["data_position"]
        # Sharded reductions change float rounding, not the sampled rollouts of these steps.
        assert g["reward_mean"] == w["reward_mean"] and g["response_length_mean"] == w["response_length_mean"]
        for key in ("loss", "kl", "grad_norm", "draft_loss", "acceptance_length"):
            np.testing.assert_allclose(g[key], w[key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert (run / "policy" / "model.safetensors").is_file()


def test_two_processes_run_one_job_on_a_shared_mesh(full_run, tmp_path):
    """Two processes of 4 CPU devices each form the 2 x 2 x 2 mesh (as two SLURM tasks would):
    the same rollouts and rewards as the single-device run, one metrics file, one exported policy."""
    config, full = full_run
    run = tmp_path / "mp"
    outputs = run_two_processes(
        ["--config", config, "--run-dir", run, "train.steps=2", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
        [tmp_path / f"process{pid}.log" for pid in range(2)],
        devices=4,
    )
    assert "trained policy written" in outputs[0] and "trained policy written" not in outputs[1]
    want, got = without_machine_keys(read_metrics(full))[1:3], without_machine_keys(read_metrics(run))[1:3]
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2]
    for w, g in zip(want, got, strict=True):
        assert g["reward_mean"] == w["reward_mean"] and g["response_length_mean"] == w["response_length_mean"]
        for key in ("loss", "kl", "grad_norm", "draft_loss", "acceptance_length"):
            np.testing.assert_allclose(g[key], w[key], rtol=1e-3, atol=1e-6, err_msg=key)
    assert (run / "policy" / "model.safetensors").is_file() and (run / "checkpoints" / "2").is_dir()


def _signal_mid_run(config, run_dir, signum):
    """Starts `jaxspec train` in a subprocess (stdout not a terminal), sends `signum` once two steps
    are logged; returns (exit status, stdout, stderr)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxspec.cli",
            "train",
            "--config",
            config,
            "--run-dir",
            str(run_dir),
            *LIGHT,
            "train.progress=true",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "JAXSPEC_PROGRESS_INTERVAL_S": "0"},
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    return proc.returncode, stdout, stderr


def test_sigterm_checkpoints_at_the_next_step_and_exits_75(tiny_policy, tmp_path):
    config = write_config(
        tmp_path / "long.yaml", tiny_policy[0], reward="math", steps=100000, eval_every=0, checkpoint_every=1000
    )
    run_dir = tmp_path / "run"
    returncode, stdout, stderr = _signal_mid_run(config, run_dir, signal.SIGTERM)
    assert returncode == EXIT_CHECKPOINTED == 75, stderr
    assert "SIGTERM: checkpointed step" in stdout
    metrics = run_dir / "metrics.jsonl"
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2
    manager = ocp.CheckpointManager(run_dir / "checkpoints")
    assert manager.latest_step() == len(steps)
    state = manager.restore(manager.latest_step())
    assert int(state["step"]) == len(steps) and int(state["position"]) == 4 * len(steps)
    assert state["params"]["embed"].shape == (300, 32)
    assert {"ref_params", "opt_state", "key", "updates"} <= set(state) and "draft_params" not in state
    assert not (run_dir / "policy").exists()  # a preempted run is not finished


def test_ctrl_c_checkpoints_and_resume_continues_the_metrics(tiny_policy, tmp_path, capsys):
    config = write_config(
        tmp_path / "long.yaml", tiny_policy[0], reward="math", steps=1000, eval_every=0, checkpoint_every=1000
    )
    run_dir = tmp_path / "run"
    returncode, stdout, stderr = _signal_mid_run(config, run_dir, signal.SIGINT)
    assert returncode == EXIT_CHECKPOINTED, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert "Ctrl-C: checkpointing at the end of this step" in stderr
    assert "SIGINT: checkpointed step" in stdout
    done = len(read_metrics(run_dir))
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [done] and done >= 2
    # stdout is a pipe: progress comes as plain lines, one per step with a 0 s interval
    assert [line.split("/")[0] for line in stdout.splitlines() if line.startswith("grpo: step ")] == [
        f"grpo: step {s}" for s in range(1, done + 1)
    ]
    assert train_cli("--config", config, "--run-dir", run_dir, "--resume", f"train.steps={done + 2}", *LIGHT) == 0
    out = capsys.readouterr().out
    assert f"resumed from step {done}" in out
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, done + 3))
    summary = [line for line in out.splitlines() if line.startswith("grpo done: ")]
    assert len(summary) == 1 and f"grpo done: {done + 2} steps (2 in this process)" in summary[0]
    assert f"final reward {read_metrics(run_dir)[-1]['reward_mean']:.3f}" in summary[0]
    assert f"policy in {run_dir / 'policy'}" in summary[0] and (run_dir / "policy" / "model.safetensors").is_file()


def test_resume_on_a_new_run_dir_says_so_and_starts_fresh(tiny_policy, tmp_path, capsys):
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=1, eval_every=0, checkpoint_every=1)
    run_dir = tmp_path / "new"
    assert train_cli("--config", config, "--run-dir", run_dir, "--resume", *LIGHT) == 0
    out = capsys.readouterr().out
    assert f"--resume: no checkpoint in {run_dir / 'checkpoints'}; starting a new run" in out
    assert [r["step"] for r in read_metrics(run_dir)] == [1]


@pytest.fixture(scope="module")
def two_steps(tiny_policy, tmp_path_factory):
    """A finished 2-step run (checkpoints 1 and 2) of the light config."""
    root = tmp_path_factory.mktemp("two_steps")
    config = write_config(root / "run.yaml", tiny_policy[0], steps=2, eval_every=0, checkpoint_every=1)
    assert train_cli("--config", config, "--run-dir", root / "run", *LIGHT) == 0
    return config, root / "run"


def _copy(two_steps, tmp_path):
    config, run = two_steps
    shutil.copytree(run, tmp_path / "run")
    return config, tmp_path / "run"


def _saved_steps(run) -> int:
    return yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"]


def test_a_torn_last_metrics_line_is_dropped_and_a_changed_train_steps_is_stated(two_steps, tmp_path, capsys):
    config, run = _copy(two_steps, tmp_path)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward_mean": 0.1, "tim')  # the process died while writing the line
    assert train_cli("--config", config, "--run-dir", run, "--resume", "train.steps=3", *LIGHT) == 0
    out = capsys.readouterr().out
    assert (
        f"{run / 'metrics.jsonl'}: dropped its last line, cut short while it was written (Unterminated string "
        f"starting at: line 1 column 33 (char 32))"
    ) in out
    assert "--resume: train.steps 2 -> 3 (the run has done 2 steps; config.yaml updated)" in out
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3] and _saved_steps(run) == 3


def test_resuming_with_fewer_steps_than_done_is_refused(two_steps, tmp_path, capsys):
    config, run = _copy(two_steps, tmp_path)
    assert train_cli("--config", config, "--run-dir", run, "--resume", "train.steps=1", *LIGHT) == EXIT_INPUT
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"jaxspec train: error: --resume: train.steps=1 but the run in {run} has done 2 steps; give train.steps >= 2 "
        f"(config.yaml is unchanged)"
    )
    assert _saved_steps(run) == 2


def test_a_run_stops_before_its_time_limit_when_a_step_and_a_checkpoint_would_not_fit(
    two_steps, tmp_path, capsys, monkeypatch
):
    """JAXSPEC_STOP_BY an hour away, steps measured at 5000 s each (the earlier start's metrics): the
    run checkpoints and stops with EXIT_CHECKPOINTED before step 3; with a day left it trains it."""
    config, run = _copy(two_steps, tmp_path)
    records = [{**r, "time_step_s": 5000.0} for r in read_metrics(run)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    monkeypatch.setenv("JAXSPEC_STOP_BY", str(time.time() + 3600))
    assert train_cli("--config", config, "--run-dir", run, "--resume", "train.steps=3", *LIGHT) == EXIT_CHECKPOINTED
    out = capsys.readouterr().out
    assert re.search(
        r"time limit \(the job must stop by [-0-9: ]+ UTC \(JAXSPEC_STOP_BY\): one more step \(~5000 s\) "
        r"and a checkpoint \(~5000 s\) would end after it\): checkpointed step 2 in ",
        out,
    ), out
    assert [r["step"] for r in read_metrics(run)] == [1, 2] and "grpo done" not in out
    monkeypatch.setenv("JAXSPEC_STOP_BY", str(time.time() + 86400))
    assert train_cli("--config", config, "--run-dir", run, "--resume", "train.steps=3", *LIGHT) == 0
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
