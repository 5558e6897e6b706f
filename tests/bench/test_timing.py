"""The in-program timing runs every call: XLA may neither merge nor hoist calls whose work does not
depend on the call index."""

import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.bench.timing import in_program, in_program_seconds


def _sines(fn, x) -> int:
    return len(re.findall(r"\bsine\(", fn.lower(x).compile().as_text()))


def test_in_program_keeps_every_call():
    x = jnp.linspace(0.0, 1.0, 1024)
    same_work = lambda v, i: jnp.sum(jnp.sin(v))  # noqa: E731
    assert _sines(in_program(same_work, calls=3), x) == 3
    outs, x_after = in_program(same_work, calls=3)(jnp.linspace(0.0, 1.0, 1024))
    np.testing.assert_array_equal(x_after, x)  # the chained update adds 0
    assert len(outs) == 3 and len({float(o) for o in outs}) == 1
    assert _sines(jax.jit(lambda v: [same_work(v, 0) for _ in range(3)]), x) == 1  # what the chain prevents


def test_in_program_passes_each_call_its_index():
    outs, _ = in_program(lambda v, w, i: v + w + i, calls=4)(jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.int32))
    assert [o.tolist() for o in outs] == [[1, 1], [2, 2], [3, 3], [4, 4]]
    seconds, x = in_program_seconds(lambda v, i: v * 2.0 + i, jnp.ones(8), calls=2, repeats=1)
    assert seconds > 0 and x.shape == (8,)
