"""Named reward functions.

A reward function has the signature `(response: str, example: dict) -> float`: `response` is the
decoded completion (special tokens removed), `example` is one prompt record as returned by
`jaxspec.tasks.load_prompts` (keys "prompt" and "answer", plus whatever a custom loader adds).

`get_reward` returns the function guarded: an exception or a non-finite value scores 0.0 with a
warning, so a reward never stops a run. A function registered with `timeout_s` runs in a worker
process (`jaxspec.rewards.timed`) and scores 0.0 with a warning when it takes longer; it must be a
module-level function.

Built-in rewards:
    math        HF math-verify (`jaxspec.rewards.latex_math`): final answers in LaTeX or plain
                text against GSM8K / MATH / DAPO-style reference answers; limited to
                MATH_TIMEOUT_S seconds per response.
    arithmetic  the exact-rational checker (`jaxspec.rewards.math_verifier.math_reward`): integer,
                decimal and fraction answers, as the built-in math task writes them; fast and in
                process.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Callable

from jaxspec.rewards.latex_math import math_example_grade
from jaxspec.rewards.math_verifier import math_reward
from jaxspec.rewards.timed import TimedCall

RewardFn = Callable[[str, dict], float]

MATH_TIMEOUT_S = 10.0
log = logging.getLogger("jaxspec.rewards")

_REGISTRY: dict[str, RewardFn] = {}
_TIMEOUTS: dict[str, float] = {}
_TIMED: dict[str, TimedCall] = {}  # one worker per timed reward, started on first use


def register_reward(name: str, timeout_s: float | None = None) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering `fn` under `name`; re-registering a name raises ValueError.
    timeout_s: run it in a worker process, cut off (score 0) after that many seconds."""

    def decorator(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"reward {name!r} is already registered")
        _REGISTRY[name] = fn
        if timeout_s is not None:
            _TIMEOUTS[name] = timeout_s
        return fn

    return decorator


def get_reward(name: str) -> RewardFn:
    """The reward function registered under `name`, guarded (see the module docstring; the
    registered function is its `__wrapped__`). ValueError listing the known names if none."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown reward {name!r}; registered rewards: {sorted(_REGISTRY)}")
    fn = _REGISTRY[name]
    if name in _TIMEOUTS and name not in _TIMED:
        _TIMED[name] = TimedCall(fn, _TIMEOUTS[name])
    timed = _TIMED.get(name)

    @functools.wraps(fn)
    def guarded(response: str, example: dict) -> float:
        try:
            value = timed(response, example) if timed is not None else fn(response, example)
            value = 0.0 if value is None else float(value)
        except Exception as error:
            log.warning("reward %s raised %s: %s; scored 0", name, type(error).__name__, error)
            return 0.0
        if not math.isfinite(value):
            log.warning("reward %s returned %r; scored 0", name, value)
            return 0.0
        return value

    return guarded


def registered_rewards() -> list[str]:
    return sorted(_REGISTRY)


register_reward("math", timeout_s=MATH_TIMEOUT_S)(math_example_grade)


@register_reward("arithmetic")
def arithmetic_example_reward(response: str, example: dict) -> float:
    """`math_reward` (exact rationals) against `example["answer"]`."""
    return math_reward(response, str(example["answer"]))
