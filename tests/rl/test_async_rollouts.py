"""rollout.mode async: rollouts on the last mesh.rollout_devices devices, one step off-policy, with
a device-to-device weight sync after each update (`jaxspec.rl.async_rollouts`)."""

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config_io import load_config
from jaxspec.rl.api import train
from jaxspec.rl.batch import Rollouts, pack_rows, training_rows
from jaxspec.rl.config import GRPOConfig
from jaxspec.rl.loop import GRPORun
from jaxspec.rl.resources import check_inputs
from tests.rl.runs import read_metrics, train_cli, without_timings, write_config

ASYNC = ["rollout.mode=async", "mesh.rollout_devices=1"]
# The keys only async runs write.
ASYNC_KEYS = {"staleness", "rollout_version", "sync_bytes"}


def _run(tiny_policy, tmp_path, *overrides, steps=3):
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=steps, eval_every=0, checkpoint_every=steps)
    cfg = load_config(GRPOConfig, config, list(overrides))
    return GRPORun(cfg, tmp_path / "run", False, check_inputs(cfg))


def _rollout_logprob_error(run: GRPORun, out: Rollouts, params) -> float:
    """Largest difference between the rollout's log-probs of its tokens and those of `params`."""
    batch = training_rows(out.prompts, out.tokens, out.lengths, run.tok.pad_id, run.width)
    rows = run.placement.rows(pack_rows(batch.response_rows(), run.placement.row_shards))
    got = np.asarray(run.score(params, rows.tokens, rows.segment_ids, rows.resp_index, rows.resp_tokens))
    compared = batch.resp_mask & np.isfinite(got) & np.isfinite(out.logprobs)
    return float(np.abs(got - out.logprobs)[compared].max())


def test_one_step_off_policy_rollouts_use_the_previous_weights(tiny_policy, tmp_path):
    """max_staleness 1 on a 2-device rollout mesh: step t trains on rollouts of the weights before
    step t-1's update (the initial weights for steps 1 and 2), as the recomputed log-probs show;
    the importance ratio is 1 where the batch's weights are the trained ones (step 1) and not where
    an update came between; after each sync the rollout copy equals the trainer's weights bit for
    bit, on devices the trainer does not use."""
    run = _run(tiny_policy, tmp_path, "rollout.mode=async", "mesh.rollout_devices=2", "loss.minibatches=1",
               "loss.ppo_epochs=1", "loss.recompute_logprobs=false", "loss.kl_beta=0.0", "loss.filter_groups=false")
    consumed, versions = [], [jax.tree.map(np.asarray, run.state["params"])]
    next_batch = run.async_rollouts.next_batch

    def recording_next_batch(timer):
        out = next_batch(timer)
        consumed.append(out[0])
        return out

    run.async_rollouts.next_batch = recording_next_batch
    trainer_devices = {d for x in jax.tree.leaves(run.state["params"]) for d in x.devices()}
    records = []
    for _ in range(3):
        records.append(run.run_step())
        versions.append(jax.tree.map(np.asarray, run.state["params"]))
        copy = run.async_rollouts.weights
        assert copy.version == run.step
        # the next step's batch was queued before this step's update, with the weights before it
        # (none past train.steps)
        queued = [(b.step, b.weights.version) for b in run.async_rollouts.in_flight]
        assert queued == ([(run.step + 1, run.step - 1)] if run.step < 3 else []), queued
        for got, want in zip(jax.tree.leaves((copy.policy, copy.draft)),
                             jax.tree.leaves((run.state["params"], run.state["draft_params"]))):
            assert got.devices() == set(jax.devices()[-2:]) and not got.devices() & trainer_devices
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    run.async_rollouts.close()

    assert [r["staleness"] for r in records] == [0, 1, 1]
    assert [r["rollout_version"] for r in records] == [0, 0, 1]
    assert all(r["sync_bytes"] > 0 and r["time_sync_s"] > 0 for r in records)
    for out, version in zip(consumed, [0, 0, 1]):
        assert _rollout_logprob_error(run, out, versions[version]) < 1e-4
        assert _rollout_logprob_error(run, out, versions[version + 1]) > 1e-3  # the test can tell versions apart
    assert abs(records[0]["ratio_mean"] - 1) < 1e-5
    assert all(abs(r["ratio_mean"] - 1) > 1e-4 for r in records[1:]), [r["ratio_mean"] for r in records]


@pytest.mark.parametrize("mesh", [["mesh.rollout_devices=1"],
                                  ["mesh.fsdp=2", "mesh.tensor=2", "mesh.rollout_devices=2"]])
