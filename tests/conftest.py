"""Test session setup: no network; 8 virtual CPU devices for mesh tests, float32 matmuls and cheap
compilation, except in a session that selects the `gpu` marker (`pytest -m gpu tests/gpu`), which
runs on the machine's accelerators and compiles as the CLI does. Tests marked `gpu` are skipped
where JAX's backend is not a GPU."""

import gc
import os
import re

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # the CPU platform's devices
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402


def selects_gpu_tests(markexpr: str) -> bool:
    """Whether a `-m` expression asks for the tests marked gpu ("gpu", "gpu and not slow"), not
    only leaves them out ("not gpu")."""
    return re.search(r"(?<!not )\bgpu\b", markexpr) is not None


def pytest_configure(config):
    if selects_gpu_tests(config.getoption("markexpr") or ""):
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # also for the child processes tests start
    jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
    jax.config.update("jax_default_matmul_precision", "highest")
    # The suite's time goes into compiling many small programs that then run briefly; XLA's
    # optimization passes roughly double compile time and change what the programs compute only by
    # float rounding. Benchmarks, the CLI and the GPU checks compile with full optimization.
    jax.config.update("jax_disable_most_optimizations", True)


def pytest_collection_modifyitems(config, items):
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_tests and jax.default_backend() != "gpu":
        skip = pytest.mark.skip(reason=f"needs a GPU (JAX backend: {jax.default_backend()})")
        for item in gpu_tests:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def compiled_programs_released_after_each_file():
    """Drops JAX's compiled programs after each test file. Each XLA CPU executable holds a few
    memory mappings of its JIT-compiled code, and a pytest-xdist worker that runs many files would
    otherwise keep every program it ever compiled: near Linux's limit of 65,530 mappings per process
    (vm.max_map_count) a compilation fails to map its code and the worker dies inside XLA's
    compiler (seen at 65,396 mappings). With this, a file's programs peak at about 26,000."""
    yield
    jax.clear_caches()
    gc.collect()
