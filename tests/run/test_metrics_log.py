"""The metrics file: one writer, whose records carry the time they were written."""

import json
import time

from jaxspec.rl.metrics import is_machine_dependent
from jaxspec.run import MetricsLog


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
