"""`jaxspec train` refuses bad configs, drafts, run directories and commands with one clear line
and a non-zero exit, before any compute."""

import json
import subprocess
import sys

import pytest

from tests.rl.runs import train_cli, write_config


@pytest.mark.parametrize("sub_batch", [12, 0, 64])
def test_a_sub_batch_that_splits_groups_or_the_step_is_refused(tiny_policy, tmp_path, capsys, sub_batch):
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=1, eval_every=0, checkpoint_every=1)
    assert train_cli("--config", config, "--run-dir", tmp_path / "run", f"rollout.sub_batch={sub_batch}") != 0
    assert "rollout.sub_batch" in capsys.readouterr().err


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("jaxspec train: error: ")
    return err[0]


@pytest.mark.parametrize(
    "override, message",
    [
        ("loss.eps_hi=0.3", "error: command-line override 'loss.eps_hi=0.3': unknown key 'loss.eps_hi'"),
        (
            "train.steps=abc",
            "error: command-line override 'train.steps=abc': key 'train.steps': expected int, got str ('abc')",
        ),
        ("rollout.max_new_tokens=many", "key 'rollout.max_new_tokens': expected int"),
        (
            "rollout.samples_per_prompt=1",
            "error: command-line override 'rollout.samples_per_prompt=1': rollout.samples_per_prompt: must be >= 2",
        ),
        ("loss.minibatches=3", "loss.minibatches: 3 does not divide the 32 rollouts"),
        ("rollout.slots=0", "rollout.slots: must be null, auto (from the devices' free memory) or an integer >= 1"),
        (
            "rollout.slots=many",
            "rollout.slots: must be null, auto (from the devices' free memory) or an integer >= 1 "
            "(decode slots), got 'many'",
        ),
        (
            "loss.aggregation=mean",
            "key 'loss.aggregation': expected one of ['token', 'sequence', 'seq-mean-token-sum-norm']",
        ),
        ("loss.clip_ratio_c=1", "loss.clip_ratio_c: must be > 1 or null, got 1"),
        ("loss.overlong_buffer=9", "loss.overlong_buffer: must be <= rollout.max_new_tokens=8, got 9"),
        ("loss.router_aux_coef=-0.1", "loss.router_aux_coef: must be >= 0 or null, got -0.1"),
        (
            "loss.router_aux_coef=0.01",
            "loss.router_aux_coef: the policy is dense (no mixture-of-experts layers, "
            "no router); set it to null or 0, got 0.01",
        ),
        (
            "loss.routing_replay=true",
            "loss.routing_replay: the policy is dense (no mixture-of-experts layers route "
            "tokens to experts); set it to false",
        ),
        ("policy.path=/nonexistent/policy", "policy.path: policy folder not found: /nonexistent/policy"),
        ("data.train=/nonexistent/train.jsonl", "data.train: file not found: /nonexistent/train.jsonl"),
        ("reward=nope", "unknown reward 'nope'"),
        ("spec.method=none", "draft.online: online draft adaptation trains an EAGLE-3 head; spec.method is 'none'"),
        ("spec.draft=/nonexistent/head", "spec.draft: draft folder not found: /nonexistent/head"),
        ("spec.tree_budget=0", "spec.tree_budget: must be null or >= spec.tree_width=1"),
        (
            "spec.stage_draft_tokens=[2,5]",
            "spec.stage_draft_tokens: must be null or a non-empty list of depths in "
            "1..spec.num_draft_tokens=2, got [2, 5]",
        ),
        ("draft.train_every=0", "draft.train_every: must be > 0"),
        ("mesh.tensor=0", "mesh.tensor: must be > 0"),
        ("mesh.data=16", "mesh: data=16 x fsdp=1 x tensor=1 needs 16 devices, this process sees 8"),
    ],
)
def test_bad_config_fails_before_compute_with_one_line(tiny_policy, tmp_path, capsys, override, message):
    config = write_config(tmp_path / "run.yaml", tiny_policy[0])
    assert train_cli("--config", config, "--run-dir", tmp_path / "run", override) == 2
    assert message in _error_line(capsys)
    assert not (tmp_path / "run").exists()


def test_draft_that_does_not_fit_the_policy(tiny_policy, tmp_path, capsys):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"hidden_size": 64, "vocab_size": 300, "draft_vocab_size": 100}))
    config = write_config(tmp_path / "run.yaml", tiny_policy[0])
    assert (
        train_cli("--config", config, "--run-dir", tmp_path / "run", "spec.method=eagle3", f"spec.draft={draft}") == 2
    )
    assert "spec.draft" in (line := _error_line(capsys)) and "hidden_size is 64 in the draft, 32 in the policy" in line


def test_run_dir_errors(full_run, tmp_path, capsys):
    config, full = full_run
    assert train_cli("--config", config, "--run-dir", full) == 2
    assert "already holds checkpoints; pass --resume" in _error_line(capsys)
    assert train_cli("--config", config, "--run-dir", full, "--resume", "optim.learning_rate=0.1") == 2
    assert "--resume: optim.learning_rate is 0.1 but the run" in _error_line(capsys)
    missing = tmp_path / "missing.yaml"
    assert train_cli("--config", missing, "--run-dir", tmp_path / "run") == 2
    assert f"config file not found: {missing}" in _error_line(capsys)


def test_console_command_exits_nonzero_with_one_line(tmp_path):
    (tmp_path / "bad.yaml").write_text("train: {steps: 2}\nroll_out: {}\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxspec.cli",
            "train",
            "--config",
            str(tmp_path / "bad.yaml"),
            "--run-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        f"jaxspec train: error: {tmp_path / 'bad.yaml'}: unknown key 'roll_out'; valid keys: "
        "['data', 'draft', 'eval', 'loss', 'mesh', 'optim', 'policy', 'reward', 'rollout', 'spec', 'train']"
    ]


@pytest.mark.parametrize("name", ["grpo_tiny.yaml", "grpo_small.yaml"])
def test_shipped_configs_are_valid(name):
    from pathlib import Path

    from jaxspec.config_io import load_config
    from jaxspec.rl.config import GRPOConfig
    from jaxspec.rl.resources import check_inputs
    from jaxspec.rl.validation import validate

    path = Path(__file__).resolve().parents[2] / "configs" / name
    cfg = load_config(GRPOConfig, path)
    validate(cfg, str(path))
    if name == "grpo_tiny.yaml":  # the embedded policy and its tokenizer load (the head is checked separately)
        inputs = check_inputs(load_config(GRPOConfig, path, ["spec.draft=random"]))
        assert inputs.model.vocab_size == inputs.tokenizer.vocab_size == 512
