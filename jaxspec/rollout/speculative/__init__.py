"""Speculative rollouts: draft a token tree, verify it exactly with one policy forward, repeat.

`Spec` configures `jaxspec.rollout.generate(..., spec=Spec(...))`; the rollout is distributed
exactly as the autoregressive one.
"""

from jaxspec.rollout.speculative.spec import Spec

__all__ = ["Spec"]
