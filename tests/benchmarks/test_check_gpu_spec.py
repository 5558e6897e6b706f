"""benchmarks/check_gpu_spec.py: the kernel check's stochastic-draft cases on the CPU (interpret mode)."""

import jax.numpy as jnp
import pytest

import kernels.tree_stochastic_pallas as stochastic
from tests.benchmarks.scripts import load_script

check_gpu_spec = load_script("check_gpu_spec")


@pytest.mark.parametrize("chain", [True, False])
def test_stochastic_kernel_case_agrees_with_the_reference(chain):
    row = check_gpu_spec.kernel_case(5, chain, 512, 1.0, 16, seed=7, interpret=True, stochastic=True)
    assert row["ok"] and row["tree"] == ("chain/q" if chain else "random/q") and row["flipped_rows"] == 0.0


def test_a_wrong_stochastic_kernel_fails_the_case(monkeypatch):
    kernel = stochastic.verify_stochastic_pallas
    wrong = lambda *a, **k: kernel(*a, **k)._replace(next_token=jnp.zeros(16, jnp.int32))  # noqa: E731
    monkeypatch.setattr(stochastic, "verify_stochastic_pallas", wrong)
    row = check_gpu_spec.kernel_case(5, True, 512, 1.0, 16, seed=7, interpret=True, stochastic=True)
    assert not row["ok"] and row["flipped_rows"] > 0.5
