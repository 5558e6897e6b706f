"""The GRPO experiment with one run per GPU: accuracy curves of AR and speculative rollouts.

    XLA_PYTHON_CLIENT_MEM_FRACTION=.92 python3 benchmarks/grpo_curves.py --steps 200 --eval-every 10 \
        --results benchmarks/results/<campaign> --prefix grpo_curves

Jobs, each on one GPU of this host (CUDA_VISIBLE_DEVICES), started in order as soon as a GPU is
free and what they need exists:

- `pretrain` (`small_workload.sh pretrain` on every GPU, `mesh.data` = the largest power of two
  up to the GPU count, or on one GPU should that fail; skipped when runs/small/policy exists),
  then `draft` (the in-domain EAGLE-3 head, `small_workload.sh draft`; skipped when
  runs/draft-small/draft exists);
- GRPO with `configs/grpo_small.yaml`: `ar` and `ar_seed1` (autoregressive, train.seed 0 and 1:
  the seed-to-seed spread) as soon as the policy exists, `frozen` (EAGLE-3 k=3, frozen head) and
  `online` (the head adapted online) as soon as the head exists;
- `--extra NAME='key=value ...'` runs after those (e.g. shorter timing-only runs);
- `--only NAME ...` keeps only the named runs (and the head's training only if one of them needs it);
- `--grpo-args 'key=value ...'` goes to every GRPO run, before its own overrides: e.g.
  `train.compilation_cache=runs/xla-cache`, one persistent compilation cache for all the runs, so
  that a run compiles only the programs no earlier run compiled (`ar_seed1` none of `ar`'s).

`--gpus-per-run N` gives every GRPO run N GPUs (`mesh.data=N`, colocated). `--async-runs` adds the
asynchronous runs of a colocated-vs-async study on the same N GPUs: `async_ar`, `async_frozen` and
`async_online` (`rollout.mode=async`, the last `--rollout-gpus` of the N generate, the others train
with `mesh.data`), compared with the colocated ones in the same summary. The asynchronous GRPO study
on a 4-GPU host (two runs at a time):

    python3 benchmarks/grpo_curves.py --steps 100 --eval-every 10 --gpus-per-run 2 --async-runs \
        --results benchmarks/results/<campaign> --prefix async_study

Each run's metrics are copied to RESULTS/PREFIX_NAME.jsonl every few seconds (so a run cut short
still leaves its curve), logs to RESULTS/PREFIX_NAME.log, and at the end `grpo_compare.py` writes
RESULTS/PREFIX.{json,png,log} for the four main runs. With one GPU the jobs run one after another.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

POLICY, HEAD = Path("runs/small/policy"), Path("runs/draft-small/draft")
MAIN_RUNS = {
    "ar": "spec.method=none draft.online=false",
    "ar_seed1": "spec.method=none draft.online=false train.seed=1",
    "frozen": "draft.online=false",
    "online": "",
}
ASYNC_RUNS = {f"async_{name}": MAIN_RUNS[name] for name in ("ar", "frozen", "online")}


@dataclasses.dataclass
class Job:
    name: str
    needs: Path | None  # a path that must exist before the job starts
    argv: list[str]
    width: int  # GPUs it takes
    env: dict[str, str]
    log: Path
    metrics: Path | None = None  # a run's metrics.jsonl, mirrored to `copy`
    copy: Path | None = None
    process: subprocess.Popen | None = None
    gpus: str | None = None  # CUDA_VISIBLE_DEVICES of the running job
    started: float = 0.0


def gpu_ids(requested: str | None) -> list[str]:
    if requested:
        return requested.split(",")
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ["0"]
    return [str(i) for i, line in enumerate(listing.splitlines()) if line.startswith("GPU ")] or ["0"]


def rollout_gpus(args) -> int:
    """Of an async run's --gpus-per-run GPUs, the ones that generate (--rollout-gpus, default half)."""
    return args.rollout_gpus or args.gpus_per_run // 2


