"""benchmarks/routing_replay_study.py: its runs' metrics survive a time limit."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

from tests.benchmarks.scripts import load_script

study = load_script("routing_replay_study")

# A stand-in for a GRPO run: one metrics line per step; SIGTERM stops it after the step, exit 75.
RUN = """
import json, signal, sys, time
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
path, steps = sys.argv[1], int(sys.argv[2])
for step in range(1, steps + 1):
    if stop:
        sys.exit(75)
    with open(path, "a") as f:
        f.write(json.dumps({"step": step}) + "\\n")
    time.sleep(0.02)
"""


def start(tmp_path, name, steps):
    source = tmp_path / f"{name}.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", RUN, str(source), str(steps)])
    return proc, (source, tmp_path / f"copy_{name}.jsonl")


def steps_in(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_finished_runs_are_copied_whole(tmp_path):
    runs = {name: start(tmp_path, name, 5) for name in ("replay", "no_replay")}
    statuses = study.wait_mirroring({n: p for n, (p, _) in runs.items()}, {n: m for n, (_, m) in runs.items()}, 0.01)
    assert statuses == {"replay": 0, "no_replay": 0}
    for _, (_, copy) in runs.values():
        assert steps_in(copy) == [1, 2, 3, 4, 5]


def test_a_sigterm_stops_the_runs_and_keeps_their_steps(tmp_path):
    runs = {name: start(tmp_path, name, 1000) for name in ("replay", "no_replay")}
    sources = [source for _, (source, _) in runs.values()]

    def time_limit():
        while not all(s.is_file() and len(steps_in(s)) >= 3 for s in sources):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=time_limit, daemon=True).start()
    statuses = study.wait_mirroring({n: p for n, (p, _) in runs.items()}, {n: m for n, (_, m) in runs.items()}, 0.01)
    assert statuses == {"replay": 75, "no_replay": 75}
    for _, (source, copy) in runs.values():
        assert len(steps_in(copy)) >= 3
        assert steps_in(copy) == steps_in(source)  # the last copy is taken after the run stopped
    assert signal.getsignal(signal.SIGTERM) is before
