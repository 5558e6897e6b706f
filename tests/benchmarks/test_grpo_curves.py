"""benchmarks/grpo_curves.py: the job plan and the scheduler that runs jobs over GPUs."""

import sys
from pathlib import Path

import pytest

from tests.benchmarks.scripts import load_script

grpo_curves = load_script("grpo_curves")


def job(name, tmp_path, code, needs=None, width=1, metrics=False):
    """A job that runs `code` in Python; it can read its GPUs from CUDA_VISIBLE_DEVICES."""
    run_dir = tmp_path / f"run-{name}"
    return grpo_curves.Job(
        name,
        needs,
        [sys.executable, "-c", code],
        width,
        {"RUN_DIR": str(run_dir)},
        tmp_path / "logs" / f"{name}.log",
        run_dir / "metrics.jsonl" if metrics else None,
        tmp_path / "results" / f"{name}.jsonl" if metrics else None,
    )


RECORD = (
    "import os, pathlib; d = pathlib.Path(os.environ['RUN_DIR']); d.mkdir(parents=True, exist_ok=True); "
    "(d / 'gpus').write_text(os.environ['CUDA_VISIBLE_DEVICES']); "
)


def test_jobs_wait_for_their_inputs_and_get_free_gpus(tmp_path):
    made = tmp_path / "policy"
    (tmp_path / "results").mkdir()
    jobs = [
        job(
            "pretrain", tmp_path, RECORD + f"import time; time.sleep(0.3); pathlib.Path({str(made)!r}).mkdir()", width=2
        ),
        job(
            "run",
            tmp_path,
            RECORD + f"assert pathlib.Path({str(made)!r}).is_dir(); "
            "(d / 'metrics.jsonl').write_text('{\"step\": 1}\\n')",
            needs=made,
            metrics=True,
        ),
        job("fails", tmp_path, "raise SystemExit(3)", needs=made),
        job("orphan", tmp_path, "pass", needs=tmp_path / "never"),
    ]
    failed = grpo_curves.run_all(jobs, ["0", "1"], poll_s=0.05)
    assert failed == 2  # `fails` exits 3, `orphan` never gets its input
    assert (tmp_path / "run-pretrain" / "gpus").read_text() == "0,1"
    assert (tmp_path / "run-run" / "gpus").read_text() in {"0", "1"}
    assert (tmp_path / "results" / "run.jsonl").read_text() == '{"step": 1}\n'  # mirrored metrics
    assert jobs[3].process is None


def test_plan_skips_stages_whose_output_exists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = grpo_curves.argparse.Namespace(
        results=str(tmp_path / "res"),
        prefix="p",
        draft_steps=10,
        steps=5,
        eval_every=0,
        checkpoint_every=5,
        extra=["quick=train.steps=2 x.y=1"],
        gpus_per_run=1,
        async_runs=False,
        rollout_gpus=0,
        grpo_args="train.compilation_cache=runs/xla-cache x.y=0",
        only=None,
    )
    names = [j.name for j in grpo_curves.jobs_for(args, num_gpus=3)]
    assert names == ["pretrain", "draft", "ar", "ar_seed1", "frozen", "online", "quick"]
    pretrain = grpo_curves.jobs_for(args, num_gpus=3)[0]
    assert pretrain.width == 2 and "mesh.data=2" in pretrain.argv[-1]  # largest power of two <= 3 GPUs
    Path("runs/small/policy").mkdir(parents=True)
    Path("runs/draft-small/draft").mkdir(parents=True)
    jobs = {j.name: j for j in grpo_curves.jobs_for(args, num_gpus=3)}
    assert list(jobs) == ["ar", "ar_seed1", "frozen", "online", "quick"]
    assert jobs["ar"].needs == Path("runs/small/policy") and jobs["frozen"].needs == Path("runs/draft-small/draft")
    assert jobs["quick"].argv[-2:] == ["train.steps=2", "x.y=1"]
    for job in jobs.values():  # --grpo-args in every run, before the run's own overrides
        shared = job.argv.index("train.compilation_cache=runs/xla-cache")
        assert job.argv[shared + 1] == "x.y=0"
    assert jobs["quick"].argv.index("x.y=0") < jobs["quick"].argv.index("x.y=1")


