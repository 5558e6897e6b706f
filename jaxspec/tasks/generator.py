"""Deterministic generator of verifiable math problems and the dataset writer.

A problem is a dict {"question", "solution", "answer", "level", "kind"}: the solution is
step-by-step text ending in `\\boxed{answer}`, the answer a canonical integer or fraction string
("42", "-7", "3/4"). The same (n, seed, levels, kinds, tally) always gives the same problems, in
the same order, on every platform (only `random.Random(seed)` drives the choices).

Kinds: "arithmetic" and "word" (the built-in task, DEFAULT_KINDS) have levels 1..MAX_LEVEL (7).
Levels 1..5 have short solutions (up to ~160 tokens of the task tokenizer); levels 6 and 7 have
long ones (~300-700 and ~900-1600 tokens) for rollouts of reasoning length. Adding levels never
changes the problems drawn for the existing ones. "tally" (`jaxspec.tasks.tally`) has no levels
(its problems have level 0): its solution length follows a heavy-tailed law and its phrasing a
variation knob, both set by a `TallyConfig` (a config's `data.tally`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

from jaxspec.tasks.arithmetic import LEVELS, arithmetic_problem
from jaxspec.tasks.phrasing import Segment
from jaxspec.tasks.tally import TallyConfig, config_errors, tally_problem
from jaxspec.tasks.word_problems import word_problem

MAX_LEVEL = max(LEVELS)
KINDS = ("arithmetic", "word", "tally")
DEFAULT_KINDS = ("arithmetic", "word")
FIELDS = ("question", "solution", "answer", "level", "kind")


def problem_config_errors(levels: Sequence[int], kinds: Sequence[str], tally: TallyConfig) -> list[tuple[str, str]]:
    """(key under a data section, message) for every out-of-range setting of the generated
    problems: `levels`, `kinds` and the `tally` section (`jaxspec.tasks.tally.config_errors`)."""
    errors = []
    if not (levels and all(1 <= lv <= MAX_LEVEL for lv in levels)):
        errors.append(("levels", f"must be a non-empty list of levels in 1..{MAX_LEVEL}, got {list(levels)}"))
    if not (kinds and all(k in KINDS for k in kinds)):
        errors.append(("kinds", f"must be a non-empty subset of {list(KINDS)}, got {list(kinds)}"))
    return errors + [(f"tally.{key}", message) for key, message in config_errors(tally)]


def _check(levels: Sequence[int], kinds: Sequence[str]) -> None:
    if not levels:
        raise ValueError("levels must name at least one level")
    bad = [lv for lv in levels if lv not in LEVELS]
    if bad:
        raise ValueError(f"levels {bad} out of range; levels are 1..{MAX_LEVEL}")
    if not kinds:
        raise ValueError("kinds must name at least one problem kind")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown problem kinds {unknown}; expected a subset of {list(KINDS)}")


def _stream(
    seed: int, levels: Sequence[int], kinds: Sequence[str], tally: TallyConfig, record: bool
) -> Iterator[tuple[dict, list[Segment] | None]]:
    """(problem, its solution's segments when `record`, else None); see `generate_recorded`."""
    _check(levels, kinds)
    rng = random.Random(seed)
    levels, kinds = list(levels), list(kinds)
    while True:
        level = rng.choice(levels)
        kind = rng.choice(kinds)
        segments = None
        if kind == "tally":
            question, solution, answer, writer = tally_problem(rng, tally, writer_record=record)
            level, segments = 0, writer.segments
        else:
            make = arithmetic_problem if kind == "arithmetic" else word_problem
            question, solution, answer = make(rng, level)
            if record:
                segments = [Segment((solution,), (1.0,), solution)]
        yield {"question": question, "solution": solution, "answer": answer, "level": level, "kind": kind}, segments


def iter_problems(
    seed: int,
    levels: Sequence[int] = (1, 2, 3),
    kinds: Sequence[str] = DEFAULT_KINDS,
    tally: TallyConfig = TallyConfig(),
) -> Iterator[dict]:
    """Endless deterministic stream of problems; level and kind are drawn uniformly per problem
    (a tally problem ignores its level draw). tally: the tally kind's length law and variation."""
    for problem, _ in _stream(seed, levels, kinds, tally, record=False):
        yield problem


def generate_recorded(
    n: int,
    seed: int,
    levels: Sequence[int] = (1, 2, 3),
    kinds: Sequence[str] = DEFAULT_KINDS,
    tally: TallyConfig = TallyConfig(),
) -> list[tuple[dict, list[Segment]]]:
    """The first `n` problems of `iter_problems(seed, ...)`, each with its solution as the
    `jaxspec.tasks.phrasing.Segment`s it was written in: every choice point's distribution and
    the text drawn (a built-in problem's solution is one segment of a single text)."""
    stream = _stream(seed, levels, kinds, tally, record=True)
    return [next(stream) for _ in range(n)]


def generate_problems(
    n: int,
    seed: int,
    levels: Sequence[int] = (1, 2, 3),
    kinds: Sequence[str] = DEFAULT_KINDS,
    exclude_questions: frozenset[str] | set[str] = frozenset(),
    max_tries_factor: int = 50,
    tally: TallyConfig = TallyConfig(),
) -> list[dict]:
    """The first `n` problems of `iter_problems(seed, ...)` whose question is not excluded.

    exclude_questions: questions to skip (e.g. the training set when building a held-out set).
    Raises ValueError if fewer than `n` new questions turn up within n * max_tries_factor draws
    (the problem space of the chosen levels is exhausted).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    out: list[dict] = []
    stream = iter_problems(seed, levels, kinds, tally)
    for _ in range(max(n * max_tries_factor, 1)):
        if len(out) == n:
            break
        problem = next(stream)
        if problem["question"] not in exclude_questions:
            out.append(problem)
    if len(out) < n:
        raise ValueError(
            f"only {len(out)} of {n} problems are new for levels {list(levels)}; "
            f"the problem space is too small for a held-out set of this size"
        )
    return out


def write_problems(path, problems: list[dict]) -> Path:
    """Writes problems to `path`: JSON lines for .jsonl/.json, parquet for .parquet."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".json", ".parquet"):
        raise ValueError(f"{path}: unsupported extension {suffix!r}; use .jsonl, .json or .parquet")
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist(
            problems,
            schema=pa.schema(
                [
                    ("question", pa.string()),
                    ("solution", pa.string()),
                    ("answer", pa.string()),
                    ("level", pa.int32()),
                    ("kind", pa.string()),
                ]
            ),
        )
        pq.write_table(table, path)
    else:
        with open(path, "w", encoding="utf-8") as f:
            for problem in problems:
                f.write(json.dumps(problem, ensure_ascii=False) + "\n")
    return path


def write_dataset(
    path,
    n: int,
    seed: int,
    levels: Sequence[int] = (1, 2, 3),
    kinds: Sequence[str] = DEFAULT_KINDS,
    tally: TallyConfig = TallyConfig(),
) -> Path:
    """Generates `n` problems (see `generate_problems`) and writes them to `path` (by extension)."""
    return write_problems(path, generate_problems(n, seed, levels, kinds, tally=tally))
