"""rollout.mode async: rollouts on the last mesh.rollout_devices devices, one step off-policy, with
a device-to-device weight sync after each update (`jaxspec.rl.async_rollouts`)."""

import dataclasses
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
from tests.rl.runs import read_metrics, run_two_processes, train_cli, without_machine_keys, write_config

pytestmark = pytest.mark.slow

ASYNC = ["rollout.mode=async", "mesh.rollout_devices=1"]
# The keys only async runs write.
ASYNC_KEYS = {"staleness", "rollout_version", "sync_bytes"}


def _run(tiny_policy, tmp_path, *overrides, steps=3):
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=steps, eval_every=0, checkpoint_every=steps)
    cfg = load_config(GRPOConfig, config, list(overrides))
    return GRPORun(cfg, tmp_path / "run", False, check_inputs(cfg))


def _trainer_logprobs(run: GRPORun, out: Rollouts, params) -> tuple[np.ndarray, np.ndarray]:
    """(the trainer's log-probs of the rollouts' tokens under `params` float32 [B, N], their
    response mask bool [B, N])."""
    batch = training_rows(out.prompts, out.tokens, out.lengths, run.tok.pad_id, run.width)
    rows = run.placement.rows(pack_rows(batch.response_rows(), run.placement.row_shards))
    return np.asarray(
        run.score(params, rows.tokens, rows.segment_ids, rows.resp_index, rows.resp_tokens)
    ), batch.resp_mask


def _rollout_logprob_error(run: GRPORun, out: Rollouts, params) -> float:
    """Largest difference between the rollout's log-probs of its tokens and those of `params`."""
    got, mask = _trainer_logprobs(run, out, params)
    compared = mask & np.isfinite(got) & np.isfinite(out.logprobs)
    return float(np.abs(got - out.logprobs)[compared].max())


def _generating_version(run: GRPORun, out: Rollouts, versions: list) -> int:
    """The weights version (index into `versions`) whose recomputed log-probs reproduce the
    rollout's; every other version is told apart by more than 1e-3."""
    errors = [_rollout_logprob_error(run, out, params) for params in versions]
    found = int(np.argmin(errors))
    assert errors[found] < 1e-4, errors
    assert all(e > 1e-3 for i, e in enumerate(errors) if i != found), errors  # the test can tell versions apart
    return found


@pytest.mark.parametrize("staleness, steps", [(1, 3), (2, 4)])
def test_rollouts_use_the_weights_of_max_staleness_updates_before(tiny_policy, tmp_path, staleness, steps):
    """max_staleness k on a 2-device rollout mesh: step t trains on rollouts of the weights before
    step t-k's update (the initial weights for steps 1..k+1), as the log-probs recomputed with every
    version show, and the logged staleness / rollout_version are those measured that way; k batches
    stay queued between steps (those past train.steps keep their weights but are not generated);
    the importance ratio is 1 where the batch's weights are the trained ones (step 1) and not where
    an update came between; after each sync the rollout copy equals the trainer's weights bit for
    bit, on devices the trainer does not use."""
    run = _run(
        tiny_policy,
        tmp_path,
        "rollout.mode=async",
        "mesh.rollout_devices=2",
        "loss.minibatches=1",
        "loss.ppo_epochs=1",
        "loss.recompute_logprobs=false",
        "loss.kl_beta=0.0",
        "loss.filter_groups=false",
        f"rollout.max_staleness={staleness}",
        steps=steps,
    )
    consumed, versions = [], [jax.tree.map(np.asarray, run.state["params"])]
    next_batch = run.rollouts.next_batch

    def recording_next_batch(*args):
        out = next_batch(*args)
        consumed.append(out[0])
        return out

    run.rollouts.next_batch = recording_next_batch
    trainer_devices = {d for x in jax.tree.leaves(run.state["params"]) for d in x.devices()}
    records = []
    for _ in range(steps):
        records.append(run.run_step())
        versions.append(jax.tree.map(np.asarray, run.state["params"]))
        copy = run.rollouts.weights
        assert copy.version == run.step
        # the next k steps' batches were queued before this step's update, with older weights
        queued = [(b.step, b.weights.version, b.result is not None) for b in run.rollouts.in_flight]
        assert queued == [
            (t, max(0, t - 1 - staleness), t <= steps) for t in range(run.step + 1, run.step + 1 + staleness)
        ], queued
        assert list(np.asarray(run.state["rollout_version"])) == [v for _, v, _ in queued]
        for got, want in zip(
            jax.tree.leaves((copy.policy, copy.draft)),
            jax.tree.leaves((run.state["params"], run.state["draft_params"])),
        ):
            assert got.devices() == set(jax.devices()[-2:]) and not got.devices() & trainer_devices
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    run.rollouts.close()

    measured = [_generating_version(run, out, versions) for out in consumed]
    assert measured == [max(0, t - 1 - staleness) for t in range(1, steps + 1)]
    assert [r["rollout_version"] for r in records] == measured
    assert [r["staleness"] for r in records] == [r["step"] - 1 - v for r, v in zip(records, measured)]
    assert records[-1]["staleness"] == staleness
    assert all(r["sync_bytes"] > 0 and r["time_sync_s"] > 0 for r in records)
    assert abs(records[0]["ratio_mean"] - 1) < 1e-5
    assert all(abs(r["ratio_mean"] - 1) > 1e-4 for r in records[1:]), [r["ratio_mean"] for r in records]


