"""The in-loop timing keeps every call inside the loop: XLA may neither hoist a call's work out of
it (work that depends only on loop-invariant arguments) nor drop the calls."""

import re

import jax.numpy as jnp
import numpy as np

from jaxspec.bench.timing import in_loop, in_loop_seconds


def _carried(program, args) -> str:
    """The types of the while loop's carried tuple in the compiled program."""
    [line] = [ln for ln in program.lower(args).compile().as_text().splitlines() if " while(" in ln]
    return re.search(r"= \((.*?)\) while\(", line)[1]


def test_in_loop_keeps_every_call_in_the_loop():
    x, y = jnp.linspace(0.0, 1.0, 1024), jnp.arange(4, dtype=jnp.int32)
    same_work = lambda v, w, i: (jnp.sum(jnp.sin(v)), w[0])  # noqa: E731  (the same work every call)
    # carried: the counter, the two arguments and their first elements before the loop; sin(x)
    # and its sum (f32[1024], f32[]) stay in the body
    carried = _carried(in_loop(same_work, calls=3), (x, y)).split(", ")
    assert carried.count("f32[1024]{0}") == 1 and carried.count("s32[4]{0}") == 1 and "f32[]" not in carried
    assert set(carried) <= {"s32[]", "f32[1024]{0}", "s32[4]{0}", "f32[1]{0}", "s32[1]{0}"}
    x_after, y_after = in_loop(same_work, calls=3)((x, y))
    np.testing.assert_array_equal(x_after, jnp.linspace(0.0, 1.0, 1024))  # each call adds 0
    np.testing.assert_array_equal(y_after, [0, 1, 2, 3])


def test_in_loop_traces_fn_once_with_an_int32_index():
    seen = []
    in_loop(lambda v, i: seen.append(i) or (v + i,), calls=3)((jnp.zeros(2),))
    assert len(seen) == 1 and seen[0].shape == () and seen[0].dtype == jnp.int32  # one loop body
    seconds, (v,) = in_loop_seconds(lambda v, i: (v * 2.0 + i,), (jnp.ones(8),), calls=2, repeats=1)
    assert seconds > 0 and v.shape == (8,)