def jobs_for(args, num_gpus: int) -> list[Job]:
    results, python = Path(args.results), sys.executable
    jobs = []
    stage_env = {"RESULTS": str(results), "DRAFT_STEPS": str(args.draft_steps)}
    if not POLICY.is_dir():
        width = 1 << (num_gpus.bit_length() - 1)  # divides the 16 rows of a pretraining step
        base_args = os.environ.get("PRETRAIN_ARGS", "")
        # Should the mesh run fail, the same pretraining on one GPU (from scratch: a failed run may
        # have left checkpoints that the stage would refuse to overwrite).
        stage = "bash benchmarks/small_workload.sh pretrain"
        one_gpu = f"PRETRAIN_ARGS={shlex.quote(base_args)} {stage}"
        mesh = f"PRETRAIN_ARGS={shlex.quote(f'{base_args} mesh.data={width}')} {stage}"
        script = one_gpu if width == 1 else f"{mesh} || {{ rm -rf runs/small; {one_gpu}; }}"
        jobs.append(
            Job("pretrain", None, ["bash", "-c", script], width, stage_env, results / f"{args.prefix}_pretrain.log")
        )
    draft = Job(
        "draft",
        POLICY,
        ["bash", "benchmarks/small_workload.sh", "draft"],
        1,
        stage_env,
        results / f"{args.prefix}_draft.log",
    )
    common = [
        f"train.steps={args.steps}",
        f"eval.every={args.eval_every}",
        "train.progress=false",
        f"train.checkpoint_every={args.checkpoint_every}",
        *shlex.split(args.grpo_args),
    ]
    runs = dict(MAIN_RUNS)
    width = args.gpus_per_run
    colocated = [f"mesh.data={width}"] if width > 1 else []
    layout = dict.fromkeys(runs, colocated)
    if args.async_runs:
        rollout = rollout_gpus(args)
        runs.update(ASYNC_RUNS)
        layout.update(
            {
                name: ["rollout.mode=async", f"mesh.rollout_devices={rollout}", f"mesh.data={width - rollout}"]
                for name in ASYNC_RUNS
            }
        )
    for extra in args.extra:
        name, sep, overrides = extra.partition("=")
        if not sep or not name.isidentifier() or name in runs:
            raise SystemExit(f"--extra must be NAME='key=value ...' with a new NAME, got {extra!r}")
        runs[name] = overrides
        layout[name] = colocated
    if args.only:
        unknown = sorted(set(args.only) - set(runs))
        if unknown:
            raise SystemExit(f"--only {' '.join(unknown)}: no such run (planned: {' '.join(runs)})")
        runs = {name: overrides for name, overrides in runs.items() if name in args.only}
    if not HEAD.is_dir() and any("spec.method=none" not in overrides for overrides in runs.values()):
        jobs.append(draft)
    for name, overrides in runs.items():
        run_dir = Path("runs") / f"grpo-{name}"
        needs = POLICY if "spec.method=none" in overrides else HEAD
        argv = [
            python,
            "-m",
            "jaxspec.cli",
            "train",
            "--config",
            "configs/grpo_small.yaml",
            "--run-dir",
            str(run_dir),
            *common,
            *layout[name],
            *shlex.split(overrides),
        ]
        jobs.append(
            Job(
                name,
                needs,
                argv,
                width,
                {},
                results / f"{args.prefix}_{name}.log",
                run_dir / "metrics.jsonl",
                results / f"{args.prefix}_{name}.jsonl",
            )
        )
    return jobs


def mirror(job: Job) -> None:
    if job.metrics is not None and job.metrics.is_file():
        shutil.copyfile(job.metrics, job.copy)


def stamp() -> str:
    return time.strftime("%H:%M:%S", time.gmtime())


