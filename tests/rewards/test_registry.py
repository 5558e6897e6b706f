import logging
import math
import time

import pytest

from jaxspec.rewards import get_reward, register_reward, registered_rewards


def test_registry():
    assert {"math", "arithmetic"} <= set(registered_rewards())
    for name in ("math", "arithmetic"):
        reward = get_reward(name)
        assert reward(r"\boxed{3/4}", {"prompt": "q", "answer": "0.75"}) == 1.0
        assert reward("5", {"prompt": "q", "answer": "4"}) == 0.0

    @register_reward("test_length")
    def length_reward(response: str, example: dict) -> float:
        return float(len(response))

    assert get_reward("test_length").__wrapped__ is length_reward
    assert get_reward("test_length")("abc", {}) == 3.0
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_length")(lambda r, e: 0.0)
    with pytest.raises(ValueError, match=r"unknown reward 'nope'.*'math'"):
        get_reward("nope")


def sleepy(response: str, example: dict) -> float:
    time.sleep(float(response))
    return 1.0


def test_rewards_never_raise_and_are_timed(caplog):
    @register_reward("test_raises")
    def raises(response: str, example: dict) -> float:
        return 1.0 / len(response)

    @register_reward("test_nan")
    def nan(response: str, example: dict) -> float:
        return math.nan

    register_reward("test_sleepy", timeout_s=1.0)(sleepy)
    with caplog.at_level(logging.WARNING, logger="jaxspec.rewards"):
        assert get_reward("test_raises")("", {}) == 0.0
        assert get_reward("test_nan")("x", {}) == 0.0
        assert get_reward("test_sleepy")("0", {}) == 1.0
        start = time.perf_counter()
        assert get_reward("test_sleepy")("60", {}) == 0.0
        assert time.perf_counter() - start < 10
    assert "test_raises raised ZeroDivisionError" in caplog.text
    assert "test_nan returned nan" in caplog.text
    assert "sleepy exceeded 1.0 s" in caplog.text