def test_stale_rollouts_are_weighted_by_the_proximal_over_the_behaviour_policy(tiny_policy, tmp_path):
    """Async, staleness 1, lr > 0, recomputed log-probs, uncapped weight, one update per step: from
    step 2 on each batch was generated by weights one update older than those its update starts
    from. The logged behaviour weight is then not 1, and equals the mean over the loss tokens of
    exp(proximal - behaviour) computed here from the trainer's log-probs at the two weights
    versions (step 1's, generated by the weights it trains, is 1 up to float32 rounding)."""
    run = _run(
        tiny_policy,
        tmp_path,
        *ASYNC,
        "loss.minibatches=1",
        "loss.ppo_epochs=1",
        "loss.recompute_logprobs=true",
        "loss.tis_cap=null",
        "loss.kl_beta=0.0",
        "loss.filter_groups=false",
        steps=3,
    )
    consumed, versions = [], [jax.tree.map(np.asarray, run.state["params"])]
    next_batch = run.rollouts.next_batch

    def recording_next_batch(*args):
        out = next_batch(*args)
        consumed.append(out[0])
        return out

    run.rollouts.next_batch = recording_next_batch
    records = []
    for _ in range(3):
        records.append(run.run_step())
        versions.append(jax.tree.map(np.asarray, run.state["params"]))
    run.rollouts.close()
    for step, (record, out) in enumerate(zip(records, consumed)):
        prox, mask = _trainer_logprobs(run, out, versions[step])
        behaviour, _ = _trainer_logprobs(run, out, versions[out.rollout_version])
        counted = mask & np.isfinite(prox) & np.isfinite(behaviour)
        weights = np.exp(prox.astype(np.float64) - behaviour)[counted]
        assert record["behaviour_weight_mean"] == pytest.approx(weights.mean(), rel=1e-4), (step, record)
        assert record["behaviour_weight_max"] == pytest.approx(weights.max(), rel=1e-4), (step, record)
        if step == 0:
            assert abs(weights.max() - 1) < 1e-4 and abs(weights.min() - 1) < 1e-4
        else:
            assert out.rollout_version == step - 1 and record["staleness"] == 1
            assert abs(record["behaviour_weight_mean"] - 1) > 1e-3 or abs(weights.max() - 1) > 1e-2, weights


def test_the_importance_ratio_is_1_when_stale_rollouts_come_from_unchanged_weights(tiny_policy, tmp_path):
    """max_staleness 2 with a learning rate of 0 (set past the config's check, which asks for > 0):
    the rollouts are 0, 1, 2 steps stale by version but their weights equal the trained ones, so
    the importance ratio is 1 and nothing is clipped."""
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=3, eval_every=0, checkpoint_every=3)
    cfg = load_config(
        GRPOConfig,
        config,
        [*ASYNC, "rollout.max_staleness=2", "loss.recompute_logprobs=false", "loss.filter_groups=false"],
    )
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, learning_rate=0.0))
    run = GRPORun(cfg, tmp_path / "run", False, check_inputs(cfg))
    records = [run.run_step() for _ in range(3)]
    run.rollouts.close()
    assert [r["staleness"] for r in records] == [0, 1, 2]
    for r in records:
        assert abs(r["ratio_mean"] - 1) < 1e-6 and r["clip_low_frac"] == r["clip_high_frac"] == 0, r


