"""The tally kind: its step law, its exactness in every phrasing, and its determinism."""

import dataclasses
import math
import random
import re

import pytest

from jaxspec.rewards import get_reward, math_reward
from jaxspec.tasks import generate_problems
from jaxspec.tasks.generator import generate_recorded
from jaxspec.tasks.tally import StepLaw, TallyConfig, config_errors

SHORT = TallyConfig(steps=StepLaw(median=12, sigma=0.6, min_steps=3, max_steps=40), variation=1.0)
LAWS = {"lognormal": StepLaw(), "pareto": StepLaw(law="pareto", median=50, alpha=1.5, min_steps=3, max_steps=800)}


def _dkw_bound(n: int, failure: float = 1e-6) -> float:
    """sup |F_n - F| exceeds this with probability at most `failure` (Dvoretzky-Kiefer-Wolfowitz,
    Massart's constant: P(sup > eps) <= 2 exp(-2 n eps^2)); it holds for discrete laws too."""
    return math.sqrt(math.log(2 / failure) / (2 * n))


def _sup_distance(draws: list[int], law: StepLaw) -> float:
    counts: dict[int, int] = {}
    for n in draws:
        counts[n] = counts.get(n, 0) + 1
    below, worst = 0, 0.0
    for n in range(law.min_steps, law.max_steps + 1):
        below += counts.get(n, 0)
        worst = max(worst, abs(below / len(draws) - law.cdf(n)))
    return worst


@pytest.mark.parametrize("name", sorted(LAWS))
def test_step_law_draws_follow_its_cdf(name):
    """20000 draws against the exact truncated CDF: bound 0.019 (DKW at failure probability 1e-6),
    so a law off by more than ~0.04 anywhere is caught. Negative control: the same draws against
    a law whose median is 10% higher (a CDF ~0.05 lower in the middle) are rejected."""
    law = LAWS[name]
    rng = random.Random(7)
    draws = [law.draw(rng) for _ in range(20000)]
    assert min(draws) >= law.min_steps and max(draws) <= law.max_steps
    assert law.cdf(law.min_steps - 1) == 0.0 and law.cdf(law.max_steps) == pytest.approx(1.0)
    bound = _dkw_bound(len(draws))
    assert bound < 0.02
    assert _sup_distance(draws, law) < bound
    assert _sup_distance(draws, dataclasses.replace(law, median=law.median * 1.1)) > bound


def test_step_law_is_heavy_tailed_as_configured():
    """The default law's quantiles (the config's stated shape): median 50 days, 99th percentile
    above 5x the median, yet bounded by max_steps."""
    law = StepLaw()
    quantile = lambda q: next(n for n in range(law.min_steps, law.max_steps + 1) if law.cdf(n) >= q)  # noqa: E731
    assert quantile(0.5) == 50
    assert quantile(0.99) > 5 * 50
    assert quantile(0.01) < 10


def test_days_in_question_match_the_law_and_the_lines():
    """Problems carry the law's draws: the question's N is the number of day lines."""
    problems = generate_problems(300, seed=3, kinds=("tally",), tally=SHORT)
    days = []
    for p in problems:
        n = int(re.search(r"after (\d+) days\?$", p["question"]).group(1))
        lines = p["solution"].splitlines()
        assert len(lines) == n + 2  # start, one line per day, the answer
        days.append(n)
        assert p["level"] == 0 and p["kind"] == "tally"
    assert _sup_distance(days, SHORT.steps) < _dkw_bound(len(days))


def _simulate(question: str) -> list[int]:
    """The value after each day, from the question's text alone (independent of the generator)."""
    start = int(re.search(r"starts at (-?\d+)", question).group(1))
    rules = [(1, re.search(r"Each day it goes (up|down) by (\d+)", question).groups())]
    rules += [
        (int(p), (d, a))
        for p, d, a in re.findall(r"[Ee]very (\d+) days it (?:also )?goes (up|down) by (\d+)", question)
    ]
    days = int(re.search(r"after (\d+) days\?$", question).group(1))
    values, value = [], start
    for day in range(1, days + 1):
        value += sum((1 if d == "up" else -1) * int(a) for period, (d, a) in rules if day % period == 0)
        values.append(value)
    return [start] + values


