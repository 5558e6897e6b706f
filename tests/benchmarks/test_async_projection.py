"""benchmarks/async_projection.py: the fitted costs reproduce the runs they come from, and the
projected split balances generation against the trainer."""

import json

import pytest

from tests.benchmarks.scripts import load_script

projection = load_script("async_projection")

# a colocated run on 2 devices (128 rows each) and an async 1 + 1 run of 256 rollouts per step
RUNS = {
    "coloc": {"generation_s": 0.7, "logprob_s": 0.1, "train_s": 0.4, "step_s": 1.3},
    "async": {"generation_s": 1.0, "logprob_s": 0.2, "train_s": 0.5, "sync_s": 0.02, "step_s": 1.05},
}


def fitted():
    return projection.fit_costs(RUNS, "coloc", 2, "async", 1, 1, 256)


def test_the_fit_passes_through_both_measured_runs():
    c = fitted()
    assert projection.generation_s(c, 128, 1.0) == pytest.approx(0.7)
    assert projection.generation_s(c, 256, 1.0) == pytest.approx(1.0)
    assert c.overlap == pytest.approx(1.05 / 1.0)
    two = projection.project(c, 2)
    assert two["colocated_step_s"] == pytest.approx(1.3)  # the colocated run itself
    assert (two["rollout_gpus"], two["trainer_gpus"]) == (1, 1)
    assert two["async_step_s"] == pytest.approx(1.05)  # the async run itself


def test_the_best_split_is_the_smallest_async_step():
    c = fitted()
    best = projection.project(c, 16)
    rows = c.colocated_rows * 16
    for rollout_gpus in range(1, 16):
        trainer = c.train_per_row_multi_s * rows / (16 - rollout_gpus) + c.sync_s
        step = c.overlap * max(projection.generation_s(c, rows / rollout_gpus, 1.0), trainer)
        assert best["async_step_s"] <= step + 1e-12
    assert projection.project(c, 16, 2.0)["async_step_s"] < best["async_step_s"]  # faster generation helps


def test_cli_writes_the_projection_and_names_bad_input(tmp_path, capsys):
    source = tmp_path / "compare.json"
    source.write_text(json.dumps(RUNS))
    out = tmp_path / "projection.json"
    assert (
        projection.main(
            [
                str(source),
                "--colocated",
                "coloc:2",
                "--async",
                "async:1:1",
                "--rollouts",
                "256",
                "--gpus",
                "8",
                "--generation-speedup",
                "1.5",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert [r["generation_speedup"] for r in result["rows"]] == [1.0, 1.5]
    assert "not measured" in result["projection"] and "PROJECTION" in capsys.readouterr().out
    assert projection.main([str(source), "--colocated", "coloc:2", "--async", "nope:1:1", "--rollouts", "256"]) == 2
    assert "no run named 'nope'" in capsys.readouterr().err
    no_sync = {**RUNS, "async": {k: v for k, v in RUNS["async"].items() if k != "sync_s"}}
    source.write_text(json.dumps(no_sync))
    assert projection.main([str(source), "--colocated", "coloc:2", "--async", "async:1:1", "--rollouts", "256"]) == 2
    assert "run 'async' has no sync_s" in capsys.readouterr().err


def test_a_speculative_pair_is_also_stated_against_the_colocated_ar_run(tmp_path):
    runs = {**RUNS, "ar": {"generation_s": 1.2, "logprob_s": 0.1, "train_s": 0.4, "step_s": 1.95}}
    source, out = tmp_path / "compare.json", tmp_path / "projection.json"
    source.write_text(json.dumps(runs))
    assert (
        projection.main(
            [
                str(source),
                "--colocated",
                "coloc:2",
                "--async",
                "async:1:1",
                "--rollouts",
                "256",
                "--gpus",
                "2",
                "8",
                "--baseline",
                "ar",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    for row in json.loads(out.read_text())["rows"]:
        assert row["async_vs_colocated_ar"] == pytest.approx(1.95 / row["async_step_s"])
        assert row["async_vs_colocated"] == pytest.approx(row["colocated_step_s"] / row["async_step_s"])
    assert (
        projection.main(
            [str(source), "--colocated", "coloc:2", "--async", "async:1:1", "--rollouts", "256", "--baseline", "nope"]
        )
        == 2
    )
