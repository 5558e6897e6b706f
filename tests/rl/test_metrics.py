"""Step metrics: the phase timer's compilation count, the devices' memory."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.rl import metrics
from jaxspec.rl.metrics import PhaseTimer, device_memory_metrics, is_machine_dependent


def test_phase_timer_counts_the_compilations_of_its_step():
    f = jax.jit(lambda x: jnp.sin(x) * 3)
    timer = PhaseTimer()
    with timer.phase("first"):
        f(np.ones(3, np.float32)).block_until_ready()  # compiles
        f(np.ones(3, np.float32)).block_until_ready()  # cached
    with timer.phase("second"):
        f(np.ones(5, np.float32)).block_until_ready()  # a new shape compiles again
    record = timer.record()
    assert record["compiles"] == 2 and 0 < record["time_compile_s"] <= record["time_first_s"] + record["time_second_s"]
    f(np.ones(7, np.float32)).block_until_ready()  # after record(): not counted
    assert timer.compiles == 2
    assert all(is_machine_dependent(k) for k in record)


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