@pytest.mark.parametrize(
    "mesh",
    [
        ["mesh.rollout_devices=1"],
        ["mesh.fsdp=2", "mesh.tensor=2", "mesh.rollout_devices=2"],
        ["mesh.fsdp=2", "mesh.rollout_devices=2", "rollout.gather_weights=true"],
    ],
)
def test_the_sync_casts_to_the_rollout_dtype_bit_for_bit(tiny_policy, tmp_path, mesh, monkeypatch):
    """From one trainer device or a sharded trainer mesh to the replicated rollout copy (with
    rollout.gather_weights too, which applies to the trainer mesh's validation alone: the sync
    gathers nothing on the trainer mesh)."""
    import jaxspec.rl.rollout_source as rollout_source

    run = _run(tiny_policy, tmp_path, "rollout.mode=async", *mesh, "rollout.dtype=bfloat16")
    rollout_devices = set(jax.devices()[-run.cfg.mesh.rollout_devices :])
    run.state["params"] = jax.tree.map(lambda x: x * 1.5, run.state["params"])  # an "update"
    run.step += 1
    cast_floats, gathered = rollout_source.cast_floats, []
    monkeypatch.setattr(
        rollout_source,
        "cast_floats",
        lambda tree, dtype, shardings=None: (
            gathered.append(shardings is not None),
            cast_floats(tree, dtype, shardings),
        )[1],
    )
    assert run.rollouts.sync(run.state, run.step) == sum(
        x.size * 2 for x in jax.tree.leaves(run.state["params"])
    ) + sum(
        x.nbytes if not jnp.issubdtype(x.dtype, jnp.floating) else x.size * 2
        for x in jax.tree.leaves(run.state["draft_params"])
    )
    copy = run.rollouts.weights
    for got, want in zip(
        jax.tree.leaves((copy.policy, copy.draft)), jax.tree.leaves((run.state["params"], run.state["draft_params"]))
    ):
        expected = jnp.bfloat16 if jnp.issubdtype(want.dtype, jnp.floating) else want.dtype
        assert got.dtype == expected and got.devices() == rollout_devices and got.sharding.is_fully_replicated
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(expected)))
    assert gathered and not any(gathered)
    run.rollouts.close()


def test_a_frozen_draft_is_copied_once(tiny_policy, tmp_path):
    run = _run(tiny_policy, tmp_path, *ASYNC, "draft.online=false")
    draft = run.rollouts.weights.draft
    run.step += 1
    assert run.rollouts.sync(run.state, run.step) == sum(x.nbytes for x in jax.tree.leaves(run.state["params"]))
    assert run.rollouts.weights.draft is draft and run.rollouts.weights.version == 1
    run.rollouts.close()


def test_staleness_0_repeats_the_colocated_run(tiny_policy, tmp_path):
    """max_staleness 0 on the last device: the rewards, losses, draft and log-prob metrics of the
    colocated run on the first device, exactly."""
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=2, eval_every=0, checkpoint_every=2)
    assert train_cli("--config", config, "--run-dir", tmp_path / "colocated") == 0
    assert train_cli("--config", config, "--run-dir", tmp_path / "async", *ASYNC, "rollout.max_staleness=0") == 0
    colocated = without_machine_keys(read_metrics(tmp_path / "colocated"))
    stale0 = without_machine_keys(read_metrics(tmp_path / "async"))
    assert [r["staleness"] for r in stale0] == [0, 0]
    assert [{k: v for k, v in r.items() if k not in ASYNC_KEYS} for r in stale0] == colocated


@pytest.mark.parametrize("staleness, versions", [(1, [0, 0, 1, 2]), (2, [0, 0, 0, 1])])
def test_resume_and_sigterm_continue_the_async_run(tiny_policy, tmp_path, staleness, versions):
    """A run of 2 steps extended to 4 by --resume, then a SIGTERM during step 3 that checkpoints at
    its end with the next max_staleness batches in flight (step 4's generated with older weights than
    the checkpointed ones; with staleness 2, step 5's past train.steps): each resumed run
    regenerates them from the checkpointed rollout copies, and the records are those of the
    uninterrupted run."""
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=4, eval_every=0, checkpoint_every=4)
    overrides = {"rollout.mode": "async", "mesh.rollout_devices": 1, "rollout.max_staleness": staleness}
    train(config, tmp_path / "full", overrides=overrides)
    full = without_machine_keys(read_metrics(tmp_path / "full"))
    assert [(r["staleness"], r["rollout_version"]) for r in full] == [(s - v, v) for s, v in enumerate(versions)]

    def terminate_after_step_3(record):
        if record["step"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    assert len(train(config, tmp_path / "split", overrides={**overrides, "train.steps": 2})) == 2
    assert [
        r["step"]
        for r in train(config, tmp_path / "split", overrides=overrides, resume=True, on_step=terminate_after_step_3)
    ] == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "split" / "checkpoints").iterdir()) == ["2", "3"]
    train(config, tmp_path / "split", overrides=overrides, resume=True)
    assert without_machine_keys(read_metrics(tmp_path / "split")) == full


