"""Rollout generation: exact sampling from the policy's processed distribution, with log-probs."""

from jaxspec.rollout.engine import RolloutOutput, generate
from jaxspec.rollout.memory import rollout_memory_bytes
from jaxspec.rollout.sampling import Sampling, processed_logprobs
from jaxspec.rollout.speculative import Spec, SpecConfig

__all__ = ["RolloutOutput", "Sampling", "Spec", "SpecConfig", "generate", "processed_logprobs", "rollout_memory_bytes"]
