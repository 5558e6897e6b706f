"""`jaxspec train` with rollout.coupled: a step's EAGLE-3 rollouts are the autoregressive run's,
token for token (sampled, float32, staged engine and slots), so the two runs train on the same
answers; stochastic drafts are refused by name."""

import numpy as np
import pytest

from tests.rl.runs import train_cli, write_config
from tests.rl.test_train_slots import run_recording_rollouts

COUPLED = ["rollout.coupled=true", "draft.online=false", "loss.recompute_logprobs=false"]


@pytest.mark.parametrize("slots", [[], ["rollout.slots=8"]], ids=["staged", "8-slots"])
def test_coupled_eagle3_rollouts_are_the_autoregressive_rollouts(tiny_policy, tmp_path, monkeypatch, slots):
    (ar,), (ar_record,) = run_recording_rollouts(
        tiny_policy, tmp_path / "ar", [*COUPLED, *slots, "spec.method=none"], monkeypatch
    )
    (spec,), (spec_record,) = run_recording_rollouts(tiny_policy, tmp_path / "spec", [*COUPLED, *slots], monkeypatch)
    assert spec.stats["drafted_tokens"] > 0
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
    np.testing.assert_allclose(np.asarray(spec.logprobs), np.asarray(ar.logprobs), rtol=1e-5, atol=1e-5)
    assert spec_record["reward_mean"] == ar_record["reward_mean"]
    assert spec_record["loss"] == pytest.approx(ar_record["loss"], rel=1e-4, abs=1e-6)


def test_coupled_stochastic_drafts_are_refused(tiny_policy, tmp_path, capsys):
    config = write_config(tmp_path / "c.yaml", tiny_policy[0], steps=1, eval_every=0)
    code = train_cli("--config", config, "--run-dir", tmp_path / "run", *COUPLED, "spec.draft_sampling=stochastic")
    assert code != 0
    assert "rollout.coupled: needs deterministic drafts" in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
