"""tests/gpu/check_spec.py: on a GPU, the compiled verification kernels and every rollout method
against the jnp reference; on the CPU, the kernel check's stochastic-draft cases in Triton's
interpreter."""

import jax.numpy as jnp
import pytest

import jaxspec.kernels.tree_stochastic_triton as stochastic
from tests.gpu import check_spec


def mismatches(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not r["ok"]]


@pytest.mark.gpu
def test_compiled_verification_kernels_agree_with_the_reference():
    rows = check_spec.kernel_checks()
    assert len(rows) == 86 and not mismatches(rows), mismatches(rows)


@pytest.mark.gpu
def test_every_rollout_method_agrees_with_the_reference():
    runs = check_spec.run_impls(("reference", "triton"), jobs=6)
    rows = check_spec.compare_rollouts(runs["reference"], runs["triton"])
    assert len(rows) == len(check_spec.rollout_cases()) and not mismatches(rows), mismatches(rows)


@pytest.mark.parametrize("chain", [True, False])
def test_stochastic_kernel_case_agrees_with_the_reference(chain):
    row = check_spec.kernel_case(5, chain, 512, 1.0, 16, seed=7, interpret=True, stochastic=True)
    assert row["ok"] and row["tree"] == ("chain/q" if chain else "random/q") and row["flipped_rows"] == 0.0


def test_a_wrong_stochastic_kernel_fails_the_case(monkeypatch):
    kernel = stochastic.verify_stochastic_triton
    wrong = lambda *a, **k: kernel(*a, **k)._replace(next_token=jnp.zeros(16, jnp.int32))  # noqa: E731
    monkeypatch.setattr(stochastic, "verify_stochastic_triton", wrong)
    row = check_spec.kernel_case(5, True, 512, 1.0, 16, seed=7, interpret=True, stochastic=True)
    assert not row["ok"] and row["flipped_rows"] > 0.5
