import logging
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from jaxspec.rewards import TimedCall
from jaxspec.rewards.latex_math import math_example_grade

PATHOLOGICAL = r"\boxed{(x+1)^{100000}}"  # sympy expands it for minutes; math-verify's own timeout misses it


def fail(text: str) -> float:
    raise ArithmeticError(f"cannot grade {text}")


def test_a_hanging_verifier_is_cut_off_from_any_thread(caplog):
    timed = TimedCall(math_example_grade, timeout_s=2.0)
    try:
        assert timed(r"\boxed{5}", {"answer": "5"}) == 1.0  # starts the worker
        with caplog.at_level(logging.WARNING, logger="jaxspec.rewards"), ThreadPoolExecutor(1) as pool:
            start = time.perf_counter()
            assert pool.submit(timed, PATHOLOGICAL, {"answer": "5"}).result() is None
            assert time.perf_counter() - start < 10
        assert "exceeded 2.0 s" in caplog.text
        assert timed(r"\boxed{-5}", {"answer": "-5"}) == 1.0  # a fresh worker answers the next call
    finally:
        timed.close()


def test_errors_inside_the_worker_return_none(caplog):
    timed = TimedCall(fail, timeout_s=30.0)
    try:
        with caplog.at_level(logging.WARNING, logger="jaxspec.rewards"):
            assert timed("x") is None
        assert "ArithmeticError: cannot grade x" in caplog.text
    finally:
        timed.close()
    with pytest.raises(ValueError, match="timeout_s"):
        TimedCall(fail, 0)
