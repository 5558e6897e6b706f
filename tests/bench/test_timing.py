"""The in-loop timing keeps every call inside the loop: XLA may neither hoist a call's work out of
it (work that depends only on loop-invariant arguments) nor drop the calls."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.bench import timing
from jaxspec.bench.timing import in_loop, in_loop_seconds, out_of_memory


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


def test_ceilings_are_timed_inside_one_compiled_loop():
    """copy / matmul rates come from one program whose while loop runs the work `calls` times
    (one dispatch and one host sync for all calls), iterations kept apart by a barrier."""
    from jaxspec.bench.timing import copy_bytes_per_second, looped, matmul_flops_per_second

    program = looped(lambda v: v + 1.0, calls=4)
    text = program.lower(jnp.zeros((8,), jnp.float32)).as_text()
    assert text.count("stablehlo.while") == 1 and "optimization_barrier" in text
    np.testing.assert_array_equal(program(jnp.zeros((8,), jnp.float32)), np.full(8, 4.0))
    with_weights = looped(lambda v, w: v + w, calls=4)  # invariants (weights) are the program's arguments
    np.testing.assert_array_equal(
        with_weights(jnp.zeros((8,), jnp.float32), jnp.full(8, 0.5, jnp.float32)), np.full(8, 2.0)
    )
    assert copy_bytes_per_second(1 << 20, calls=4, repeats=1) > 0
    assert matmul_flops_per_second(64, calls=2, repeats=1) > 0


def test_a_roofline_fraction_above_one_is_an_error_row():
    from jaxspec.bench.timing import add_fraction, datasheet, roofline_fraction

    assert roofline_fraction(3.0, 4.0, "copy") == 0.75
    with np.testing.assert_raises_regex(ValueError, "decode batch 1: 1.087 of the measured ceiling"):
        roofline_fraction(1.087, 1.0, "decode batch 1")
    row = {"batch": 1}
    add_fraction(row, "roofline_frac", 3.09e12, 2.84e12, "decode batch 1")
    assert row["roofline_frac"] is None and "above 1.0" in row["error"]
    row = {"batch": 1}
    add_fraction(row, "roofline_frac", 3.09e12, 4.19e12, "decode batch 1")
    assert abs(row["roofline_frac"] - 3.09 / 4.19) < 1e-12 and "error" not in row
    row = {"batch": 1}  # two impossible figures on one row (bench profile's three fractions): both named
    add_fraction(row, "weights_vs_copy", 1.2, 1.0, "weights")
    add_fraction(row, "kv_vs_copy", 1.3, 1.0, "kv")
    assert row["error"].startswith("weights: 1.200") and "; kv: 1.300" in row["error"], row["error"]
    assert datasheet("NVIDIA H200")["hbm_bytes_per_s"] == 4.8e12
    assert datasheet("NVIDIA H100 80GB HBM3")["hbm_bytes_per_s"] == 3.35e12
    assert datasheet("NVIDIA H100 PCIe")["hbm_bytes_per_s"] == 2.0e12
    assert datasheet("cpu") is None


def test_a_call_no_slower_than_the_empty_loop_is_an_error_not_a_time():
    from jaxspec.bench.timing import net_of_loop

    assert net_of_loop(3e-3, 1e-3, "verify") == pytest.approx(2e-3)
    assert net_of_loop(None, 1e-3, "verify") is None and net_of_loop(3e-3, None, "verify") is None
    for seconds in (1e-3, 0.5e-3):  # equal to the loop, and the negative difference once reported
        with pytest.raises(ValueError, match="verify reference batch 2: .* no more than the empty loop"):
            net_of_loop(seconds, 1e-3, "verify reference batch 2")


def test_out_of_memory_names_the_error_and_raises_any_other():
    err = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9 GiB\nmore")
    assert (
        out_of_memory(err) == "out of device memory: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9 GiB"
    )
    other = jax.errors.JaxRuntimeError("INTERNAL: a different failure")
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        out_of_memory(other)


class _Device:
    """A device whose allocator reports a pool (the statistics a GPU's BFC or cuda_async gives)."""

    def memory_stats(self):
        return {"largest_free_block_bytes": 0, "bytes_in_use": 5}


@pytest.mark.parametrize("allocator, expected", [("cuda_async", [None, None]), ("bfc", [0, 0])])
def test_largest_free_block_is_unknown_under_cuda_async(monkeypatch, allocator, expected):
    monkeypatch.setattr(timing.jax, "local_devices", lambda: [_Device(), _Device()])
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", allocator)
    assert timing.largest_free_block() == expected


def test_results_record_the_kernel_settings(tmp_path, monkeypatch):
    """A result file says which kernels ran: the JAXSPEC_* variables and XLA_FLAGS as set, no others."""
    for name in [k for k in list(timing.os.environ) if k.startswith("JAXSPEC_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("JAXSPEC_THIN_MATMUL", "triton")
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    out = tmp_path / "r.json"
    timing.write_results(str(out), "decode", [{"batch": 1}], {})
    settings = json.loads(out.read_text())["settings"]
    assert settings == {"JAXSPEC_THIN_MATMUL": "triton", "XLA_FLAGS": "--xla_gpu_enable_command_buffer="}
