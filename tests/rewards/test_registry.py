import logging
import math
import time

import numpy as np
import pytest

from jaxspec.rewards import RewardError, get_reward, register_reward, registered_rewards


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
    assert "reward test_raises failed (ZeroDivisionError: float division by zero); scored 0" in caplog.text
    assert "reward test_nan failed (returned nan); scored 0" in caplog.text
    assert "reward test_sleepy failed (exceeded 1 s on '60' (worker restarted)); scored 0" in caplog.text


def half_or_fail(response: str, example: dict) -> float:
    return {"right": 1.0, "wrong": 0.0}[response]  # KeyError for anything else


def always_zero(response: str, example: dict) -> float:
    return 0.0


register_reward("test_half_or_fail")(half_or_fail)
register_reward("test_always_zero", checks=[("right", {"answer": "1"}, 1.0), ("wrong", {"answer": "1"}, 0.0)])(
    always_zero
)


def test_a_batch_counts_its_failures_in_one_warning_and_a_batch_of_failures_stops(caplog):
    reward = get_reward("test_half_or_fail")
    with caplog.at_level(logging.WARNING, logger="jaxspec.rewards"):
        grades = reward.grade(["right", "garbled", "wrong", "noise"], [{}] * 4)
    np.testing.assert_array_equal(grades.scores, [1.0, 0.0, 0.0, 0.0])
    assert grades.failures == 2 and grades.first_failure == "KeyError: 'garbled'"
    assert caplog.text.count("WARNING") == 1
    assert (
        "reward test_half_or_fail failed on 2 of 4 responses, scored 0 (the first: KeyError: 'garbled')" in caplog.text
    )
    assert reward.grade(["right", "wrong"], [{}] * 2).failures == 0
    with pytest.raises(
        RewardError,
        match=r"reward 'test_half_or_fail' failed on all 2 responses of a batch "
        r"\(the first: KeyError: 'x'\)",
    ):
        reward.grade(["x", "y"], [{}] * 2)


@pytest.mark.parametrize("name", ["math", "arithmetic"])
def test_the_built_in_rewards_pass_their_self_test(name):
    get_reward(name).check()


def test_a_reward_that_cannot_grade_fails_its_self_test():
    with pytest.raises(
        RewardError,
        match=r"reward 'test_always_zero' cannot grade: its self-test scored 0 instead of 1 "
        r"for 'right' against the answer '1'",
    ):
        get_reward("test_always_zero").check()
