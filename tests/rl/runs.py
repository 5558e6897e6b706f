"""`jaxspec train` runs shared by the RL tests: a small GRPO config on the tiny policy
(tests/rl/conftest.py), the command, and its metrics file."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from jaxspec.cli import main as jaxspec_main
from jaxspec.rl.metrics import is_machine_dependent

CONFIG = """
policy: {{path: {policy}}}
data: {{num_train: 40, num_eval: 8, kinds: [arithmetic]}}
reward: {reward}
rollout: {{prompts_per_step: 4, samples_per_prompt: 8, max_new_tokens: 8}}
loss: {{minibatches: 2, ppo_epochs: 2, kl_beta: 0.001, recompute_logprobs: true, filter_groups: true}}
optim: {{learning_rate: 2.0e-2}}
spec: {{method: eagle3, draft: random, num_draft_tokens: 2}}
draft: {{online: true, ttt_steps: 1, learning_rate: 1.0e-2}}
eval: {{every: {eval_every}, batch_size: 8}}
train: {{steps: {steps}, checkpoint_every: {checkpoint_every}, progress: false}}
"""


REPO = str(Path(__file__).resolve().parents[2])
# Autoregressive rollouts and a plain loss keep a run's compilations short.
LIGHT = ["spec.method=none", "draft.online=false", "loss.recompute_logprobs=false"]


# `jaxspec` in a subprocess, with the test rewards (tests/rl/conftest.py) registered.
RUN_WITH_TEST_REWARDS = "import sys, tests.rl.conftest; from jaxspec.cli import main; sys.exit(main(sys.argv[1:]))"


def write_config(path, policy, reward="digit_fraction", steps=12, eval_every=6, checkpoint_every=6):
    path.write_text(
        CONFIG.format(
            policy=policy, reward=reward, steps=steps, eval_every=eval_every, checkpoint_every=checkpoint_every
        )
    )
    return str(path)


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_machine_keys(records):
    return [{k: v for k, v in r.items() if not is_machine_dependent(k)} for r in records]


def train_cli(*args) -> int:
    return jaxspec_main(["train", *map(str, args)])


def run_two_processes(args: list, logs: list, devices: int) -> list[str]:
    """`jaxspec train *args` as a job of two processes of `devices` CPU devices each (as two SLURM
    tasks would run it), each writing its output to its entry of `logs`; returns the outputs once
    both exit 0. A process still running after 8 minutes is stopped with its Python stacks shown."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs = []
    for pid in range(2):
        # PYTHONFAULTHANDLER: a process stopped with SIGABRT prints every thread's Python stack.
        env = {
            **os.environ,
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
            "JAX_PLATFORMS": "cpu",
            "JAX_COORDINATOR_ADDRESS": f"localhost:{port}",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(pid),
            "PYTHONFAULTHANDLER": "1",
        }
        with open(logs[pid], "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", RUN_WITH_TEST_REWARDS, "train", *map(str, args)],
                    env=env,
                    cwd=REPO,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline = time.time() + 480
    while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(1)
    hung = [p for p in procs if p.poll() is None]
    for p in hung:  # report where each process waits instead of hanging the suite
        p.send_signal(signal.SIGABRT)
    for p in procs:
        p.wait(timeout=60)
    outputs = [log.read_text() for log in logs]
    assert not hung and [p.returncode for p in procs] == [0, 0], "\n\n".join(outputs)
    return outputs
