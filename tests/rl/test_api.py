"""`jaxspec.rl.train` from Python: the CLI's run, metrics returned and streamed, resume, config errors."""

import json
import os
import subprocess
import sys

import pytest

import jaxspec.rl
from jaxspec.cli import main as jaxspec_main
from jaxspec.config_io import load_config
from jaxspec.rl.config import GRPOConfig
from tests.rl.runs import REPO, without_machine_keys

CONFIG = """
policy: {{path: {policy}}}
data: {{num_train: 16, num_eval: 4, kinds: [arithmetic]}}
reward: digit_fraction
rollout: {{prompts_per_step: 2, samples_per_prompt: 4, max_new_tokens: 6}}
optim: {{learning_rate: 1.0e-2}}
spec: {{method: eagle3, draft: random, num_draft_tokens: 2}}
draft: {{online: true, ttt_steps: 1}}
eval: {{every: 2, batch_size: 4}}
train: {{steps: 5, checkpoint_every: 2, progress: false}}
"""


def _file_records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture()
def config(tiny_policy, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG.format(policy=tiny_policy[0]))
    return path


def test_train_returns_and_streams_the_cli_metrics_and_resumes(config, tmp_path):
    seen = []
    metrics = jaxspec.rl.train(config, tmp_path / "api", overrides={"train.steps": 2}, on_step=seen.append)
    assert [r["step"] for r in metrics] == [0, 1, 2]  # validation before training, then 2 steps
    assert seen == [{k: v for k, v in r.items() if k != "time_unix_s"} for r in metrics]  # the log adds the clock
    assert {"reward_mean", "acceptance_length", "time_step_s", "eval_accuracy"} <= set(metrics[-1])
    assert jaxspec_main(["train", "--config", str(config), "--run-dir", str(tmp_path / "cli"), "train.steps=2"]) == 0
    assert without_machine_keys(metrics) == without_machine_keys(_file_records(tmp_path / "cli"))

    # A loaded config works as well as a path; the resumed run returns the whole history.
    cfg = load_config(GRPOConfig, config)
    seen.clear()
    resumed = jaxspec.rl.train(cfg, tmp_path / "api", overrides={"train.steps": 3}, resume=True, on_step=seen.append)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3] and resumed[:3] == metrics
    assert [r["step"] for r in seen] == [3]


def test_bad_overrides_and_run_dirs_raise_before_any_compute(config, tmp_path):
    with pytest.raises(ValueError, match="unknown key 'train.stepz'"):
        jaxspec.rl.train(config, tmp_path / "run", overrides={"train.stepz": 2})
    with pytest.raises(ValueError, match="'rollout.max_new_tokens': expected int"):
        jaxspec.rl.train(config, tmp_path / "run", overrides={"rollout.max_new_tokens": "many"})
    with pytest.raises(ValueError, match="rollout.samples_per_prompt"):
        jaxspec.rl.train(config, tmp_path / "run", overrides={"rollout.samples_per_prompt": 0})
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        jaxspec.rl.train(tmp_path / "missing.yaml", tmp_path / "run")
    assert not (tmp_path / "run").exists()


# A user's training script as people write them: no `if __name__ == "__main__":` guard.
UNGUARDED_SCRIPT = """
import jaxspec.rl
with open({marker!r}, "a") as f:
    f.write("script body ran\\n")
jaxspec.rl.train({config!r}, {run_dir!r})
"""
MATH_CONFIG = """
data: {num_train: 8, num_eval: 0, levels: [1], kinds: [arithmetic]}
reward: math
rollout: {prompts_per_step: 2, samples_per_prompt: 2, max_new_tokens: 8}
spec: {method: none}
draft: {online: false}
eval: {every: 0}
train: {steps: 1, progress: false, compilation_cache: false}
"""


def test_a_script_without_a_main_guard_trains_once_with_the_math_reward(tmp_path):
    """The math reward's worker never imports the user's script: the script body runs once, the run
    has one step and no reward failed."""
    (tmp_path / "math.yaml").write_text(MATH_CONFIG)
    script = tmp_path / "train_math.py"
    script.write_text(
        UNGUARDED_SCRIPT.format(
            marker=str(tmp_path / "marker"), config=str(tmp_path / "math.yaml"), run_dir=str(tmp_path / "run")
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "marker").read_text() == "script body ran\n"
    records = _file_records(tmp_path / "run")
    assert [r["step"] for r in records] == [1] and records[0]["reward_failures"] == 0
    assert "Traceback" not in proc.stderr