@pytest.mark.parametrize("extra", ["noequals", "ar=x=1", "bad-name=x=1"])
def test_bad_extra_runs_are_refused(tmp_path, monkeypatch, extra):
    monkeypatch.chdir(tmp_path)
    args = grpo_curves.argparse.Namespace(
        results="res",
        prefix="p",
        draft_steps=10,
        steps=5,
        eval_every=0,
        checkpoint_every=5,
        extra=[extra],
        gpus_per_run=1,
        async_runs=False,
        rollout_gpus=0,
        grpo_args="",
        only=None,
    )
    with pytest.raises(SystemExit, match="--extra"):
        grpo_curves.jobs_for(args, num_gpus=1)


def test_the_async_study_plan_gives_each_run_the_same_gpus(tmp_path, monkeypatch):
    """--gpus-per-run 2 --async-runs: colocated runs on mesh.data=2, async runs split 1 + 1, every
    run two GPUs wide; each run's overrides load into the GRPO config and pass its validation."""
    from jaxspec.config_io import load_config
    from jaxspec.rl.config import GRPOConfig
    from jaxspec.rl.validation import validate

    repo = Path(grpo_curves.__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)
    Path("runs/small/policy").mkdir(parents=True)
    Path("runs/draft-small/draft").mkdir(parents=True)
    args = grpo_curves.argparse.Namespace(
        results="res",
        prefix="p",
        draft_steps=10,
        steps=5,
        eval_every=0,
        checkpoint_every=5,
        extra=[],
        gpus_per_run=2,
        async_runs=True,
        rollout_gpus=0,
        grpo_args="train.compilation_cache=runs/xla-cache",
        only=None,
    )
    jobs = {j.name: j for j in grpo_curves.jobs_for(args, num_gpus=4)}
    assert list(jobs) == ["ar", "ar_seed1", "frozen", "online", "async_ar", "async_frozen", "async_online"]
    assert {j.width for j in jobs.values()} == {2}
    for name, job in jobs.items():
        overrides = job.argv[job.argv.index("--run-dir") + 2 :]
        cfg = load_config(GRPOConfig, repo / "configs" / "grpo_small.yaml", overrides)
        validate(cfg, "grpo_small.yaml")
        if name.startswith("async_"):
            assert (cfg.rollout.mode, cfg.mesh.rollout_devices, cfg.mesh.data) == ("async", 1, 1)
        else:
            assert (cfg.rollout.mode, cfg.mesh.rollout_devices, cfg.mesh.data) == ("colocated", 0, 2)
        assert (cfg.spec.method == "none") == ("ar" in name.split("_"))
        assert cfg.train.compilation_cache == "runs/xla-cache"


def test_only_keeps_the_named_runs_and_the_stages_they_need(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = grpo_curves.argparse.Namespace(
        results="res",
        prefix="p",
        draft_steps=10,
        steps=5,
        eval_every=0,
        checkpoint_every=5,
        extra=["quick=spec.method=none train.steps=2"],
        gpus_per_run=1,
        async_runs=False,
        rollout_gpus=0,
        grpo_args="",
        only=["quick", "ar"],
    )
    assert [j.name for j in grpo_curves.jobs_for(args, num_gpus=2)] == ["pretrain", "ar", "quick"]  # no head
    args.only = ["frozen"]
    assert [j.name for j in grpo_curves.jobs_for(args, num_gpus=2)] == ["pretrain", "draft", "frozen"]
    args.only = ["frozen", "nope"]
    with pytest.raises(SystemExit, match="--only nope: no such run"):
        grpo_curves.jobs_for(args, num_gpus=2)
