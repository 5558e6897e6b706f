"""Test session setup: 8 virtual CPU devices for mesh tests, float32 matmuls, no network."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# The suite's time goes into compiling many small programs that then run briefly; XLA's
# optimization passes roughly double compile time and change what the programs compute only by
# float rounding. Benchmarks and the CLI outside the tests compile with full optimization.
jax.config.update("jax_disable_most_optimizations", True)