def _check_lines(solution: str, values: list[int]) -> None:
    """Each day line names its day, every equation in it is right, and its last number is the
    value after that day."""
    lines = solution.splitlines()
    assert int(re.findall(r"-?\d+", lines[0])[-1]) == values[0]
    for day, line in enumerate(lines[1:-1], start=1):
        assert re.match(rf"\D*[Dd]ay {day}\D", line), line
        for left, right in re.findall(r"(-?\d+(?: [+-] \d+)+) (?:=|is|makes) (-?\d+)", line):
            assert eval(left) == int(right), line  # test-only: our own generated arithmetic
        assert int(re.findall(r"-?\d+", line)[-1]) == values[day], line


def test_every_solution_is_right_at_every_variation():
    for variation in (0.0, 0.5, 1.0):
        cfg = dataclasses.replace(SHORT, variation=variation)
        for p in generate_problems(100, seed=11, kinds=("tally",), tally=cfg):
            values = _simulate(p["question"])
            _check_lines(p["solution"], values)
            assert p["answer"] == str(values[-1])
            assert p["solution"].endswith(f"\\boxed{{{values[-1]}}}.")
            assert math_reward(p["solution"], p["answer"]) == 1.0


def test_every_phrasing_grades_right_and_a_wrong_answer_in_any_grades_zero():
    """Each alternative of each choice point, put in place of the drawn one, leaves a solution
    that is right line by line and earns reward 1; every phrasing of the answer line with the
    answer off by one earns 0 (the `arithmetic` reward, as GRPO calls it)."""
    reward = get_reward("arithmetic")
    for problem, segments in generate_recorded(6, seed=5, kinds=("tally",), tally=SHORT):
        values = _simulate(problem["question"])
        drawn = [s.drawn for s in segments]
        assert "".join(drawn) == problem["solution"]
        example = {"prompt": problem["question"], "answer": problem["answer"]}
        phrasings = 0
        for i, segment in enumerate(segments):
            for text in segment.texts:
                solution = "".join(drawn[:i] + [text] + drawn[i + 1 :])
                _check_lines(solution, values)
                assert reward(solution, example) == 1.0
                phrasings += 1
        assert phrasings > 10 * len(problem["solution"].splitlines())
        right = f"\\boxed{{{values[-1]}}}"
        finals = segments[-1].texts
        assert len(finals) == 4 and all(right in text for text in finals)
        for text in finals:
            wrong = "".join(drawn[:-1]) + text.replace(right, f"\\boxed{{{values[-1] + 1}}}")
            assert reward(wrong, example) == 0.0


def test_same_seed_same_data_and_recording_changes_nothing():
    cfg = dataclasses.replace(SHORT, variation=0.7)
    a = generate_problems(50, seed=4, kinds=("tally",), tally=cfg)
    assert a == generate_problems(50, seed=4, kinds=("tally",), tally=cfg)
    assert a != generate_problems(50, seed=5, kinds=("tally",), tally=cfg)
    recorded = generate_recorded(50, seed=4, kinds=("tally",), tally=cfg)
    assert [p for p, _ in recorded] == a
    assert all("".join(s.drawn for s in segments) == p["solution"] for p, segments in recorded)
    mixed = generate_problems(60, seed=4, levels=(1, 2), kinds=("arithmetic", "word", "tally"), tally=cfg)
    assert {p["kind"] for p in mixed} == {"arithmetic", "word", "tally"}
    assert mixed == generate_problems(60, seed=4, levels=(1, 2), kinds=("arithmetic", "word", "tally"), tally=cfg)


def test_variation_zero_writes_the_canonical_solution():
    cfg = dataclasses.replace(SHORT, variation=0.0)
    for p in generate_problems(20, seed=2, kinds=("tally",), tally=cfg):
        lines = p["solution"].splitlines()
        assert lines[0].startswith("Start: ") and lines[-1].startswith("The answer is \\boxed{")
        assert all(
            re.fullmatch(
                r"Day \d+: we (add|subtract) \d+( and we (add|subtract) \d+)*, so we get -?\d+"
                r"( [+-] \d+)+ = -?\d+\.",
                line,
            )
            for line in lines[1:-1]
        ), lines[:3]


def test_config_errors_name_the_key():
    assert config_errors(TallyConfig()) == []
    bad = TallyConfig(steps=StepLaw(median=900, sigma=0.0, min_steps=0, max_steps=800), variation=1.5)
    keys = [key for key, _ in config_errors(bad)]
    assert keys == ["variation", "steps.min_steps", "steps.median", "steps.sigma"]
    pareto = TallyConfig(steps=StepLaw(law="pareto", median=3, alpha=0.0, min_steps=3))
    assert [key for key, _ in config_errors(pareto)] == ["steps.median", "steps.alpha"]
