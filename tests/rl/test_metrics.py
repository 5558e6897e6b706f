"""Step metrics: the stage timer's compilation count."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.rl.metrics import StageTimer, is_timing


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
    assert all(is_timing(k) for k in record)
