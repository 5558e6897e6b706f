"""`jaxspec train` end to end on a tiny random policy: learning, exact resume, SIGTERM and Ctrl-C,
config errors."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import load_file

from jaxspec.cli import main as jaxspec_main
from jaxspec.rl.config import GRPOLossConfig
from jaxspec.rl.shaping import trained_rollouts, truncated_rollouts
from jaxspec.rl.metrics import is_timing
from jaxspec.run import EXIT_CHECKPOINTED
from tests.run.damage import truncate_largest_data_file

CONFIG = """
policy: {{path: {policy}}}
data: {{num_train: 40, num_eval: 8, kinds: [arithmetic]}}
reward: {reward}
rollout: {{prompts_per_step: 4, samples_per_prompt: 8, max_new_tokens: 8}}
loss: {{minibatches: 2, ppo_epochs: 2, kl_beta: 0.001, recompute_logprobs: true, filter_groups: true}}
optim: {{learning_rate: 2.0e-2}}
spec: {{method: eagle3, draft: random, num_draft_tokens: 2}}
draft: {{online: true, ttt_steps: 1, learning_rate: 1.0e-2}}
eval: {{every: {eval_every}, batch_size: 8}}
train: {{steps: {steps}, checkpoint_every: {checkpoint_every}, progress: false}}
"""


REPO = str(Path(__file__).resolve().parents[2])
# `jaxspec` in a subprocess, with the test rewards (tests/rl/conftest.py) registered.
RUN_WITH_TEST_REWARDS = "import sys, tests.rl.conftest; from jaxspec.cli import main; sys.exit(main(sys.argv[1:]))"


def _config(path, policy, reward="digit_fraction", steps=12, eval_every=6, checkpoint_every=6):
    path.write_text(CONFIG.format(policy=policy, reward=reward, steps=steps, eval_every=eval_every,
                                  checkpoint_every=checkpoint_every))
    return str(path)


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _without_timings(records):
    return [{k: v for k, v in r.items() if not is_timing(k)} for r in records]


def _train(*args) -> int:
    return jaxspec_main(["train", *map(str, args)])


@pytest.fixture(scope="module")
def full_run(tiny_policy, tmp_path_factory):
    """12 uninterrupted GRPO steps rewarding digits, checkpoints at 6 and 12."""
    root = tmp_path_factory.mktemp("grpo")
    config = _config(root / "run.yaml", tiny_policy[0])
    assert _train("--config", config, "--run-dir", root / "full") == 0
    return config, root / "full"


def test_the_default_compilation_cache_is_in_the_run_dir(full_run):
    _, run_dir = full_run  # no train.compilation_cache in its config
    assert any(path.name.startswith("jit_") for path in (run_dir / "xla_cache").iterdir())


def test_grpo_raises_reward_and_adapts_the_draft(full_run):
    _, run_dir = full_run
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == list(range(13))  # validation before training, then 12 steps
    steps = records[1:]
    first, last = steps[0]["reward_mean"], np.mean([r["reward_mean"] for r in steps[-3:]])
    assert last > max(0.5, 3 * first), [r["reward_mean"] for r in steps]
    # The random head learns online to predict the policy: acceptance and draft loss follow.
    acceptance = [r["acceptance_length"] for r in steps]
    assert acceptance[0] < 1.05 and acceptance[-1] > 1.2, acceptance
    assert steps[-1]["draft_loss"] < 0.7 * steps[0]["draft_loss"]
    for r in steps:
        assert r["updates"] <= 4 * r["step"]
        assert r["data_position"] == 4 * r["step"]
        assert len(r["acceptance_rate_per_position"]) == 2 and len(r["draft_top1_agreement"]) == 1
        assert r["accepted_tokens"] <= r["drafted_tokens"]
        assert 0 <= r["logprob_mismatch_max"] < 1e-4  # trainer and rollout compute the same p
        assert r["response_length_mean"] <= 8 and r["tokens_per_s"] > 0
        assert {"time_generation_s", "time_logprob_s", "time_train_s", "time_sync_s"} <= set(r)
    assert {"eval_accuracy", "eval_reward_mean"} <= set(records[0]) | set(records[6]) | set(records[12])
    assert "eval_accuracy" in records[6] and "eval_accuracy" not in records[5]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == ["12", "6"]
    assert (run_dir / "policy" / "model.safetensors").exists() and (run_dir / "policy" / "tokenizer.json").exists()
    assert (run_dir / "draft" / "model.safetensors").exists()


def test_resume_repeats_the_uninterrupted_run(full_run, tmp_path, capsys):
    config, full = full_run
    # 6 steps, then --resume to 12: identical metrics (timings aside) and identical final weights.
    assert _train("--config", config, "--run-dir", tmp_path / "split", "train.steps=6") == 0
    assert _train("--config", config, "--run-dir", tmp_path / "split", "--resume") == 0
    assert _without_timings(_metrics(tmp_path / "split")) == _without_timings(_metrics(full))
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
    assert _train("--config", config, "--run-dir", crashed, "--resume") == 0
    out = capsys.readouterr().out
    assert f"checkpoint {crashed / 'checkpoints' / '12'} is damaged (ValueError: OUT_OF_RANGE" in out
    assert "resumed from step 6" in out
    assert _without_timings(_metrics(crashed)) == _without_timings(_metrics(full))
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
    assert _train("--config", config, "--run-dir", run, "--resume", "train.steps=8",
                  "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2") == 0
    assert "on the mesh {'data': 2, 'fsdp': 2, 'tensor': 2}" in capsys.readouterr().out
    want, got = _without_timings(_metrics(full))[7:9], _without_timings(_metrics(run))[7:9]
    for w, g in zip(want, got, strict=True):
        assert g["step"] == w["step"] and g["data_position"] == w["data_position"]
        # Sharded reductions change float rounding, not the sampled rollouts of these steps.
        assert g["reward_mean"] == w["reward_mean"] and g["response_length_mean"] == w["response_length_mean"]
        for key in ("loss", "kl", "grad_norm", "draft_loss", "acceptance_length"):
            np.testing.assert_allclose(g[key], w[key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert (run / "policy" / "model.safetensors").is_file()


def run_two_processes(args: list, logs: list, devices: int) -> list[str]:
    """`jaxspec train *args` as a job of two processes of `devices` CPU devices each (as two SLURM
    tasks would run it), each writing its output to its entry of `logs`; returns the outputs once
    both exit 0. A process still running after 8 minutes is stopped with its Python stacks shown."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs = []
    for pid in range(2):
        # PYTHONFAULTHANDLER: a process stopped with SIGABRT prints every thread's Python stack.
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
               "JAX_PLATFORMS": "cpu", "JAX_COORDINATOR_ADDRESS": f"localhost:{port}", "JAX_NUM_PROCESSES": "2",
               "JAX_PROCESS_ID": str(pid), "PYTHONFAULTHANDLER": "1"}
        with open(logs[pid], "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-c", RUN_WITH_TEST_REWARDS, "train", *map(str, args)],
                                          env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.time() + 480
    while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(1)
    hung = [p for p in procs if p.poll() is None]
    for p in hung:  # report where each process waits instead of hanging the suite
        p.send_signal(signal.SIGABRT)
    for p in procs:
        p.wait(timeout=60)
    outputs = [log.read_text() for log in logs]
    assert not hung and [p.returncode for p in procs] == [0, 0], "\n\n".join(outputs)
    return outputs


