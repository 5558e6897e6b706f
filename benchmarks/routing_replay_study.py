"""Routing replay (R3) on a mixture-of-experts policy in bf16: the rollout/trainer log-prob mismatch
and expert disagreement with and without replay, measured side by side.

    python3 benchmarks/routing_replay_study.py --pretrain-steps 300 --steps 10 --results benchmarks/results/<campaign> \
        --prefix routing_replay

Pretrains `configs/pretrain_small_moe.yaml` on every GPU (skipped when runs/small-moe/policy exists), then
runs two GRPO runs of `configs/grpo_small.yaml` on that policy at once, each on half of the GPUs
(mesh.data; on a machine of one GPU both share it, each with a fixed share of its memory, so their
step times are those of two runs on one card), with AR rollouts in bf16 and recomputed log-probs in the trainer's bf16:
`loss.routing_replay` true and false. Each step of each run logs logprob_mismatch_mean / _max,
expert_disagreement (response token x sparse layer pairs whose top-k set differs between the
rollout and the trainer's own router) and expert_disagreement_tokens; this prints their medians
over the steps and writes RESULTS/PREFIX.json, each run's metrics (RESULTS/PREFIX_<run>.jsonl) and
logs. Each run's metrics are copied as they grow, and a SIGTERM (a job's time limit) reaches both
runs, which checkpoint and stop: the summary then covers the steps they finished (exit status 75).
Without replay the disagreement is what the trainer's forward routes differently; with replay
the trainer runs the rollout's experts, so the mismatch left is that of the numerics alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from jaxspec.exits import EXIT_CHECKPOINTED

POLICY = Path("runs/small-moe/policy")
SHARED_MEMORY_FRACTION = 0.45  # of one GPU's memory, per run, when both runs share it
RUNS = {"replay": "loss.routing_replay=true", "no_replay": "loss.routing_replay=false"}
KEYS = (
    "logprob_mismatch_mean",
    "logprob_mismatch_max",
    "expert_disagreement",
    "expert_disagreement_tokens",
    "behaviour_weight_mean",
    "reward_mean",
    "time_step_s",
)


def gpu_ids() -> list[str]:
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    return [str(i) for i, line in enumerate(listing.splitlines()) if line.startswith("GPU ")]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "jaxspec.cli", *args]


def summary(metrics: Path) -> dict:
    """Medians over a run's steps of KEYS (steps 1.. of metrics.jsonl; the step-0 validation skipped)."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if r.get("step", 0) > 0]
    return {
        key: float(np.median([r[key] for r in steps if key in r])) for key in KEYS if any(key in r for r in steps)
    } | {"steps": len(steps)}


def wait_mirroring(procs: dict[str, subprocess.Popen], metrics: dict[str, tuple[Path, Path]], poll_s: float = 5.0):
    """Waits for the runs `procs`, copying each one's metrics file (metrics[name]: (source, copy)) as
    it grows; a SIGTERM to this process is passed on to the runs still going (they checkpoint and
    stop), and the waiting goes on. Returns each run's exit status."""

    def stop(signum, frame) -> None:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        while True:
            done = all(proc.poll() is not None for proc in procs.values())
            for source, copy in metrics.values():
                if source.is_file():
                    shutil.copyfile(source, copy)
            if done:
                return {name: proc.returncode for name, proc in procs.items()}
            time.sleep(poll_s)
    finally:
        signal.signal(signal.SIGTERM, previous)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pretrain-steps", type=int, default=300)
    p.add_argument("--steps", type=int, default=10, help="GRPO steps of each run")
    p.add_argument("--results", default="benchmarks/results")
    p.add_argument("--prefix", default="routing_replay")
    args = p.parse_args()
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    gpus = gpu_ids()
    if len(gpus) > 1 and len(gpus) % 2:
        raise SystemExit(f"needs one GPU or an even number of them (two runs at once), found {len(gpus)}")
    if not POLICY.is_dir():
        with (results / f"{args.prefix}_pretrain.log").open("w") as log:
            subprocess.run(
                cli(
                    "pretrain",
                    "--config",
                    "configs/pretrain_small_moe.yaml",
                    "--run-dir",
                    "runs/small-moe",
                    f"train.steps={args.pretrain_steps}",
                    f"train.checkpoint_every={args.pretrain_steps}",
                    "train.progress=false",
                    "data.num_eval=64",
                    f"mesh.data={len(gpus)}",
                ),
                stdout=log,
                stderr=subprocess.STDOUT,
                check=True,
            )
    shared = len(gpus) == 1
    half = max(1, len(gpus) // 2)
    procs, metrics = {}, {}
    for i, (name, override) in enumerate(RUNS.items()):
        run_dir = Path("runs") / f"grpo-moe-{name}"
        shutil.rmtree(run_dir, ignore_errors=True)
        argv = cli(
            "train",
            "--config",
            "configs/grpo_small.yaml",
            "--run-dir",
            str(run_dir),
            f"policy.path={POLICY}",
            "spec.method=none",
            "draft.online=false",
            "eval.every=0",
            f"train.steps={args.steps}",
            "train.progress=false",
            "rollout.dtype=bfloat16",
            "train.compute_dtype=bfloat16",
            "loss.recompute_logprobs=true",
            f"mesh.data={half}",
            override,
        )
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(gpus if shared else gpus[i * half : (i + 1) * half])}
        if shared:
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(SHARED_MEMORY_FRACTION)
        log = (results / f"{args.prefix}_{name}.log").open("w")
        procs[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        metrics[name] = (run_dir / "metrics.jsonl", results / f"{args.prefix}_{name}.jsonl")
    statuses = wait_mirroring(procs, metrics)
    out = {name: summary(copy) for name, (_, copy) in metrics.items() if copy.is_file()}
    (results / f"{args.prefix}.json").write_text(json.dumps(out, indent=1))
    print(f"| run | {' | '.join(KEYS)} | steps |")
    print(f"|---|{'---|' * (len(KEYS) + 1)}")
    for name, row in out.items():
        print(f"| {name} | {' | '.join(f'{row[k]:.4g}' if k in row else '-' for k in KEYS)} | {row['steps']} |")
    if any(rc not in (0, EXIT_CHECKPOINTED) for rc in statuses.values()):
        return 1
    return EXIT_CHECKPOINTED if any(rc == EXIT_CHECKPOINTED for rc in statuses.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
