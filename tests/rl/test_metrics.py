"""Step metrics: the stage timer's compilation count, the records' wall-clock stamp."""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.rl import metrics
from jaxspec.rl.metrics import MetricsLog, StageTimer, device_memory_metrics, is_machine_dependent


def test_stage_timer_counts_the_compilations_of_its_step():
    f = jax.jit(lambda x: jnp.sin(x) * 3)
    timer = StageTimer()
    with timer.stage("first"):
        f(np.ones(3, np.float32)).block_until_ready()  # compiles
        f(np.ones(3, np.float32)).block_until_ready()  # cached
    with timer.stage("second"):
        f(np.ones(5, np.float32)).block_until_ready()  # a new shape compiles again
    record = timer.record()
    assert record["compiles"] == 2 and 0 < record["time_compile_s"] <= record["time_first_s"] + record["time_second_s"]
    f(np.ones(7, np.float32)).block_until_ready()  # after record(): not counted
    assert timer.compiles == 2
    assert all(is_machine_dependent(k) for k in record)


def test_records_carry_the_time_they_were_written(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    before = time.time()
    log.write({"step": 1, "reward_mean": 0.5})
    after = time.time()
    log.write({"step": 2, "reward_mean": 0.75})
    log.close()
    first, second = (json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert {k: v for k, v in first.items() if not is_machine_dependent(k)} == {"step": 1, "reward_mean": 0.5}
    rounding = 1e-3  # stamps are rounded to milliseconds
    assert before - rounding <= first["time_unix_s"] <= after + rounding
    assert second["time_unix_s"] >= after - rounding


class _Device:
    def __init__(self, peak: int, in_use: int):
        self.stats = {"peak_bytes_in_use": peak, "bytes_in_use": in_use, "bytes_limit": 80 * 10**9}

    def memory_stats(self):
        return self.stats


def test_device_memory_is_the_most_loaded_devices(monkeypatch):
    monkeypatch.setattr(
        metrics.jax, "local_devices", lambda: [_Device(70 * 10**9, 40 * 10**9), _Device(72 * 10**9, 39 * 10**9)]
    )
    record = device_memory_metrics()
    assert record == {"memory_peak_gb": 72.0, "memory_in_use_gb": 40.0}
    assert all(is_machine_dependent(k) for k in record)


def test_device_memory_is_absent_where_devices_report_none():
    assert jax.default_backend() == "cpu" and device_memory_metrics() == {}
