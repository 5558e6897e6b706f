"""Deliberately wrong verifiers for negative controls and power checks: the noise of
`jaxspec.kernels.tree_verify_reference` (the verifier's only source of randomness) passed through a
transform while a `with biased_noise(...)` block runs (jit caches are cleared on entry and exit,
so every verifier traced inside sees the wrong noise and none outside does)."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import pytest

import jaxspec.kernels.tree_verify_reference as reference


def accept_more(bias: float):
    """Acceptance thresholds scaled by 1 + bias: each node's uniform divided by 1 + bias, so a
    deterministic draft's k-th child is taken with probability min(1, (1 + bias) S_k) - min(1,
    (1 + bias) S_{k-1}) and a sampled draft is accepted with min(1, (1 + bias) p / q)."""
    return lambda noise: noise._replace(uniforms=noise.uniforms / (1 + bias))


def reuse_across_levels(noise: reference.VerifyNoise) -> reference.VerifyNoise:
    """Every node's uniform and race seeds are the root's."""
    return reference.VerifyNoise(*(jnp.broadcast_to(x[:, :1], x.shape) for x in noise))


def siblings_share_uniform(parents):
    """For trees of one shape (`parents`, -1 at the root): every node's uniform is its parent's, so
    a sampled draft's siblings are all tested with one uniform (their parent's), the error of a
    verifier that reads the uniform of the node it stands at instead of the child it tests."""
    source = jnp.asarray([max(parent, 0) for parent in parents])
    return lambda noise: noise._replace(uniforms=noise.uniforms[:, source])


@contextlib.contextmanager
def biased_noise(transform):
    original = reference.verification_noise
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reference, "verification_noise", lambda *args: transform(original(*args)))
        jax.clear_caches()
        try:
            yield
        finally:
            jax.clear_caches()