def test_two_processes_run_one_job_on_a_shared_mesh(full_run, tmp_path):
    """Two processes of 4 CPU devices each form the 2 x 2 x 2 mesh (as two SLURM tasks would):
    the same rollouts and rewards as the single-device run, one metrics file, one exported policy."""
    config, full = full_run
    run = tmp_path / "mp"
    outputs = run_two_processes(["--config", config, "--run-dir", run, "train.steps=2", "mesh.data=2", "mesh.fsdp=2",
                                 "mesh.tensor=2"], [tmp_path / f"process{pid}.log" for pid in range(2)], devices=4)
    assert "trained policy written" in outputs[0] and "trained policy written" not in outputs[1]
    want, got = _without_timings(_metrics(full))[1:3], _without_timings(_metrics(run))[1:3]
    assert [r["step"] for r in _metrics(run)] == [0, 1, 2]
    for w, g in zip(want, got, strict=True):
        assert g["reward_mean"] == w["reward_mean"] and g["response_length_mean"] == w["response_length_mean"]
        for key in ("loss", "kl", "grad_norm", "draft_loss", "acceptance_length"):
            np.testing.assert_allclose(g[key], w[key], rtol=1e-3, atol=1e-6, err_msg=key)
    assert (run / "policy" / "model.safetensors").is_file() and (run / "checkpoints" / "2").is_dir()


