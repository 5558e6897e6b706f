"""configs/slurm/grpo.sbatch with stand-in `srun`, `scontrol` and `squeue` on PATH and SLURM's
variables simulated for 2 nodes of 4 or 8 GPUs: a run that checkpointed before its end (exit status
EXIT_CHECKPOINTED) requeues the job, a finished or failed run does not; srun gets the CPUs per task
and jaxspec the job's end; and the tasks srun starts (one per node, as real processes on CPU
devices standing for each node's GPUs) each take every device of their node, in one mesh."""

import json
import os
import socket
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from jaxspec.run import EXIT_CHECKPOINTED

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "configs" / "slurm" / "grpo.sbatch"
END = "2031-05-01T16:00:00"  # what the stand-in squeue reports as the job's end (local time)

# srun that starts one task per node, with the variables SLURM gives a step's tasks; the command's
# exit status is the highest of its tasks'. Each node's GPUs are simulated as CPU devices.
TASKS_SRUN = """#!/usr/bin/env python3
import os, subprocess, sys
args = sys.argv[1:]
while args[0].startswith("--"):
    args = args[1:]
nodes, gpus = int(os.environ["SLURM_JOB_NUM_NODES"]), os.environ["SLURM_GPUS_ON_NODE"]
procs = []
for node in range(nodes):
    env = {**os.environ, "SLURM_NTASKS": str(nodes), "SLURM_PROCID": str(node), "SLURM_LOCALID": "0",
           "SLURM_NODEID": str(node), "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": str(nodes),
           "SLURM_STEP_NODELIST": "localhost", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={gpus}"}
    procs.append(subprocess.Popen(args, env=env))
sys.exit(max(p.wait() for p in procs))
"""
# `jaxspec` standing in for `jaxspec train`: joins the job as it does, builds the mesh the script's
# overrides ask for, and reports what this process sees.
PROBE_JAXSPEC = """#!/usr/bin/env python3
import json, os, sys
sys.path.insert(0, {repo!r})
from jaxspec.distributed import initialize_from_env
initialize_from_env()
import jax
from jaxspec.run.placement import MeshConfig, Placement
mesh = dict(a.split("=") for a in sys.argv if a.startswith("mesh."))
placement = Placement(MeshConfig(**{{k[5:]: int(v) for k, v in mesh.items()}}))
devices = placement.sharding.mesh.devices.reshape(-1)
with open(os.path.join({out!r}, f"process{{jax.process_index()}}.json"), "w") as f:
    json.dump({{"local": jax.local_device_count(), "global": jax.device_count(),
               "visible": jax.config.read("jax_cuda_visible_devices"), "mesh": len(devices),
               "mesh_processes": sorted({{d.process_index for d in devices}})}}, f)
"""


def _stub(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def _slurm_env(bin_dir: Path, gpus: int, job_id: int = 4242, restart_count: int = 0) -> dict:
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_GPUS_ON_NODE": str(gpus),
        "SLURM_CPUS_PER_TASK": "32",
        "SLURM_RESTART_COUNT": str(restart_count),
    }


@pytest.fixture
def slurm(tmp_path):
    """Runs the script as SLURM would start job 4242 on 2 nodes of 4 GPUs; `srun` records its
    arguments and JAXSPEC_STOP_BY and exits with the next of `statuses`, `scontrol` records its
    arguments, `squeue` reports the job's end."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = {"srun": tmp_path / "srun.calls", "scontrol": tmp_path / "scontrol.calls"}
    _stub(
        bin_dir / "srun",
        f"""#!/bin/bash
