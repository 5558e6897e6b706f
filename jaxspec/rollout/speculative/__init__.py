"""Speculative rollouts: draft a token tree, verify it exactly with one policy forward, repeat.

`Spec` configures `jaxspec.rollout.generate(..., spec=Spec(...))`: its settings (`SpecConfig`, also
the `spec` section of a `jaxspec train` config) beside the draft's weights. The rollout is
distributed exactly as the autoregressive one.
"""

from jaxspec.rollout.speculative.spec import Spec, SpecConfig

__all__ = ["Spec", "SpecConfig"]