def test_rollouts_read_the_policy_and_the_draft_in_the_rollout_dtype(tiny_policy, tmp_path):
    """rollout.dtype bfloat16: "sync" casts the float32 master weights of both the policy and the
    head (a float32 head would draft at float32 speed); the head's vocabulary maps keep their types."""
    import jax.numpy as jnp

    from jaxspec.config_io import load_config
    from jaxspec.rl.config import GRPOConfig
    from jaxspec.rl.loop import GRPORun
    from jaxspec.rl.resources import check_inputs

    config = _config(tmp_path / "run.yaml", tiny_policy[0], steps=1)
    cfg = load_config(GRPOConfig, config, ["rollout.dtype=bfloat16", "draft.online=false"])
    run = GRPORun(cfg, tmp_path / "run", False, check_inputs(cfg))
    policy, spec = run.rollout_view()
    master = run.state["draft_params"]
    assert {x.dtype for x in jax.tree.leaves(policy)} == {jnp.dtype(jnp.bfloat16)}
    assert spec.draft[0] == run.draft[0]
    for (path, got), want in zip(jax.tree.leaves_with_path(spec.draft[1]), jax.tree.leaves(master)):
        expected = jnp.bfloat16 if jnp.issubdtype(want.dtype, jnp.floating) else want.dtype
        assert got.dtype == expected, path
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(expected)))
    assert {x.dtype for x in jax.tree.leaves(master)} >= {jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)}


def test_the_head_trains_on_every_nth_minibatch(tiny_policy, tmp_path, monkeypatch):
    """draft.train_every=2 with 2 minibatches x 2 epochs: the head's update runs on minibatches 0 and 2
    of each step, the policy-only update on the others (unless they hold no loss tokens)."""
    import jaxspec.rl.loop as loop

    calls, update_fn = [], loop.update_fn

    def counting_update_fn(*args):
        fn, with_draft = update_fn(*args), args[6] is not None  # (..., remat, draft, sharding)

        def update(*inputs):
            calls.append((with_draft, inputs[2] is not None))
            return fn(*inputs)
        return update

    monkeypatch.setattr(loop, "update_fn", counting_update_fn)
    config = _config(tmp_path / "run.yaml", tiny_policy[0], steps=2, eval_every=0, checkpoint_every=2)
    assert _train("--config", config, "--run-dir", tmp_path / "run", "draft.train_every=2") == 0
    assert all(with_draft == has_head for with_draft, has_head in calls)
    assert sum(with_draft for with_draft, _ in calls) == 4 and len(calls) <= 8, calls
    records = _metrics(tmp_path / "run")
    assert all(r["draft_loss"] > 0 and len(r["draft_top1_agreement"]) == 1 for r in records)


def test_dapo_dynamic_sampling_refills_the_batch(tiny_policy, tmp_path):
    """filter_groups_max_rounds 4 with a reward most groups score all 0: a step generates further
    batches of prompts until its 4 groups are informative (or 4 rounds ran), the data position
    advances by every prompt generated, and the batch keeps its size. The run also uses top-k
    sampling from bf16 rollouts with recomputed log-probs, TIS, dual-clip and Dr.GRPO's
    normaliser: every loss metric is finite and the dropped-token count is reported."""
    config = _config(tmp_path / "run.yaml", tiny_policy[0], reward="rare_hash", steps=3, eval_every=0,
                     checkpoint_every=3)
    options = ["spec.method=none", "draft.online=false", "loss.filter_groups_max_rounds=4", "rollout.top_k=8",
               "rollout.dtype=bfloat16", "loss.tis_cap=2.0", "loss.aggregation=seq-mean-token-sum-norm"]
    assert _train("--config", config, "--run-dir", tmp_path / "run", *options) == 0
    records = _metrics(tmp_path / "run")
    position = 0
    for r in records:
        position += 4 * r["generation_rounds"]
        assert r["data_position"] == position
        if r["generation_rounds"] < 4:
            assert r["groups_zero_variance"] == 0
        for key in ("loss", "pg_loss", "kl", "grad_norm", "tis_weight_mean", "dual_clip_frac", "nonfinite_tokens"):
            assert np.isfinite(r[key]), (key, r)
    assert any(r["generation_rounds"] > 1 for r in records), records