echo "$* | stop by ${{JAXSPEC_STOP_BY:-unset}}" >> {calls["srun"]}
n=$(wc -l < {calls["srun"]})
statuses=($SRUN_STATUSES)
exit "${{statuses[$((n - 1))]}}"
""",
    )
    _stub(bin_dir / "scontrol", f'#!/bin/bash\necho "$*" >> {calls["scontrol"]}\n')
    _stub(bin_dir / "squeue", f'#!/bin/bash\n[ "$*" = "-h -j 4242 -o %e" ] && echo "${{SQUEUE_END:-{END}}}"\n')

    def start(statuses, restart_count=0, gpus=4, end=END):
        env = {
            **_slurm_env(bin_dir, gpus, restart_count=restart_count),
            "SRUN_STATUSES": " ".join(map(str, statuses)),
            "SQUEUE_END": end,
        }
        proc = subprocess.run(
            ["bash", str(SCRIPT), "configs/grpo_small.yaml", str(tmp_path / "run"), "train.steps=500"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        recorded = {name: path.read_text().splitlines() if path.exists() else [] for name, path in calls.items()}
        for path in calls.values():
            path.unlink(missing_ok=True)
        return proc, recorded

    return start


def _srun_line(run_dir, devices: int, stop_by: str) -> str:
    return (
        f"--kill-on-bad-exit=0 --cpus-per-task=32 jaxspec train --config configs/grpo_small.yaml --run-dir "
        f"{run_dir} --resume mesh.data=1 mesh.fsdp={devices} mesh.tensor=1 train.steps=500 | stop by {stop_by}"
    )


def test_a_checkpointed_run_requeues_and_the_finished_one_does_not(slurm, tmp_path):
    stop_by = str(int(datetime.fromisoformat(END).timestamp()) - 60)  # the job's end less the requeue margin
    first, calls = slurm([EXIT_CHECKPOINTED])
    assert first.returncode == 0, first.stderr
    assert calls["scontrol"] == ["requeue 4242"]
    assert "checkpointed before the end; requeueing" in first.stdout
    # 2 nodes x 4 GPUs: an 8-way fsdp mesh, the CPUs per task passed on, the job's end passed to jaxspec
    assert calls["srun"] == [_srun_line(tmp_path / "run", 8, stop_by)]
    second, calls = slurm([0], restart_count=1)
    assert second.returncode == 0, second.stderr
    assert calls["srun"] == [_srun_line(tmp_path / "run", 8, stop_by)] and calls["scontrol"] == []
    assert "job 4242 start 1: 2 nodes x 4 GPUs" in second.stdout


def test_the_mesh_follows_the_gpus_slurm_gives_and_a_job_without_an_end_stops_on_sigterm(slurm, tmp_path):
    proc, calls = slurm([0], gpus=8, end="UNLIMITED")
    assert proc.returncode == 0, proc.stderr
    assert calls["srun"] == [_srun_line(tmp_path / "run", 16, "unset")]
    assert "no end time from squeue (UNLIMITED); stopping on SIGTERM alone" in proc.stdout


def test_a_failed_run_ends_the_job_with_its_status(slurm):
    proc, calls = slurm([1])
    assert proc.returncode == 1 and calls["scontrol"] == []
    assert "jaxspec train exited 1" in proc.stdout


def test_the_log_is_appended_across_requeues():
    header = [line for line in SCRIPT.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --open-mode=append" in header and "#SBATCH --requeue" in header
    assert any(line.startswith("#SBATCH --signal=TERM@") for line in header)


def _job_id_with_free_port() -> int:
    """A job id whose coordinator port (JAX: 61440 + id % 4096 under SLURM) is free here."""
    for job_id in range(4096, 8192, 37):
        with socket.socket() as s:
            try:
                s.bind(("localhost", 61440 + job_id % 4096))
            except OSError:
                continue
            return job_id
    raise RuntimeError("no free port in JAX's SLURM port range")


@pytest.mark.parametrize("gpus", [4, 8])
def test_every_task_takes_every_gpu_of_its_node_and_the_mesh_spans_them_all(tmp_path, gpus):
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    out.mkdir()
    _stub(bin_dir / "srun", TASKS_SRUN.replace("/usr/bin/env python3", sys.executable))
    _stub(
        bin_dir / "jaxspec",
        PROBE_JAXSPEC.replace("/usr/bin/env python3", sys.executable).format(repo=str(REPO), out=str(out)),
    )
    _stub(bin_dir / "squeue", "#!/bin/bash\n")
    job_id = _job_id_with_free_port()
    env = {**_slurm_env(bin_dir, gpus, job_id=job_id), "JAXSPEC_PEER_TIMEOUT_S": "60"}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "configs/grpo_small.yaml", str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = [json.loads((out / f"process{i}.json").read_text()) for i in range(2)]
    every = ",".join(map(str, range(gpus)))  # the CUDA device ids each process keeps: all of its node's
    assert (
        reports
        == [{"local": gpus, "global": 2 * gpus, "visible": every, "mesh": 2 * gpus, "mesh_processes": [0, 1]}] * 2
    )
