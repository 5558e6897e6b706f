import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from jaxspec.rewards import RewardCallError, TimedCall
from jaxspec.rewards.latex_math import math_example_reward

REPO = str(Path(__file__).resolve().parents[2])
PATHOLOGICAL = r"\boxed{(x+1)^{100000}}"  # sympy expands it for minutes; math-verify's own timeout misses it


def fail(text: str) -> float:
    raise ArithmeticError(f"cannot grade {text}")


SLOW_SETUP_S = 3.0
_ready = False


def _set_up() -> None:
    global _ready
    time.sleep(SLOW_SETUP_S)  # a lazy import of a heavy verifier, as math-verify's
    _ready = True


def slow_to_set_up(text: str) -> str:
    if not _ready:
        _set_up()
    return text


slow_to_set_up.warm_up = _set_up


def broken_warm_up(text: str) -> str:
    return text


def _refuse() -> None:
    raise ImportError("no grammar")


broken_warm_up.warm_up = _refuse


def test_a_hanging_verifier_is_cut_off_from_any_thread():
    timed = TimedCall(math_example_reward, timeout_s=2.0)
    try:
        assert timed(r"\boxed{5}", {"answer": "5"}) == 1.0  # starts the worker
        with ThreadPoolExecutor(1) as pool:
            start = time.perf_counter()
            with pytest.raises(RewardCallError, match=r"exceeded 2 s on .*\(worker restarted\)"):
                pool.submit(timed, PATHOLOGICAL, {"answer": "5"}).result()
            assert time.perf_counter() - start < 10
        assert timed(r"\boxed{-5}", {"answer": "-5"}) == 1.0  # a fresh worker answers the next call
    finally:
        timed.close()


def test_the_worker_is_started_once_and_restarted_when_it_dies():
    timed = TimedCall(math_example_reward, timeout_s=30.0)
    try:
        assert timed(r"\boxed{5}", {"answer": "5"}) == 1.0
        first = timed._proc.pid
        assert timed(r"\boxed{4}", {"answer": "5"}) == 0.0 and timed._proc.pid == first  # reused
        timed._proc.kill()
        timed._proc.wait()
        assert timed(r"\boxed{5}", {"answer": "5"}) == 1.0 and timed._proc.pid != first  # a fresh one
    finally:
        timed.close()


def test_a_warm_up_runs_when_the_worker_starts_not_inside_a_calls_limit():
    """slow_to_set_up's first call would take SLOW_SETUP_S, over the 1 s limit, were its setup not
    run by the worker's start."""
    timed = TimedCall(slow_to_set_up, timeout_s=1.0)
    try:
        assert timed("x") == "x"
    finally:
        timed.close()
    timed = TimedCall(broken_warm_up, timeout_s=5.0)
    try:
        with pytest.raises(RewardCallError, match=r"broken_warm_up.warm_up\(\) failed: ImportError: no grammar"):
            timed("x")
    finally:
        timed.close()


def test_the_math_rewards_warm_up_imports_math_verify():
    script = (
        "import sys\n"
        "from jaxspec.rewards.latex_math import math_example_reward, math_reward\n"
        "assert 'math_verify' not in sys.modules\n"
        "assert math_reward.warm_up is math_example_reward.warm_up\n"
        "math_example_reward.warm_up()\n"
        "print('math_verify' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True"]


def test_errors_inside_the_worker_raise_with_their_message():
    timed = TimedCall(fail, timeout_s=30.0)
    try:
        with pytest.raises(RewardCallError, match="ArithmeticError: cannot grade x"):
            timed("x")
    finally:
        timed.close()
    with pytest.raises(ValueError, match="timeout_s"):
        TimedCall(fail, 0)


def test_a_function_the_worker_cannot_import_is_refused():
    def local(response, example):
        return 1.0

    with pytest.raises(ValueError, match="'local' would run in a reward worker process.*top level of an importable"):
        TimedCall(local, 5.0)
    local.__module__, local.__qualname__ = "__main__", "local"
    with pytest.raises(ValueError, match="not in the script being run"):
        TimedCall(local, 5.0)


def test_the_math_reward_grades_from_a_script_read_from_stdin():
    """`python - <<EOF` has no importable __main__: the worker never needs it."""
    script = (
        "from jaxspec.rewards import get_reward\n"
        "reward = get_reward('math')\n"
        "print(reward(r'So $\\boxed{\\dfrac{1}{2}}$.', {'answer': '1/2'}), reward('3', {'answer': '1/2'}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-"],
        input=script,
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1.0", "0.0"]
