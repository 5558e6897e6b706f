"""GPU check of multi-process training: N processes x 1 GPU against 1 process x N GPUs.

    pytest -m gpu tests/gpu/test_processes.py    # the check, as a test
    python3 -m tests.gpu.check_processes [--config configs/grpo_tiny.yaml] [--steps 4]
        [--out FILE.json] [key=value ...]

Runs `jaxspec train` with the mesh fsdp=N once as one process that sees the N GPUs and once as N
processes of one GPU each (CUDA_VISIBLE_DEVICES, and JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES
/ JAX_PROCESS_ID as a launcher on several hosts would set them), from the same seed, and compares
every step's metrics (`check_layouts.REL_TOL`). Then the N-process run resumes from its last
checkpoint as one process for two more steps (another process count, the same mesh), and the
policy folder written by the N processes is loaded back and compared with the one-process run's
(`save_hf` of a policy sharded across processes writes one HF folder).
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tests.gpu.check_layouts import ABS_TOL, CHILD_ENV, COMPARED, REL_TOL, device_count, gpu_name


def train_cmd(args, run_dir: Path, steps: int, overrides: list[str], resume: bool = False) -> list[str]:
    return [
        sys.executable,
        "-m",
        "jaxspec.cli",
        "train",
        "--config",
        args.config,
        "--run-dir",
        str(run_dir),
        f"train.steps={steps}",
        f"train.checkpoint_every={args.steps}",
        "eval.every=0",
        "mesh.data=1",
        f"mesh.fsdp={args.devices}",
        "mesh.tensor=1",
        *overrides,
    ] + (["--resume"] if resume else [])


def run_processes(args, run_dir: Path, processes: int, steps: int, resume: bool = False) -> tuple[int, float, str]:
    """(worst return code, wall seconds, output tail) of `processes` processes over the GPUs."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    gpus_each = args.devices // processes
    procs, start = [], time.perf_counter()
    for pid in range(processes):
        env = dict(
            CHILD_ENV,
            CUDA_VISIBLE_DEVICES=",".join(str(pid * gpus_each + g) for g in range(gpus_each)),
            XLA_FLAGS=f"--xla_force_host_platform_device_count={gpus_each}",
        )  # (a CPU run's devices)
        if processes > 1:
            env.update(
                JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=str(processes), JAX_PROCESS_ID=str(pid)
            )
        procs.append(
            subprocess.Popen(
                train_cmd(args, run_dir, steps, args.overrides, resume),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate()[0] for p in procs]
    return max(abs(p.returncode) for p in procs), time.perf_counter() - start, outputs[0][-3000:]


def step_metrics(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in ("step", *COMPARED) if k in r} for r in records if "reward_mean" in r]


def agree(want: list[dict], got: list[dict]) -> tuple[bool, float]:
    worst, ok = 0.0, len(want) == len(got)
    for w, g in zip(want, got):
        for key, ref in w.items():
            diff = abs(g.get(key, np.nan) - ref)
            rel = diff / abs(ref) if ref else 0.0
            worst = max(worst, rel if diff > ABS_TOL else 0.0)
            ok &= bool(diff <= ABS_TOL or rel <= REL_TOL)
    return ok, worst


def policies_agree(a: Path, b: Path) -> float:
    """Largest relative difference between two HF policy folders' tensors."""
    from jaxspec.models import load_hf

    (_, pa), (_, pb) = load_hf(a, dtype="float32"), load_hf(b, dtype="float32")
    import jax

    diffs = jax.tree.map(
        lambda x, y: float(
            np.abs(np.asarray(x) - np.asarray(y)).max() / max(float(np.abs(np.asarray(x)).max()), 1e-12)
        ),
        pa,
        pb,
    )
    return max(jax.tree.leaves(diffs))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/grpo_tiny.yaml")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--devices", type=int, default=None, help="GPUs (default: all)")
    p.add_argument("--out", default=None)
    p.add_argument("overrides", nargs="*", help="config overrides for every run (key=value)")
    args = p.parse_args(argv)
    args.devices = args.devices or device_count()
    work = Path(tempfile.mkdtemp(prefix="jaxspec-processes-"))
    rows, ok = [], True
    try:
        for processes in (1, args.devices):
            rc, wall, tail = run_processes(args, work / f"p{processes}", processes, args.steps)
            rows.append({"run": f"{processes} process(es) x {args.devices // processes} GPU", "rc": rc, "wall_s": wall})
            if rc:
                print(tail)
        if all(r["rc"] == 0 for r in rows):
            one, many = step_metrics(work / "p1"), step_metrics(work / f"p{args.devices}")
            rows[1]["metrics_agree"], rows[1]["worst_rel_diff"] = agree(one, many)
            rows[1]["policy_rel_diff"] = policies_agree(work / "p1" / "policy", work / f"p{args.devices}" / "policy")
            shutil.rmtree(work / f"p{args.devices}" / "policy")
            rc, wall, tail = run_processes(args, work / f"p{args.devices}", 1, args.steps + 2, resume=True)
            resumed = step_metrics(work / f"p{args.devices}") if rc == 0 else []
            rows.append(
                {
                    "run": f"resume on 1 process, steps {args.steps + 1}-{args.steps + 2}",
                    "rc": rc,
                    "wall_s": wall,
                    "steps": [r["step"] for r in resumed],
                }
            )
            if rc:
                print(tail)
            ok = (
                rows[1]["metrics_agree"]
                and rows[1]["policy_rel_diff"] < REL_TOL
                and rc == 0
                and [r["step"] for r in resumed] == list(range(1, args.steps + 3))
            )
        else:
            ok = False
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for r in rows:
        print("  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "device": gpu_name(),
                    "devices": args.devices,
                    "config": args.config,
                    "overrides": args.overrides,
                    "rows": rows,
                },
                indent=1,
            )
        )
    print(f"check_processes: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    import os

    os.environ["JAX_PLATFORMS"] = "cpu"  # this process only compares
    sys.exit(main(sys.argv[1:]))