def test_rollout_sub_batches_bound_each_generate_call(tiny_policy, tmp_path, monkeypatch):
    """rollout.sub_batch 16 of a step's 32 rollouts: two generate calls of 16 prompts each (whole
    groups, keys folded per call), and the record's acceptance statistics are the two calls'
    counts combined."""
    import jaxspec.rl.loop as loop

    calls, generate = [], loop.generate

    def recording_generate(cfg, params, prompts, key, **kwargs):
        out = generate(cfg, params, prompts, key, **kwargs)
        calls.append((len(prompts), prompts, out.stats))
        return out

    monkeypatch.setattr(loop, "generate", recording_generate)
    config = _config(tmp_path / "run.yaml", tiny_policy[0], steps=1, eval_every=0, checkpoint_every=1)
    assert _train("--config", config, "--run-dir", tmp_path / "run", "rollout.sub_batch=16") == 0
    assert [n for n, _, _ in calls] == [16, 16]
    for _, prompts, _ in calls:  # 2 groups of 8 equal prompts per call
        assert all(prompts[i] == prompts[i - i % 8] for i in range(16))
    (record,) = _metrics(tmp_path / "run")
    parts = [stats for _, _, stats in calls]
    rows = sum(p["verified_row_steps"] for p in parts)
    accepted = sum(p["accepted_tokens"] for p in parts)
    assert record["accepted_tokens"] == accepted
    assert record["acceptance_length"] == pytest.approx((accepted + rows) / rows)
    assert record["decode_steps"] == sum(p["steps"] for p in parts)


@pytest.mark.parametrize("sub_batch", [12, 0, 64])
def test_a_sub_batch_that_splits_groups_or_the_step_is_refused(tiny_policy, tmp_path, capsys, sub_batch):
    config = _config(tmp_path / "run.yaml", tiny_policy[0], steps=1, eval_every=0, checkpoint_every=1)
    assert _train("--config", config, "--run-dir", tmp_path / "run", f"rollout.sub_batch={sub_batch}") != 0
    assert "rollout.sub_batch" in capsys.readouterr().err


def test_soft_overlong_penalty_shapes_the_rewards(tiny_policy, tmp_path):
    """overlong_buffer = max_new_tokens: every response of L tokens loses L / 8 before the
    advantages; reward_mean stays the reward function's."""
    config = _config(tmp_path / "run.yaml", tiny_policy[0], steps=1, eval_every=0, checkpoint_every=1)
    options = ["spec.method=none", "draft.online=false", "loss.overlong_buffer=8", "loss.overlong_penalty=1.0"]
    assert _train("--config", config, "--run-dir", tmp_path / "run", *options) == 0
    (record,) = _metrics(tmp_path / "run")
    assert record["shaped_reward_mean"] == pytest.approx(record["reward_mean"] - record["response_length_mean"] / 8)


# Autoregressive rollouts and a plain loss keep a subprocess's compilations short.
LIGHT = ["spec.method=none", "draft.online=false", "loss.recompute_logprobs=false"]


