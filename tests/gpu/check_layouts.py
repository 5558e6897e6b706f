"""GPU check of the mesh layouts: a few GRPO steps on every (data, fsdp, tensor) layout of the GPUs.

    pytest -m gpu tests/gpu/test_layouts.py      # the check on configs/grpo_tiny.yaml, as a test
    python3 -m tests.gpu.check_layouts --config configs/grpo_small.yaml [--policy DIR]
        [--make-policy DIR] [--steps 2] [--layouts D,F,T ...] [--out FILE.json] [key=value ...]

Runs `jaxspec train` (a child process per layout, each from a fresh run directory and the same
seed) on one GPU and on every layout whose axes multiply to the GPU count (2 GPUs: data=2,
fsdp=2, tensor=2; 4 GPUs adds the products, ...), and compares the first step's metrics with the
one-GPU run's: reward, rollout / trainer log-prob mismatch, response length, acceptance length,
policy loss, entropy and the online draft loss. The rollouts sample at the config's temperature
from the same key, so they are the same token for token unless a bf16 rounding difference of the
layouts moves a sample (the reductions split over devices sum in another order); a layout passes
when it runs and its first-step metrics are within `REL_TOL` (relative) of the one-GPU run's
(`ABS_TOL` for values near 0).

--make-policy DIR writes a policy in the shape of configs/models/small-policy.json with random
weights and the embedded tokenizer (its vocabulary) to DIR first, for machines that hold no
trained `small` policy; --policy (default: the config's) then defaults to it, and the online head
starts from random weights (`spec.draft=random`) unless an override names one. With random weights
every reward is 0, so the policy loss is 0 on every layout and the draft loss and the log-prob
mismatch carry the comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REL_TOL = 0.03  # bf16 rollouts and forwards: summation order differs between layouts
ABS_TOL = 2e-3
COMPARED = (
    "reward_mean",
    "logprob_mismatch_mean",
    "response_length_mean",
    "acceptance_length",
    "loss",
    "entropy",
    "draft_loss",
)


def layouts(devices: int) -> list[dict]:
    """One GPU, then every (data, fsdp, tensor) with product `devices`, fewest axes first."""
    out = [{"data": 1, "fsdp": 1, "tensor": 1}]
    for data, fsdp in itertools.product(range(1, devices + 1), repeat=2):
        if devices % (data * fsdp) == 0 and devices > 1:
            out.append({"data": data, "fsdp": fsdp, "tensor": devices // (data * fsdp)})
    return out[:1] + sorted(out[1:], key=lambda m: sum(v > 1 for v in m.values()))


def make_policy(path: Path) -> None:
    """A random policy in the `small` shape with the embedded tokenizer's vocabulary."""
    import jax

    from jaxspec.assets import tiny_policy_path
    from jaxspec.models import ModelConfig, init_params, save_hf

    tiny = ModelConfig.from_json(tiny_policy_path() / "config.json")
    small = ModelConfig.from_json(Path(__file__).resolve().parents[2] / "configs/models/small-policy.json")
    cfg = dataclasses.replace(small, vocab_size=tiny.vocab_size)
    save_hf(cfg, init_params(cfg, jax.random.key(0)), path, tokenizer_file=tiny_policy_path() / "tokenizer.json")


def parse_layout(text: str) -> dict:
    """`data,fsdp,tensor` (e.g. 1,1,2) as a mesh dict."""
    try:
        data, fsdp, tensor = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected data,fsdp,tensor, e.g. 1,1,2") from None
    return {"data": data, "fsdp": fsdp, "tensor": tensor}


def device_count() -> int:
    """The accelerators a child process sees (this process stays on the CPU, so that it holds no
    GPU memory while the runs train)."""
    out = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.device_count())"],
        env=CHILD_ENV,
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout
    return int(out.split()[-1])


