"""Rollout generation: exact sampling from the policy's processed distribution, with log-probs."""

from jaxspec.rollout.engine import RolloutOutput, generate
from jaxspec.rollout.memory import rollout_memory_bytes
from jaxspec.rollout.sampling import Sampling, processed_logprobs

__all__ = ["RolloutOutput", "Sampling", "generate", "processed_logprobs", "rollout_memory_bytes"]