def test_the_sync_casts_to_the_rollout_dtype_bit_for_bit(tiny_policy, tmp_path, mesh):
    """From one trainer device or a sharded trainer mesh to the replicated rollout copy."""
    run = _run(tiny_policy, tmp_path, "rollout.mode=async", *mesh, "rollout.dtype=bfloat16")
    rollout_devices = set(jax.devices()[-run.cfg.mesh.rollout_devices:])
    run.state["params"] = jax.tree.map(lambda x: x * 1.5, run.state["params"])  # an "update"
    run.step += 1
    assert run.async_rollouts.sync() == sum(x.size * 2 for x in jax.tree.leaves(run.state["params"])) + sum(
        x.nbytes if not jnp.issubdtype(x.dtype, jnp.floating) else x.size * 2
        for x in jax.tree.leaves(run.state["draft_params"]))
    copy = run.async_rollouts.weights
    for got, want in zip(jax.tree.leaves((copy.policy, copy.draft)),
                         jax.tree.leaves((run.state["params"], run.state["draft_params"]))):
        expected = jnp.bfloat16 if jnp.issubdtype(want.dtype, jnp.floating) else want.dtype
        assert got.dtype == expected and got.devices() == rollout_devices and got.sharding.is_fully_replicated
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(expected)))
    run.async_rollouts.close()


def test_a_frozen_draft_is_copied_once(tiny_policy, tmp_path):
    run = _run(tiny_policy, tmp_path, *ASYNC, "draft.online=false")
    draft = run.async_rollouts.weights.draft
    run.step += 1
    assert run.async_rollouts.sync() == sum(x.nbytes for x in jax.tree.leaves(run.state["params"]))
    assert run.async_rollouts.weights.draft is draft and run.async_rollouts.weights.version == 1
    run.async_rollouts.close()


def test_staleness_0_repeats_the_colocated_run(tiny_policy, tmp_path):
    """max_staleness 0 on the last device: the rewards, losses, draft and log-prob metrics of the
    colocated run on the first device, exactly."""
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=2, eval_every=0, checkpoint_every=2)
    assert train_cli("--config", config, "--run-dir", tmp_path / "colocated") == 0
    assert train_cli("--config", config, "--run-dir", tmp_path / "async", *ASYNC, "rollout.max_staleness=0") == 0
    colocated = without_timings(read_metrics(tmp_path / "colocated"))
    stale0 = without_timings(read_metrics(tmp_path / "async"))
    assert [r["staleness"] for r in stale0] == [0, 0]
    assert [{k: v for k, v in r.items() if k not in ASYNC_KEYS} for r in stale0] == colocated


def test_resume_and_sigterm_continue_the_async_run(tiny_policy, tmp_path):
    """A run of 2 steps extended to 4 by --resume, then a SIGTERM during step 3 that checkpoints at
    its end with step 4's batch in flight (generated with the weights after step 2, not the
    checkpointed ones): each resumed run regenerates the batch from the checkpointed rollout copy,
    and the records are those of the uninterrupted run."""
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=4, eval_every=0, checkpoint_every=4)
    overrides = {"rollout.mode": "async", "mesh.rollout_devices": 1}
    train(config, tmp_path / "full", overrides=overrides)
    full = without_timings(read_metrics(tmp_path / "full"))
    assert [(r["staleness"], r["rollout_version"]) for r in full] == [(0, 0), (1, 0), (1, 1), (1, 2)]

    def terminate_after_step_3(record):
        if record["step"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    assert len(train(config, tmp_path / "split", overrides={**overrides, "train.steps": 2})) == 2
    assert [r["step"] for r in train(config, tmp_path / "split", overrides=overrides, resume=True,
                                     on_step=terminate_after_step_3)] == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "split" / "checkpoints").iterdir()) == ["2", "3"]
    train(config, tmp_path / "split", overrides=overrides, resume=True)
    assert without_timings(read_metrics(tmp_path / "split")) == full


@pytest.mark.parametrize("override, message", [
    (["rollout.mode=async"], "mesh.rollout_devices: rollout.mode async generates on the last"),
    (["mesh.rollout_devices=2"], "mesh.rollout_devices: a rollout mesh is for rollout.mode async"),
    ([*ASYNC, "rollout.max_staleness=2"], "rollout.max_staleness: must be 0 or 1, got 2"),
    (["rollout.mode=async", "mesh.rollout_devices=3"],
     "mesh.rollout_devices: 3 devices do not split the 32 rollouts per step"),
    ([*ASYNC, "loss.filter_groups_max_rounds=2"], "loss.filter_groups_max_rounds: rollout.mode async"),
    (["rollout.mode=async", "mesh.rollout_devices=2", "mesh.data=4", "mesh.fsdp=2"],
     "mesh.rollout_devices: 2 rollout devices after the trainer mesh data=4 x fsdp=2 x tensor=1 (8 devices) "
     "need 10 devices, this process sees 8"),
])
def test_bad_async_config_names_the_key(tiny_policy, tmp_path, capsys, override, message):
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=2)
    assert train_cli("--config", config, "--run-dir", tmp_path / "run", *override) != 0
    assert message in capsys.readouterr().err


def test_async_mode_refuses_several_processes(tiny_policy, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=2)
    assert train_cli("--config", config, "--run-dir", tmp_path / "run", *ASYNC) != 0
    assert "rollout.mode: async runs in one process" in capsys.readouterr().err
