"""Named reward functions.

A reward function has the signature `(response: str, example: dict) -> float`: `response` is the
decoded completion (special tokens removed), `example` is one prompt record as returned by
`jaxspec.tasks.load_prompts` (keys "prompt" and "answer", plus whatever a custom loader adds).

`get_reward` returns it as a `Reward`, guarded: a call that raises, returns a non-finite value or
overruns its limit scores 0.0 and counts as a failure (`Reward.grade` counts them per batch and
logs one warning line per batch; a batch in which every call fails raises RewardError, since
training on it would train on nothing). A function registered with `timeout_s` runs in a worker
process (`jaxspec.rewards.timed`) and must be a top-level function of an importable module.
A function registered with `checks` grades known answers before a run starts (`Reward.check`,
called by `jaxspec train`): a reward that cannot grade stops the run at once, with the reason.

Built-in rewards:
    math        HF math-verify (`jaxspec.rewards.latex_math.math_reward`): final answers in LaTeX
                or plain text against GSM8K / MATH / DAPO-style reference answers; limited to
                MATH_TIMEOUT_S seconds per response.
    arithmetic  the exact-rational checker (`jaxspec.rewards.math_verifier.arithmetic_reward`):
                integer, decimal and fraction answers, as the built-in math task writes them; fast
                and in process.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence

import numpy as np

from jaxspec.exits import EXIT_REWARD
from jaxspec.rewards.latex_math import math_example_reward
from jaxspec.rewards.math_verifier import arithmetic_reward
from jaxspec.rewards.timed import RewardCallError, TimedCall

RewardFn = Callable[[str, dict], float]
Check = tuple[str, dict, float]  # (response, example, the score it must get)

MATH_TIMEOUT_S = 10.0
log = logging.getLogger("jaxspec.rewards")


class RewardError(RuntimeError):
    """A reward that cannot grade: its self-test failed, or every response of a batch failed."""

    exit_status = EXIT_REWARD


@dataclasses.dataclass(frozen=True)
class Grades:
    """scores float64 [B] (0.0 where grading failed), failures (how many), first_failure (its reason)."""

    scores: np.ndarray
    failures: int
    first_failure: str | None


class Reward:
    """A registered reward function, guarded (see the module doc); call it as the function."""

    def __init__(self, name: str, fn: RewardFn, timeout_s: float | None, checks: Sequence[Check]):
        self.name, self.checks = name, tuple(checks)
        self.__wrapped__ = fn
        self._call = fn if timeout_s is None else TimedCall(fn, timeout_s)

    def score(self, response: str, example: dict) -> tuple[float, str | None]:
        """(the score, None), or (0.0, why grading failed)."""
        try:
            value = self._call(response, example)
            value = 0.0 if value is None else float(value)
        except RewardCallError as error:  # its message says what happened in the worker
            return 0.0, str(error)
        except Exception as error:  # any failure of a user's function scores 0 and is counted
            return 0.0, f"{type(error).__name__}: {error}"
        if not math.isfinite(value):
            return 0.0, f"returned {value!r}"
        return value, None

    def __call__(self, response: str, example: dict) -> float:
        value, failure = self.score(response, example)
        if failure is not None:
            log.warning("reward %s failed (%s); scored 0", self.name, failure)
        return value

    def grade(self, responses: Sequence[str], examples: Sequence[dict]) -> Grades:
        """Scores of the responses against their examples. RewardError when every one fails."""
        results = [self.score(r, e) for r, e in zip(responses, examples)]
        failures = [why for _, why in results if why is not None]
        if failures and len(failures) == len(results):
            raise RewardError(
                f"reward {self.name!r} failed on all {len(results)} responses of a batch (the first: {failures[0]})"
            )
        if failures:
            log.warning(
                "reward %s failed on %d of %d responses, scored 0 (the first: %s)",
                self.name,
                len(failures),
                len(results),
                failures[0],
            )
        return Grades(np.asarray([v for v, _ in results], np.float64), len(failures), failures[0] if failures else None)

    def check(self) -> None:
        """Grades the registered known answers; RewardError naming the first one that scores wrong
        (a broken verifier, a worker that cannot start, a missing dependency)."""
        for response, example, expected in self.checks:
            value, failure = self.score(response, example)
            if failure is not None or value != expected:
                why = f" because grading failed: {failure}" if failure else ""
                raise RewardError(
                    f"reward {self.name!r} cannot grade: its self-test scored {value:g} instead of "
                    f"{expected:g} for {response!r} against the answer {example['answer']!r}{why}"
                )


_REGISTRY: dict[str, tuple[RewardFn, float | None, tuple[Check, ...]]] = {}
_MADE: dict[str, Reward] = {}  # one Reward (and worker) per name, made on first use


def register_reward(
    name: str, timeout_s: float | None = None, checks: Sequence[Check] = ()
) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering `fn` under `name`; re-registering a name raises ValueError.
    timeout_s: run it in a worker process, cut off (score 0) after that many seconds.
    checks: (response, example, expected score) triples `Reward.check` grades before a run."""

    def decorator(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name][0] is not fn:
            raise ValueError(f"reward {name!r} is already registered")
        if timeout_s is not None:
            TimedCall(fn, timeout_s)  # refuses a function the worker could not import, at registration
        _REGISTRY[name] = (fn, timeout_s, tuple(checks))
        return fn

    return decorator


def get_reward(name: str) -> Reward:
    """The reward registered under `name`, guarded (see the module doc; the registered function is
    its `__wrapped__`). ValueError listing the known names if none."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown reward {name!r}; registered rewards: {sorted(_REGISTRY)}")
    if name not in _MADE:
        _MADE[name] = Reward(name, *_REGISTRY[name])
    return _MADE[name]


def registered_rewards() -> list[str]:
    return sorted(_REGISTRY)


HALF = {"prompt": "What is 1 / 2?", "answer": "1/2"}  # as `load_prompts` writes a reference answer
register_reward(
    "math",
    timeout_s=MATH_TIMEOUT_S,
    checks=[(r"So the answer is $\boxed{\dfrac{1}{2}}$.", HALF, 1.0), (r"So the answer is $\boxed{2}$.", HALF, 0.0)],
)(math_example_reward)


@register_reward(
    "arithmetic", checks=[(r"So the answer is \boxed{0.5}.", HALF, 1.0), (r"So the answer is \boxed{2}.", HALF, 0.0)]
)
def arithmetic_example_reward(response: str, example: dict) -> float:
    """`arithmetic_reward` (exact rationals) against `example["answer"]`."""
    return arithmetic_reward(response, str(example["answer"]))
