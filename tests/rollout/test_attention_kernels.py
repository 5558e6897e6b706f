"""Rollouts through the decoder layer's kernels, the attention kernel, the prologue before it
(JAXSPEC_ATTENTION_PROLOGUE=triton), the residual norms (JAXSPEC_RESIDUAL_NORM) and the weight
projections (JAXSPEC_THIN_MATMUL), in Triton's
interpreter on the CPU, give the jnp reference's rollouts
from the same key: the staged engine's dense caches and the slot engine's pools, autoregressive and
EAGLE-3 chains, each on the `tiny` policy in float32. The traced programs must call the kernels (so
that the comparison is not the reference's with itself)."""

import dataclasses
import functools

import jax
import pytest

from jaxspec.rollout import Spec, generate
from tests.kernels.fake_jax_triton import kernels_in
from tests.rollout.conftest import assert_same_rollout

pytest.importorskip("triton", reason="the kernels run in Triton's interpreter (the test extra has triton)")
pytest.importorskip("torch", reason="Triton's interpreter runs on torch CPU tensors (the test extra has torch)")

ENVS = ("JAXSPEC_CACHE_ATTENTION", "JAXSPEC_PAGED_ATTENTION", "JAXSPEC_RESIDUAL_NORM", "JAXSPEC_THIN_MATMUL")
KERNELS = {"_attention_prologue", "_paged_attention", "_merge_partials", "_residual_norm", "_thin_matmul"}


@pytest.mark.parametrize("slots", [None, 2], ids=["staged", "slots"])
@pytest.mark.parametrize("method", ["ar", "eagle3"])
def test_rollouts_through_the_attention_kernels_equal_the_reference(tiny, monkeypatch, slots, method):
    cfg, params, head, rows, _, sampled = tiny
    monkeypatch.setenv("JAXSPEC_ATTENTION_PROLOGUE", "triton")
    monkeypatch.setenv("JAXSPEC_ATTENTION_MERGE", "triton")
    sampling = dataclasses.replace(sampled, max_new_tokens=8)
    spec = Spec("eagle3", head, num_draft_tokens=2) if method == "eagle3" else None
    run = functools.partial(generate, cfg, params, rows[:4], jax.random.key(5), sampling, spec=spec, slots=slots)
    results = {}
    for impl in ("xla", "triton-interpret"):
        for env in ENVS:
            monkeypatch.setenv(env, impl)
        jax.clear_caches()  # the rollout's programs read the variables when traced
        results[impl] = run()
    jax.clear_caches()  # later tests trace their rollouts afresh, with the variables unset
    assert_same_rollout(results["triton-interpret"], results["xla"])


def test_the_kernels_are_in_the_traced_step(tiny, monkeypatch):
    """The control of the comparison above: with the variables set the decode step's program calls
    the prologue's, the attention's, the residual norm's and the projections' kernels, with "xla"
    none."""
    from jaxspec.models import extend, init_cache
    from jaxspec.rollout.weights import rollout_weights

    cfg, params, *_ = tiny
    fused = rollout_weights(params)
    cache = init_cache(cfg, 2, 16)
    tokens = jax.numpy.ones((2, 1), jax.numpy.int32)
    lens = jax.numpy.asarray([3, 5], jax.numpy.int32)

    def traced_kernels():
        """The kernels a new step function's program calls: the variables are read when traced, and
        JAX keeps a trace per function."""

        def step(params, cache):
            return extend(cfg, params, cache, tokens, lens[:, None], lens)[0]

        return kernels_in(str(jax.make_jaxpr(step)(fused, cache)))

    for env in ENVS:
        monkeypatch.setenv(env, "triton-interpret")
    monkeypatch.setenv("JAXSPEC_ATTENTION_PROLOGUE", "triton")
    monkeypatch.setenv("JAXSPEC_ATTENTION_MERGE", "triton")
    assert traced_kernels() == KERNELS
    for env in ENVS:
        monkeypatch.setenv(env, "xla")
    assert not traced_kernels()
