import json
import re
from fractions import Fraction

import pytest

from jaxspec.rewards import math_reward, parse_number
from jaxspec.tasks import MAX_LEVEL, generate_problems, write_dataset
from jaxspec.tasks.arithmetic import LEVELS


def test_same_seed_same_bytes_different_seed_differs(tmp_path):
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    write_dataset(a, 300, seed=7, levels=(1, 2, 3, 4, 5))
    write_dataset(b, 300, seed=7, levels=(1, 2, 3, 4, 5))
    write_dataset(c, 300, seed=8, levels=(1, 2, 3, 4, 5))
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    rows = [json.loads(line) for line in a.read_text().splitlines()]
    assert len(rows) == 300
    assert set(rows[0]) == {"question", "solution", "answer", "level", "kind"}


def test_parquet_is_deterministic_and_readable(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    write_dataset(a, 50, seed=3)
    write_dataset(b, 50, seed=3)
    assert a.read_bytes() == b.read_bytes()
    rows = pq.read_table(a).to_pylist()
    assert rows == generate_problems(50, seed=3)


@pytest.mark.parametrize("level", range(1, MAX_LEVEL + 1))
def test_every_solution_verifies_and_is_arithmetically_right(level):
    problems = generate_problems(400, seed=level, levels=(level,))
    kinds = {p["kind"] for p in problems}
    assert kinds == {"arithmetic", "word"}
    for p in problems:
        assert p["level"] == level
        assert p["solution"].rstrip().endswith(f"\\boxed{{{p['answer']}}}.")
        assert math_reward(p["solution"], p["answer"]) == 1.0
        assert parse_number(p["answer"]) is not None
        if p["kind"] == "arithmetic":
            _check_arithmetic(p)


def _check_arithmetic(problem):
    """Each line of an arithmetic solution has the value of the question's expression."""
    expr = re.fullmatch(r"(?:Compute|What is|Evaluate|Calculate) (.*)[.?]", problem["question"]).group(1)
    truth = _exact_eval(expr)
    lines = problem["solution"].splitlines()
    assert lines[0] == expr
    for line in lines[1:-1]:
        assert line.startswith("= ")
        assert _exact_eval(line[2:]) == truth
    assert Fraction(problem["answer"]) == truth


def _exact_eval(expr: str) -> Fraction:
    """Evaluates an integer expression exactly (independent of the generator's own evaluator)."""
    python = re.sub(r"(\d+)", r"Fraction(\1)", expr)
    return eval(python, {"Fraction": Fraction})  # test-only: the text is our own generated arithmetic


def test_difficulty_grows_with_level():
    def mean_steps(level):
        problems = generate_problems(300, seed=0, levels=(level,), kinds=("arithmetic",))
        return sum(len(p["solution"].splitlines()) for p in problems) / len(problems)

    steps = [mean_steps(level) for level in range(1, MAX_LEVEL + 1)]
    assert steps == sorted(steps) and steps[-1] > steps[0] + 2
    for level, spec in LEVELS.items():
        for p in generate_problems(100, seed=1, levels=(level,), kinds=("arithmetic",)):
            numbers = [int(n) for n in re.findall(r"\d+", p["question"])]
            assert max(numbers) <= spec.max_abs_value


def test_low_levels_have_no_negatives_or_parentheses():
    for p in generate_problems(300, seed=5, levels=(1,)):
        assert "(" not in p["question"] + p["solution"]
        assert "-" not in p["answer"]
    for p in generate_problems(300, seed=5, levels=(2,), kinds=("arithmetic",)):
        assert "(" not in p["question"] + p["solution"]
        assert "-" not in p["answer"]


def test_fraction_answers_appear_at_higher_levels():
    answers = [p["answer"] for p in generate_problems(500, seed=2, levels=(4,))]
    assert any("/" in a for a in answers)
    assert any(a.startswith("-") for a in answers)


def test_exclusion_and_bad_arguments(tmp_path):
    train = generate_problems(200, seed=0, levels=(1,))
    held_out = generate_problems(50, seed=1, levels=(1,), exclude_questions={p["question"] for p in train})
    assert not {p["question"] for p in held_out} & {p["question"] for p in train}
    with pytest.raises(ValueError, match="levels"):
        generate_problems(3, seed=0, levels=(0,))
    with pytest.raises(ValueError, match="kinds"):
        generate_problems(3, seed=0, kinds=("poetry",))
    with pytest.raises(ValueError, match="extension"):
        write_dataset(tmp_path / "x.csv", 3, seed=0)
    everything = {p["question"] for p in generate_problems(5000, seed=9, levels=(1,), kinds=("arithmetic",))}
    with pytest.raises(ValueError, match="problem space"):
        generate_problems(300, seed=0, levels=(1,), kinds=("arithmetic",), exclude_questions=everything)
