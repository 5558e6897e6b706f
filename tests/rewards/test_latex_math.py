import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from jaxspec.rewards import get_reward, math_reward

# Strings real models write, with their correct grade (the exact-rational checker misgraded them).
ISSUE_STRINGS = [
    ("The answer is \u22125", "5", 0.0),  # Unicode minus
    ("The answer is \u22125", "-5", 1.0),
    ("\\boxed{\u22125}", "5", 0.0),
    ("\\boxed{\u22125}", "-5", 1.0),
    (r"\boxed{3, 400}", "3400", 0.0),  # two numbers, not 3400
    (r"\boxed{1 2}", "12", 0.0),
    (r"\boxed{5\text{ or }6}", "56", 0.0),
    (r"\boxed{x = 5}", "5", 1.0),
    (r"\boxed{\text{5}}", "5", 1.0),
    (r"\boxed{2\frac{1}{2}}", "5/2", 1.0),  # mixed number
    (r"\boxed{\sqrt2}", r"\sqrt{2}", 1.0),
    (r"\boxed{10^{3}}", "1000", 1.0),
    (r"\boxed{5}\boxed{}", "5", 1.0),  # an empty last box
    (r"so the answer is \boxed{5} [1]", "5", 1.0),  # a trailing citation
    ("so the answer is 5 [1]", "5", 1.0),
]

# GSM8K / MATH / DAPO-style reference fields.
REFERENCES = [
    ("She pays 18 dollars.\n#### 18", "Janet makes 9 * 2 = 18 dollars a day.\n#### 18", 1.0),
    (r"The answer is $\boxed{\frac{\sqrt{3}}{2}}$.", r"\frac{\sqrt{3}}{2}", 1.0),
    (r"\boxed{\dfrac{1}{2}}", r"The probability is $\boxed{\frac12}$.", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{1,234}", "1234", 1.0),
    (r"\boxed{3/4}", "0.7", 0.0),
    (r"\boxed{-\frac{3}{4}}", "3/4", 0.0),
    ("no answer here", "3", 0.0),
    ("", "3", 0.0),
    (r"\boxed{4}", "", 0.0),
]


@pytest.mark.parametrize("response, answer, grade", ISSUE_STRINGS + REFERENCES)
def test_grades(response, answer, grade):
    assert math_reward(response, answer) == grade


def test_registered_math_reward_grades_in_its_worker_and_from_threads():
    """The "math" reward runs math-verify in a worker process; the grades are the same from the main
    thread and from worker threads (where math-verify's signal-based timeouts cannot run)."""
    reward = get_reward("math")
    cases = ISSUE_STRINGS[:8]
    assert [reward(r, {"answer": a}) for r, a, _ in cases] == [g for _, _, g in cases]
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(lambda c: reward(c[0], {"answer": c[1]}), cases)) == [g for _, _, g in cases]
        direct = pool.submit(
            lambda: (threading.current_thread() is threading.main_thread(), math_reward(r"\boxed{2\frac{1}{2}}", "5/2"))
        ).result()
    assert direct == (False, 1.0)