def run_layout(mesh: dict, args, overrides: list[str], work: Path) -> dict:
    name = "x".join(f"{k}{v}" for k, v in mesh.items() if v > 1) or "1gpu"
    run_dir = work / name
    cmd = [
        sys.executable,
        "-m",
        "jaxspec.cli",
        "train",
        "--config",
        args.config,
        "--run-dir",
        str(run_dir),
        f"train.steps={args.steps}",
        "eval.every=0",
        f"train.checkpoint_every={args.steps}",
        *(f"mesh.{k}={v}" for k, v in mesh.items()),
        *overrides,
    ]
    if args.policy:
        cmd.append(f"policy.path={args.policy}")
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=CHILD_ENV)
    row = {"layout": name, "mesh": mesh, "rc": proc.returncode, "wall_s": time.perf_counter() - start}
    if proc.returncode != 0:
        row["error_tail"] = proc.stdout[-3000:]
        return row
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward_mean" in r]
    row["first"] = {k: steps[0].get(k) for k in COMPARED if k in steps[0]}
    row["step_s"] = [r.get("time_step_s") for r in steps]
    return row


def compare(base: dict, row: dict) -> tuple[bool, float]:
    worst, ok = 0.0, True
    for key, ref in base["first"].items():
        got = row["first"].get(key)
        if ref is None or got is None:
            continue
        diff = abs(got - ref)
        rel = diff / abs(ref) if abs(ref) > 0 else 0.0
        worst = max(worst, rel if diff > ABS_TOL else 0.0)
        ok &= diff <= ABS_TOL or rel <= REL_TOL
    return ok, worst


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/grpo_small.yaml")
    p.add_argument("--policy", default=None, help="policy HF folder (default: the config's policy.path)")
    p.add_argument("--make-policy", default=None, help="write a random small-shaped policy here first")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--devices", type=int, default=None, help="GPUs to use (default: all)")
    p.add_argument(
        "--layouts",
        nargs="+",
        type=parse_layout,
        default=None,
        metavar="D,F,T",
        help="only these layouts, in this order; the others compare with the first when it is 1,1,1 "
        "(default: 1,1,1 then every layout of the devices)",
    )
    p.add_argument("--out", default=None)
    p.add_argument("overrides", nargs="*", help="config overrides for every run (key=value)")
    args = p.parse_args(argv)
    devices = args.devices or device_count()
    if args.make_policy:
        make_policy(Path(args.make_policy))
        args.policy = args.policy or args.make_policy
        if not any(o.startswith("spec.draft=") for o in args.overrides):
            args.overrides.append("spec.draft=random")  # a fresh head in the public layout for it
    rows = []
    work = Path(tempfile.mkdtemp(prefix="jaxspec-layouts-"))
    try:
        for mesh in layouts(devices) if args.layouts is None else args.layouts:
            row = run_layout(mesh, args, args.overrides, work)
            if rows and rows[0]["layout"] == "1gpu" and rows[0]["rc"] == 0 and row["rc"] == 0:
                row["ok"], row["worst_rel_diff"] = compare(rows[0], row)
            else:
                row["ok"] = row["rc"] == 0
            rows.append(row)
            first = row.get("first", {})
            print(
                f"{row['layout']:18s} rc {row['rc']} {row['wall_s']:6.1f} s  "
                + "  ".join(f"{k} {v:.4g}" for k, v in first.items())
                + (f"  worst rel diff {row.get('worst_rel_diff', 0):.4f}" if "worst_rel_diff" in row else "")
                + ("  OK" if row["ok"] else "  FAILED"),
                flush=True,
            )
            if row["rc"]:
                print(row["error_tail"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "device": gpu_name(),
                    "devices": devices,
                    "config": args.config,
                    "overrides": args.overrides,
                    "rel_tol": REL_TOL,
                    "abs_tol": ABS_TOL,
                    "rows": rows,
                },
                indent=1,
            )
        )
    bad = [r["layout"] for r in rows if not r["ok"]]
    print(
        f"check_layouts: {len(rows) - len(bad)} of {len(rows)} layouts agree with one GPU"
        + (f"; FAILED: {', '.join(bad)}" if bad else "")
    )
    return 1 if bad else 0


def gpu_name() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], stdout=subprocess.PIPE, text=True
        ).stdout.splitlines()[0]
    except (OSError, IndexError):
        return "unknown"


CHILD_ENV = dict(os.environ, PYTHONUNBUFFERED="1")  # the runs see the machine's devices

if __name__ == "__main__":
    os.environ["JAX_PLATFORMS"] = "cpu"  # this process only writes the policy and compares
    sys.exit(main(sys.argv[1:]))
