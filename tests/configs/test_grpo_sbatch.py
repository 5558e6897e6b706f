"""configs/slurm/grpo.sbatch with stand-in `srun` and `scontrol` on PATH: a run that checkpointed
before its end (exit status EXIT_CHECKPOINTED) requeues the job; a finished or failed run does not."""

import os
import subprocess
from pathlib import Path

import pytest

from jaxspec.run import EXIT_CHECKPOINTED

SCRIPT = Path(__file__).resolve().parents[2] / "configs" / "slurm" / "grpo.sbatch"


@pytest.fixture
def slurm(tmp_path):
    """Runs the script as SLURM would start job 4242 on 2 nodes of 4 GPUs; `srun` records its
    arguments and exits with the next of `statuses`, `scontrol` records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = {"srun": tmp_path / "srun.calls", "scontrol": tmp_path / "scontrol.calls"}
    (bin_dir / "srun").write_text(f"""#!/bin/bash
echo "$*" >> {calls['srun']}
n=$(wc -l < {calls['srun']})
statuses=($SRUN_STATUSES)
exit "${{statuses[$((n - 1))]}}"
""")
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$*" >> {calls["scontrol"]}\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)

    def start(statuses, restart_count=0):
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
               "SLURM_JOB_NUM_NODES": "2", "GPUS_PER_NODE": "4", "SLURM_RESTART_COUNT": str(restart_count),
               "SRUN_STATUSES": " ".join(map(str, statuses))}
        proc = subprocess.run(["bash", str(SCRIPT), "configs/grpo_small.yaml", str(tmp_path / "run"),
                               "train.steps=500"], env=env, capture_output=True, text=True, timeout=60)
        recorded = {name: path.read_text().splitlines() if path.exists() else [] for name, path in calls.items()}
        return proc, recorded

    return start


def test_a_checkpointed_run_requeues_and_the_finished_one_does_not(slurm, tmp_path):
    first, calls = slurm([EXIT_CHECKPOINTED, 0])
    assert first.returncode == 0, first.stderr
    assert calls["scontrol"] == ["requeue 4242"]
    assert "checkpointed before the end; requeueing" in first.stdout
    # Both starts resume the same run directory on 2 nodes x 4 GPUs = an 8-way fsdp mesh.
    want = (f"--kill-on-bad-exit=0 jaxspec train --config configs/grpo_small.yaml --run-dir {tmp_path / 'run'} "
            f"--resume mesh.data=1 mesh.fsdp=8 mesh.tensor=1 train.steps=500")
    assert calls["srun"] == [want]
    second, calls = slurm([EXIT_CHECKPOINTED, 0], restart_count=1)
    assert second.returncode == 0, second.stderr
    assert calls["srun"] == [want, want] and calls["scontrol"] == ["requeue 4242"]  # not requeued again
    assert "job 4242 start 1: 2 nodes x 4 GPUs" in second.stdout


def test_a_failed_run_ends_the_job_with_its_status(slurm):
    proc, calls = slurm([1])
    assert proc.returncode == 1 and calls["scontrol"] == []
    assert "jaxspec train exited 1" in proc.stdout


def test_the_log_is_appended_across_requeues():
    header = [line for line in SCRIPT.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --open-mode=append" in header and "#SBATCH --requeue" in header
    assert any(line.startswith("#SBATCH --signal=TERM@") for line in header)
