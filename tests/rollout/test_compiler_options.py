"""The rollout loops' split-K choice: the rule by the policy's width, its override, and that every
rollout program takes the option."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.rollout import Spec, compiler_options, generate
from jaxspec.rollout.compiler_options import SPLIT_K_ENV, WIDE_HIDDEN, rollout_jit, splits_k

from .conftest import assert_same_rollout


def test_wide_policies_leave_split_k_out_and_narrow_ones_keep_xlas_choice(tiny, monkeypatch):
    monkeypatch.delenv(SPLIT_K_ENV, raising=False)
    cfg = tiny[0]
    assert splits_k(dataclasses.replace(cfg, hidden_size=WIDE_HIDDEN - 1))
    assert not splits_k(dataclasses.replace(cfg, hidden_size=WIDE_HIDDEN))
    monkeypatch.setenv(SPLIT_K_ENV, "xla")
    assert splits_k(dataclasses.replace(cfg, hidden_size=WIDE_HIDDEN))
    monkeypatch.setenv(SPLIT_K_ENV, "off")
    assert not splits_k(cfg)
    monkeypatch.setenv(SPLIT_K_ENV, "never")
    with pytest.raises(ValueError, match=SPLIT_K_ENV):
        splits_k(cfg)


def test_rollout_jit_compiles_with_the_option_only_where_the_rule_says(tiny, monkeypatch):
    """An option XLA does not know makes the compilation fail, so it shows which program got it."""
    monkeypatch.setattr(compiler_options, "NO_SPLIT_K", {"xla_no_such_option_here": 1})
    monkeypatch.delenv(SPLIT_K_ENV, raising=False)

    @rollout_jit(static_argnames=("cfg",))
    def double(cfg, x):
        return 2 * x

    narrow, wide = tiny[0], dataclasses.replace(tiny[0], hidden_size=WIDE_HIDDEN)
    np.testing.assert_array_equal(double(narrow, jnp.arange(3)), [0, 2, 4])
    with pytest.raises(Exception, match="xla_no_such_option_here"):
        double(wide, jnp.arange(3))
    monkeypatch.setenv(SPLIT_K_ENV, "xla")
    np.testing.assert_array_equal(double(wide, jnp.arange(3)), [0, 2, 4])


def test_rollout_jit_counts_the_programs_compiled_both_ways(tiny, monkeypatch):
    @rollout_jit(static_argnames=("cfg",))
    def double(cfg, x):
        return 2 * x

    wide = dataclasses.replace(tiny[0], hidden_size=WIDE_HIDDEN)
    assert double.trace(wide, jnp.arange(3)).out_info.shape == (3,)
    assert "multiply" in double.lower(wide, jnp.arange(3)).as_text()
    for choice, compiled in (("xla", 1), ("off", 2), ("xla", 2)):
        monkeypatch.setenv(SPLIT_K_ENV, choice)
        double(wide, jnp.arange(3))
        assert double._cache_size() == compiled


@pytest.mark.parametrize("slots", [None, 4], ids=["staged", "slots"])
def test_rollouts_without_split_k_compile_and_sample_the_same_tokens(tiny, slots, monkeypatch):
    """Every rollout loop (AR and EAGLE-3, staged and on slots) asks the rule and compiles with the
    option on the installed JAX; off the GPU the option changes no token."""
    cfg, params, head, rows, greedy, _ = tiny
    asked = []
    monkeypatch.setattr(compiler_options, "splits_k", lambda cfg, rule=splits_k: asked.append(cfg) or rule(cfg))
    results = {}
    for choice in ("xla", "off"):
        monkeypatch.setenv(SPLIT_K_ENV, choice)
        results[choice] = []
        for spec in (None, Spec("eagle3", head, num_draft_tokens=2)):
            before = len(asked)
            results[choice].append(generate(cfg, params, rows[:4], jax.random.key(1), greedy, spec=spec, slots=slots))
            assert len(asked) > before, f"{spec} asked no rollout program's split-K choice"
    for with_split_k, without in zip(results["xla"], results["off"]):
        assert_same_rollout(without, with_split_k)
