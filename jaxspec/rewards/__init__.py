"""Verifiable rewards: math answer verifiers (math-verify for LaTeX / external data, exact rationals
for the built-in task), wall-clock limits, and a registry of named reward functions. Each grader is
named after the reward it is registered as: `math_reward` ("math"), `arithmetic_reward`
("arithmetic")."""

from jaxspec.rewards.latex_math import math_reward
from jaxspec.rewards.math_verifier import (
    arithmetic_reward,
    extract_answer,
    format_number,
    normalize_answer,
    normalize_text,
    parse_number,
)
from jaxspec.rewards.registry import (
    Grades,
    Reward,
    RewardError,
    RewardFn,
    get_reward,
    register_reward,
    registered_rewards,
)
from jaxspec.rewards.timed import RewardCallError, TimedCall

__all__ = [
    "Grades",
    "Reward",
    "RewardCallError",
    "RewardError",
    "RewardFn",
    "TimedCall",
    "arithmetic_reward",
    "extract_answer",
    "format_number",
    "get_reward",
    "math_reward",
    "normalize_answer",
    "normalize_text",
    "parse_number",
    "register_reward",
    "registered_rewards",
]
