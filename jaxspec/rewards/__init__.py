"""Verifiable rewards: the math answer verifier and a registry of named reward functions."""

from jaxspec.rewards.math_verifier import extract_answer, format_number, math_reward, normalize_answer, parse_number
from jaxspec.rewards.registry import RewardFn, get_reward, register_reward, registered_rewards

__all__ = [
    "RewardFn", "extract_answer", "format_number", "get_reward", "math_reward", "normalize_answer",
    "parse_number", "register_reward", "registered_rewards",
]
