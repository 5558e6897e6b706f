"""Test session setup: no network; 8 virtual CPU devices for mesh tests, float32 matmuls and cheap
compilation, except in a session that selects the `gpu` marker (`pytest -m gpu tests/gpu`), which
runs on the machine's accelerators and compiles as the CLI does. Tests marked `gpu` are skipped
where JAX's backend is not a GPU."""

import gc
import os
import re
import shutil
import tempfile

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
    share_compiled_programs(config)


_CACHE_DIR = "JAX_COMPILATION_CACHE_DIR"


def share_compiled_programs(config):
    """Points JAX's persistent compilation cache at one directory for the whole session, so a
    program that several tests, files, pytest-xdist workers or CLI child processes compile (the
    tiny policy's rollout loops above all) compiles once: most of the suite's time is XLA
    compiling. The controller makes the directory and removes it at the end; the workers and the
    child processes inherit it through the environment. A test that sets its own cache (a run's
    train.compilation_cache) replaces it for its own length."""
    if _CACHE_DIR not in os.environ:
        os.environ[_CACHE_DIR] = tempfile.mkdtemp(prefix="jaxspec-tests-xla-cache-")
        config.stash[_owned_cache] = os.environ[_CACHE_DIR]
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_DIR])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


_owned_cache = pytest.StashKey[str]()


def pytest_unconfigure(config):
    owned = config.stash.get(_owned_cache, None)
    if owned is not None:
        shutil.rmtree(owned, ignore_errors=True)
        del os.environ[_CACHE_DIR]


def leaves_out_the_slow_tier(config) -> bool:
    """Whether this run is a plain `pytest` over the whole suite (no files or tests named, no `-m`
    that mentions slow): such a run is the default tier and leaves out the files marked slow.
    Naming a slow file, or `-m slow`, runs it."""
    named = config.getoption("file_or_dir") or []
    return not named and "slow" not in (config.getoption("markexpr") or "")


def pytest_report_header(config):
    if leaves_out_the_slow_tier(config):
        return "the slow tier (files marked slow) is left out: pytest -m slow runs it"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_tests and jax.default_backend() != "gpu":
        skip = pytest.mark.skip(reason=f"needs a GPU (JAX backend: {jax.default_backend()})")
        for item in gpu_tests:
            item.add_marker(skip)
    if leaves_out_the_slow_tier(config):
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]


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