def _signal_mid_run(config, run_dir, signum):
    """Starts `jaxspec train` in a subprocess (stdout not a terminal), sends `signum` once two steps
    are logged; returns (exit status, stdout, stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "jaxspec.cli", "train", "--config", config, "--run-dir",
                             str(run_dir), *LIGHT, "train.progress=true"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu", "JAXSPEC_PROGRESS_INTERVAL_S": "0"})
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
    config = _config(tmp_path / "long.yaml", tiny_policy[0], reward="math", steps=100000, eval_every=0,
                     checkpoint_every=1000)
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
    config = _config(tmp_path / "long.yaml", tiny_policy[0], reward="math", steps=1000, eval_every=0,
                     checkpoint_every=1000)
    run_dir = tmp_path / "run"
    returncode, stdout, stderr = _signal_mid_run(config, run_dir, signal.SIGINT)
    assert returncode == EXIT_CHECKPOINTED, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert "Ctrl-C: checkpointing at the end of this step" in stderr
    assert "SIGINT: checkpointed step" in stdout
    done = len(_metrics(run_dir))
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [done] and done >= 2
    # stdout is a pipe: progress comes as plain lines, one per step with a 0 s interval
    assert [line.split("/")[0] for line in stdout.splitlines() if line.startswith("grpo: step ")] == \
        [f"grpo: step {s}" for s in range(1, done + 1)]
    assert _train("--config", config, "--run-dir", run_dir, "--resume", f"train.steps={done + 2}", *LIGHT) == 0
    out = capsys.readouterr().out
    assert f"resumed from step {done}" in out
    assert [r["step"] for r in _metrics(run_dir)] == list(range(1, done + 3))
    summary = [line for line in out.splitlines() if line.startswith("grpo done: ")]
    assert len(summary) == 1 and f"grpo done: {done + 2} steps (2 in this process)" in summary[0]
    assert f"final reward {_metrics(run_dir)[-1]['reward_mean']:.3f}" in summary[0]
    assert f"policy in {run_dir / 'policy'}" in summary[0] and (run_dir / "policy" / "model.safetensors").is_file()


def test_resume_on_a_new_run_dir_says_so_and_starts_fresh(tiny_policy, tmp_path, capsys):
    config = _config(tmp_path / "run.yaml", tiny_policy[0], steps=1, eval_every=0, checkpoint_every=1)
    run_dir = tmp_path / "new"
    assert _train("--config", config, "--run-dir", run_dir, "--resume", *LIGHT) == 0
    out = capsys.readouterr().out
    assert f"--resume: no checkpoint in {run_dir / 'checkpoints'}; starting a new run" in out
    assert [r["step"] for r in _metrics(run_dir)] == [1]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("jaxspec train: error: ")
    return err[0]


@pytest.mark.parametrize("override, message", [
    ("loss.eps_hi=0.3", "error: command-line override 'loss.eps_hi=0.3': unknown key 'loss.eps_hi'"),
    ("train.steps=abc", "error: command-line override 'train.steps=abc': key 'train.steps': expected int, "
                        "got str ('abc')"),
    ("rollout.max_new_tokens=many", "key 'rollout.max_new_tokens': expected int"),
    ("rollout.samples_per_prompt=1", "error: command-line override 'rollout.samples_per_prompt=1': "
                                     "rollout.samples_per_prompt: must be >= 2"),
    ("loss.minibatches=3", "loss.minibatches: 3 does not divide the 32 rollouts"),
    ("loss.aggregation=mean", "key 'loss.aggregation': expected one of ['token', 'sequence', "
                              "'seq-mean-token-sum-norm']"),
    ("loss.clip_ratio_c=1", "loss.clip_ratio_c: must be > 1 or null, got 1"),
    ("loss.overlong_buffer=9", "loss.overlong_buffer: must be <= rollout.max_new_tokens=8, got 9"),
    ("policy.path=/nonexistent/policy", "policy.path: policy folder not found: /nonexistent/policy"),
    ("data.train=/nonexistent/train.jsonl", "data.train: file not found: /nonexistent/train.jsonl"),
    ("reward=nope", "unknown reward 'nope'"),
    ("spec.method=none", "draft.online: online draft adaptation trains an EAGLE-3 head; spec.method is 'none'"),
    ("spec.draft=/nonexistent/head", "spec.draft: draft folder not found: /nonexistent/head"),
    ("spec.tree_budget=0", "spec.tree_budget: must be null or >= spec.tree_width=1"),
    ("spec.stage_draft_tokens=[2,5]", "spec.stage_draft_tokens: must be null or a non-empty list of depths in "
                                      "1..spec.num_draft_tokens=2, got [2, 5]"),
    ("draft.train_every=0", "draft.train_every: must be > 0"),
    ("mesh.tensor=0", "mesh.tensor: must be > 0"),
    ("mesh.data=16", "mesh: data=16 x fsdp=1 x tensor=1 needs 16 devices, this process sees 8"),
])
def test_bad_config_fails_before_compute_with_one_line(tiny_policy, tmp_path, capsys, override, message):
    config = _config(tmp_path / "run.yaml", tiny_policy[0])
    assert _train("--config", config, "--run-dir", tmp_path / "run", override) == 2
    assert message in _error_line(capsys)
    assert not (tmp_path / "run").exists()


def test_draft_that_does_not_fit_the_policy(tiny_policy, tmp_path, capsys):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"hidden_size": 64, "vocab_size": 300, "draft_vocab_size": 100}))
    config = _config(tmp_path / "run.yaml", tiny_policy[0])
    assert _train("--config", config, "--run-dir", tmp_path / "run", "spec.method=eagle3", f"spec.draft={draft}") == 2
    assert "spec.draft" in (line := _error_line(capsys)) and "hidden_size is 64 in the draft, 32 in the policy" in line


def test_run_dir_errors(full_run, tmp_path, capsys):
    config, full = full_run
    assert _train("--config", config, "--run-dir", full) == 2
    assert "already holds checkpoints; pass --resume" in _error_line(capsys)
    assert _train("--config", config, "--run-dir", full, "--resume", "optim.learning_rate=0.1") == 2
    assert "--resume: optim.learning_rate is 0.1 but the run" in _error_line(capsys)
    missing = tmp_path / "missing.yaml"
    assert _train("--config", missing, "--run-dir", tmp_path / "run") == 2
    assert f"config file not found: {missing}" in _error_line(capsys)


def test_console_command_exits_nonzero_with_one_line(tmp_path):
    (tmp_path / "bad.yaml").write_text("train: {steps: 2}\nroll_out: {}\n")
    proc = subprocess.run([sys.executable, "-m", "jaxspec.cli", "train", "--config", str(tmp_path / "bad.yaml"),
                           "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        f"jaxspec train: error: {tmp_path / 'bad.yaml'}: unknown key 'roll_out'; valid keys: "
        "['data', 'draft', 'eval', 'loss', 'mesh', 'optim', 'policy', 'reward', 'rollout', 'spec', 'train']"]


@pytest.mark.parametrize("name", ["grpo_tiny.yaml", "grpo_small.yaml"])
def test_shipped_configs_are_valid(name):
    from pathlib import Path

    from jaxspec.config_io import load_config
    from jaxspec.rl.config import GRPOConfig
    from jaxspec.rl.validation import validate
    from jaxspec.rl.resources import check_inputs

    path = Path(__file__).resolve().parents[2] / "configs" / name
    cfg = load_config(GRPOConfig, path)
    validate(cfg, str(path))
    if name == "grpo_tiny.yaml":  # the embedded policy and its tokenizer load (the head is checked separately)
        inputs = check_inputs(load_config(GRPOConfig, path, ["spec.draft=random"]))
        assert inputs.model.vocab_size == inputs.tokenizer.vocab_size == 512


def test_truncated_rollouts_are_masked_on_request():
    """Rollouts cut at max_new_tokens without an eos (not those whose last token is the eos)
    leave the loss with loss.mask_truncated; filter_groups drops whole uninformative groups."""
    eos, max_new = 2, 4
    tokens = np.array([[5, 6, 7, 8], [5, 6, 7, eos], [5, eos, 0, 0], [5, 6, 7, 9]])
    lengths = np.array([4, 4, 2, 4])
    truncated = truncated_rollouts(tokens, lengths, max_new, eos)
    assert truncated.tolist() == [True, False, False, True]
    informative = np.array([True, False])  # groups of 2: rows 0-1 and rows 2-3

    def kept(**loss):
        return trained_rollouts(informative, truncated, 2, GRPOLossConfig(**loss)).tolist()

    assert kept() == [True, True, True, True]
    assert kept(filter_groups=True) == [True, True, False, False]
    assert kept(mask_truncated=True) == [False, True, True, False]
    assert kept(filter_groups=True, mask_truncated=True) == [False, True, False, False]