@pytest.mark.parametrize(
    "override, message",
    [
        (["rollout.mode=async"], "mesh.rollout_devices: rollout.mode async generates on the last"),
        (["mesh.rollout_devices=2"], "mesh.rollout_devices: a rollout mesh is for rollout.mode async"),
        ([*ASYNC, "rollout.max_staleness=-1"], "rollout.max_staleness: must be >= 0, got -1"),
        (
            ["rollout.mode=async", "mesh.rollout_devices=3"],
            "mesh.rollout_devices: 3 devices do not split the 32 rollouts per step",
        ),
        ([*ASYNC, "loss.filter_groups_max_rounds=2"], "loss.filter_groups_max_rounds: rollout.mode async"),
        (
            [*ASYNC, "loss.recompute_logprobs=true", "loss.tis_cap=0"],
            "loss.tis_cap: 0 with loss.recompute_logprobs: true drops the behaviour policy, and rollout.mode async",
        ),
        (
            ["rollout.mode=async", "mesh.rollout_devices=2", "mesh.data=4", "mesh.fsdp=2"],
            "mesh.rollout_devices: 2 rollout devices after the trainer mesh data=4 x fsdp=2 x tensor=1 (8 devices) "
            "need 10 devices, this process sees 8",
        ),
    ],
)
def test_bad_async_config_names_the_key(tiny_policy, tmp_path, capsys, override, message):
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=2)
    assert train_cli("--config", config, "--run-dir", tmp_path / "run", *override) != 0
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, message",
    [
        (
            ASYNC,
            "mesh.rollout_devices: each of the job's 2 processes gives the same share of the trainer mesh "
            "(1 devices) and of the 1 rollout devices; both must be multiples of 2",
        ),
        (
            ["rollout.mode=async", "mesh.data=2", "mesh.rollout_devices=2"],
            "rollout.sub_batch: rollout.mode async over 2 processes generates the step's 32 rollouts as calls of "
            "rollout.sub_batch rows, an equal share of them on every process; the 1 call(s) of 32 rows do not split "
            "over the processes (e.g. rollout.sub_batch=16)",
        ),
    ],
)
def test_a_multi_process_async_split_that_does_not_fit_names_the_key(
    tiny_policy, tmp_path, capsys, monkeypatch, override, message
):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=2)
    assert train_cli("--config", config, "--run-dir", tmp_path / "run", *override) != 0
    assert message in capsys.readouterr().err


def test_two_processes_run_the_async_job_of_one(tiny_policy, tmp_path):
    """Two processes of 2 CPU devices each: both train on their first device (the trainer mesh,
    data = 2, spans the processes) and generate half of each step's rollouts (one sub-batch) on
    their second, with the weights copied within each process; the records are those of the
    one-process async run on 2 + 2 devices with the same rollout.sub_batch (the same rollouts and
    staleness; losses within the float noise of cross-process reductions, which one update per
    step keeps Adam's first steps from amplifying), also across a checkpoint (rollout copies
    included) and a resume of the two-process job."""
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=3, eval_every=0, checkpoint_every=2)
    args = [
        "rollout.mode=async",
        "mesh.data=2",
        "mesh.rollout_devices=2",
        "rollout.sub_batch=16",
        "loss.minibatches=1",
        "loss.ppo_epochs=1",
    ]
    assert train_cli("--config", config, "--run-dir", tmp_path / "one", *args) == 0
    want = without_machine_keys(read_metrics(tmp_path / "one"))
    assert [r["staleness"] for r in want] == [0, 1, 1]

    run = tmp_path / "two"
    logs = [tmp_path / f"process{pid}.log" for pid in range(2)]
    run_two_processes(["--config", config, "--run-dir", run, *args, "train.steps=2"], logs, devices=2)
    assert (run / "checkpoints" / "2").is_dir()
    outputs = run_two_processes(["--config", config, "--run-dir", run, "--resume", *args], logs, devices=2)
    assert "resumed from step 2" in outputs[0]
    got = without_machine_keys(read_metrics(run))
    assert [r["step"] for r in got] == [1, 2, 3]
    for w, g in zip(want, got, strict=True):
        assert (g["staleness"], g["rollout_version"]) == (w["staleness"], w["rollout_version"])
        assert g["reward_mean"] == w["reward_mean"] and g["response_length_mean"] == w["response_length_mean"]
        for key in ("loss", "kl", "grad_norm", "ratio_mean", "draft_loss", "acceptance_length"):
            np.testing.assert_allclose(g[key], w[key], rtol=1e-3, atol=1e-6, err_msg=key)
