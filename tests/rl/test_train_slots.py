"""`jaxspec train` with rollout.slots on meshes: colocated on a fsdp x tensor mesh (the rollout's
copy fsdp-sharded or gathered, rollout.gather_weights) and async on a 2-device rollout mesh. The
step's 32 rows stream through 8 slots in 2 groups over the batch axis, and the step's rollouts
(sampled, float32) are the one-device run's token for token: row r's token i is drawn with a key
of (r, i) alone, whichever device and slot run it; so are those of rollout.slots auto (on the
CPU: a slot for every row)."""

import numpy as np
import pytest

from tests.rl.runs import LIGHT, read_metrics, train_cli, write_config

SLOTS = ["rollout.slots=8", *LIGHT]
MESHES = {
    "colocated-fsdp2-tensor2": ["mesh.fsdp=2", "mesh.tensor=2"],
    "colocated-fsdp2-tensor2-gathered": ["mesh.fsdp=2", "mesh.tensor=2", "rollout.gather_weights=true"],
    "async-2-rollout-devices": ["rollout.mode=async", "mesh.rollout_devices=2"],
}


def run_recording_rollouts(tiny_policy, run_dir, options: list, monkeypatch) -> tuple[list, list]:
    """(the generate calls' outputs, the metrics records) of a one-step run with `options`."""
    import jaxspec.rl.rollout_source as rollout_source

    calls, generate = [], rollout_source.generate

    def recording_generate(*args, **kwargs):
        out = generate(*args, **kwargs)
        calls.append(out)
        return out

    monkeypatch.setattr(rollout_source, "generate", recording_generate)
    config = write_config(run_dir.parent / f"{run_dir.name}.yaml", tiny_policy[0], steps=1, eval_every=0)
    assert train_cli("--config", config, "--run-dir", run_dir, *options) == 0
    return calls, read_metrics(run_dir)


@pytest.fixture(scope="module")
def one_device(tiny_policy, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        return run_recording_rollouts(tiny_policy, tmp_path_factory.mktemp("one") / "run", SLOTS, patch)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_slot_rollouts_on_a_mesh_are_the_one_device_rollouts(tiny_policy, tmp_path, one_device, mesh, monkeypatch):
    (want,), (want_record,) = one_device
    assert want.stats["groups"] == 1
    calls, (record,) = run_recording_rollouts(tiny_policy, tmp_path / "run", SLOTS + MESHES[mesh], monkeypatch)
    (got,) = calls
    assert (got.stats["slots"], got.stats["groups"]) == (8, 2)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), rtol=1e-5, atol=1e-5)
    assert record["reward_mean"] == want_record["reward_mean"] and np.isfinite(record["loss"])


def test_auto_slots_give_the_rollouts_of_explicit_slots(tiny_policy, tmp_path, one_device, monkeypatch):
    from jaxspec.rollout import slot_memory

    monkeypatch.setattr(slot_memory, "_chosen", {})
    (want,), _ = one_device
    (got,), _ = run_recording_rollouts(tiny_policy, tmp_path / "run", [*LIGHT, "rollout.slots=auto"], monkeypatch)
    assert got.stats["slots"] == 32  # the CPU's assumed 2 GiB hold every row
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), rtol=1e-5, atol=1e-5)
