"""Named reward functions.

A reward function has the signature `(response: str, example: dict) -> float`: `response` is the
decoded completion (special tokens removed), `example` is one prompt record as returned by
`jaxspec.tasks.load_prompts` (keys "prompt" and "answer", plus whatever a custom loader adds).
It must return a finite float and must not raise on any response text.
"""

from __future__ import annotations

from typing import Callable

from jaxspec.rewards.math_verifier import math_reward

RewardFn = Callable[[str, dict], float]

_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering `fn` under `name`; re-registering a name raises ValueError."""

    def decorator(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"reward {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return decorator


def get_reward(name: str) -> RewardFn:
    """The reward function registered under `name` (ValueError listing the known names if none)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown reward {name!r}; registered rewards: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def registered_rewards() -> list[str]:
    return sorted(_REGISTRY)


@register_reward("math")
def math_example_reward(response: str, example: dict) -> float:
    """`math_reward` against `example["answer"]`."""
    return math_reward(response, str(example["answer"]))