def run_all(jobs: list[Job], gpus: list[str], poll_s: float) -> int:
    """Runs every job; returns the number that failed. A job whose input never appears is skipped."""
    pending, running, failed = list(jobs), [], 0
    while pending or running:
        for job in list(running):
            mirror(job)
            if job.process.poll() is None:
                continue
            running.remove(job)
            rc = job.process.returncode
            failed += rc != 0
            print(
                f"{stamp()} {job.name} on GPU {job.gpus}: rc={rc} after {time.time() - job.started:.0f} s", flush=True
            )
        busy = {g for job in running for g in job.gpus.split(",")}
        for job in list(pending):
            free = [g for g in gpus if g not in busy]
            if len(free) < job.width:
                break
            if job.needs is not None and not job.needs.exists():
                if not running:  # nothing left that could make it
                    print(f"{stamp()} {job.name}: skipped, {job.needs} does not exist", flush=True)
                    pending.remove(job)
                    failed += 1
                continue
            job.gpus, job.started = ",".join(free[: job.width]), time.time()
            env = {**os.environ, **job.env, "CUDA_VISIBLE_DEVICES": job.gpus}
            job.log.parent.mkdir(parents=True, exist_ok=True)
            with job.log.open("w", encoding="utf-8") as log:
                job.process = subprocess.Popen(job.argv, env=env, stdout=log, stderr=subprocess.STDOUT)
            print(f"{stamp()} {job.name} on GPU {job.gpus}: {shlex.join(job.argv)}", flush=True)
            pending.remove(job)
            running.append(job)
            busy.update(free[: job.width])
        time.sleep(poll_s)
    return failed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--draft-steps", type=int, default=1000)
    p.add_argument("--gpus", default=None, help="comma-separated GPU ids (default: every GPU nvidia-smi lists)")
    p.add_argument("--extra", action="append", default=[], help="NAME='key=value ...': another GRPO run")
    p.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="NAME",
        help="run only these GRPO runs (of the planned ones, --extra included), and the stages they need",
    )
    p.add_argument(
        "--grpo-args", default="", metavar="'KEY=VALUE ...'", help="overrides for every GRPO run, before its own"
    )
    p.add_argument("--gpus-per-run", type=int, default=1, help="GPUs of every GRPO run (colocated: mesh.data)")
    p.add_argument("--async-runs", action="store_true", help="also the async_* runs on the same GPUs")
    p.add_argument(
        "--rollout-gpus", type=int, default=0, help="of an async run's GPUs, the ones that generate (default: half)"
    )
    p.add_argument("--results", default="benchmarks/results")
    p.add_argument("--prefix", default="grpo_curves")
    p.add_argument("--poll", type=float, default=5.0, help="seconds between checks")
    args = p.parse_args()
    for flag in ("steps", "draft_steps", "checkpoint_every", "gpus_per_run"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1")
    gpus = gpu_ids(args.gpus)
    if args.gpus_per_run > len(gpus):
        raise SystemExit(f"--gpus-per-run {args.gpus_per_run}: this host has {len(gpus)} GPUs ({','.join(gpus)})")
    if args.async_runs and not 0 < rollout_gpus(args) < args.gpus_per_run:
        raise SystemExit(
            f"--async-runs needs rollout GPUs between 1 and --gpus-per-run - 1 "
            f"(--gpus-per-run {args.gpus_per_run}, --rollout-gpus {args.rollout_gpus})"
        )
    jobs = jobs_for(args, len(gpus))
    print(f"{stamp()} {len(jobs)} jobs on GPUs {','.join(gpus)}", flush=True)
    failed = run_all(jobs, gpus, args.poll)
    results = Path(args.results)
    names = [*MAIN_RUNS, *(ASYNC_RUNS if args.async_runs else ())]
    runs = [f"{name}=runs/grpo-{name}" for name in names if (Path("runs") / f"grpo-{name}" / "metrics.jsonl").is_file()]
    if len(runs) > 1:
        with (results / f"{args.prefix}.log").open("w", encoding="utf-8") as log:
            compare = subprocess.run(
                [
                    sys.executable,
                    "benchmarks/grpo_compare.py",
                    "--out",
                    str(results / f"{args.prefix}.json"),
                    "--plot",
                    str(results / f"{args.prefix}.png"),
                    *runs,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            log.write(compare.stdout)
        print(compare.stdout, end="")
        failed += compare.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
