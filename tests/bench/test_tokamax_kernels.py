"""`jaxspec.bench.tokamax_kernels`: tokamax is imported for a benchmark's rows or its absence named,
and the command line of the benchmark is not read as tokamax's flags."""

import sys

import pytest

from jaxspec.bench.tokamax_kernels import load_tokamax


def test_without_tokamax_the_error_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokamax", None)  # import fails as if not installed
    with pytest.raises(SystemExit, match=r"pip install tokamax"):
        load_tokamax()


def test_a_benchmarks_own_arguments_are_not_parsed_as_tokamax_flags(monkeypatch):
    pytest.importorskip("tokamax", reason="tokamax is not a test dependency")
    import jax.numpy as jnp

    monkeypatch.setattr(sys, "argv", ["jaxspec", "bench", "mlp", "--tokamax", "xla", "--tiny"])
    tokamax = load_tokamax()
    x, w = jnp.ones((6, 4), jnp.float32), jnp.ones((2, 4, 3), jnp.float32)
    out = tokamax.ragged_dot(x, w, jnp.array([4, 2], jnp.int32), implementation="xla")
    assert out.shape == (6, 3) and float(out[0, 0]) == 4.0


def test_tokamax_autotuning_warnings_are_silenced(monkeypatch):
    pytest.importorskip("tokamax", reason="tokamax is not a test dependency")
    from absl import logging

    levels = []
    monkeypatch.setattr(logging, "set_verbosity", levels.append)
    load_tokamax()
    # an autotuning cache miss is a warning printing the call's whole arguments, once per shape
    assert levels == [logging.ERROR]
