"""Verifiable rewards: math answer verifiers (math-verify for LaTeX / external data, exact rationals
for the built-in task), wall-clock limits, and a registry of named reward functions."""

from jaxspec.rewards.latex_math import latex_math_reward
from jaxspec.rewards.math_verifier import (extract_answer, format_number, math_reward, normalize_answer,
                                           normalize_text, parse_number)
from jaxspec.rewards.registry import RewardFn, get_reward, register_reward, registered_rewards
from jaxspec.rewards.timed import TimedCall

__all__ = [
    "RewardFn", "TimedCall", "extract_answer", "format_number", "get_reward", "latex_math_reward", "math_reward",
    "normalize_answer", "normalize_text", "parse_number", "register_reward", "registered_rewards",
]
