"""Prompt/answer loading from local JSON-lines or parquet files.

Field names are configurable, so one loader reads:
  * this package's generated files: prompt_field="question", answer_field="answer";
  * GSM8K: "question" / "answer" (the answer text ends in "#### 42");
  * MATH: "problem" / "solution" (the final answer is the last \\boxed{...});
  * DAPO-Math-style: "prompt" (a list of chat messages; the last user message is the prompt) /
    "reward_model.ground_truth" (dotted names reach into nested records).
Files are read with `datasets.load_dataset("json" | "parquet", data_files=...)`, or with json /
pyarrow directly where `datasets` is not installed. Answers are reduced to their final value with
`extract_answer(..., fallback="whole")` and put in canonical form with `normalize_answer`
("1,234" -> "1234", "\\frac{6}{8}" -> "3/4").

Bad data is refused in one line naming the file and the line (JSON lines) or record (a JSON array,
parquet): a line that is not valid JSON, a record without the prompt or answer field, or with it
null (`datasets` fills a field a record lacks with null).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxspec.rewards.math_verifier import extract_answer, normalize_answer

_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}

PathLike = str | os.PathLike


def _as_files(path_or_files: PathLike | Sequence[PathLike] | Mapping[str, Any]) -> dict[str, list[str]]:
    if isinstance(path_or_files, Mapping):
        return {split: _as_files(files)["train"] for split, files in path_or_files.items()}
    if isinstance(path_or_files, (str, os.PathLike)):
        return {"train": [os.fspath(path_or_files)]}
    return {"train": [os.fspath(p) for p in path_or_files]}


def _builder(files: list[str]) -> str:
    kinds = set()
    for file in files:
        suffix = Path(file).suffix.lower()
        if suffix not in _BUILDERS:
            raise ValueError(f"{file}: unsupported extension {suffix!r}; expected one of {sorted(_BUILDERS)}")
        kinds.add(_BUILDERS[suffix])
    if len(kinds) > 1:
        raise ValueError(f"cannot mix json and parquet files in one load: {files}")
    return kinds.pop()


def _flat_fields(record: Mapping[str, Any], prefix: str = "") -> list[str]:
    names = []
    for key, value in record.items():
        names.append(prefix + key)
        if isinstance(value, Mapping):
            names += _flat_fields(value, prefix + key + ".")
    return names


def _get_field(record: Mapping[str, Any], dotted: str):
    value: Any = record
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def _prompt_text(value: Any, field: str) -> str:
    """A string prompt, or the content of the last user message of a chat-message list."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, Mapping) for m in value):
        users = [m.get("content") for m in value if m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
    raise ValueError(
        f"field {field!r} is neither a string nor a list of chat messages with a user turn (got {type(value).__name__})"
    )


def _read_rows(builder: str, file: str):
    """Rows of one file as dicts: a `datasets.Dataset`, or a list where `datasets` is not installed.
    ValueError naming the file (and the line, for JSON) when it cannot be read."""
    try:
        import datasets  # lazy: only data loading needs it, and some machines lack the package
    except ImportError:
        return _read_rows_plain(builder, file)
    with _quiet(datasets):
        try:
            return datasets.load_dataset(builder, data_files={"train": [file]}, split="train")
        except Exception as err:  # datasets wraps the reader's error in its own; find the bad line ourselves
            if builder == "json":
                _read_rows_plain(builder, file)
            raise ValueError(f"{file}: cannot be read as {builder} records: {_innermost(err)}") from None


@contextlib.contextmanager
def _quiet(datasets):
    """Silences datasets' log (its error lines repeat the one error this module raises) and its
    progress bars (a bar left without a newline would run into that error's line)."""
    log, bars = logging.getLogger("datasets"), not datasets.are_progress_bars_disabled()
    level = log.level
    log.setLevel(logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        log.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def _innermost(err: BaseException) -> str:
    while err.__cause__ is not None:
        err = err.__cause__
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"


def _read_rows_plain(builder: str, file: str) -> list[dict]:
    if builder == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(file).to_pylist()
    with open(file, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{file}: line {err.lineno}: not valid JSON ({err.msg}, column {err.colno})") from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{file}: line {number}: not valid JSON ({err.msg}, column {err.colno})") from None
    return rows


def _where(builder: str, file: str, row: int) -> str:
    """Where record `row` (0-based) of `file` is: its line in a JSON-lines file, else its number."""
    if builder == "json":
        with open(file, encoding="utf-8") as f:
            text = f.read()
        if not text.lstrip().startswith("["):
            lines = [number for number, line in enumerate(text.splitlines(), 1) if line.strip()]
            return f"{file}: line {lines[row]}"
    return f"{file}: record {row + 1}"


def load_prompts(
    path_or_files: PathLike | Sequence[PathLike] | Mapping[str, Any],
    prompt_field: str = "question",
    answer_field: str = "answer",
    split: str | None = None,
) -> list[dict]:
    """Reads prompt records: [{"prompt": str, "answer": str (canonical)}] in file order.

    path_or_files: one file, a list of files, or {split_name: file(s)}; .json/.jsonl/.parquet.
    split: which split of a {split: files} mapping to read (default: the only one, else "train").
    Raises FileNotFoundError for a missing file, ValueError for an empty file, an unknown split, or a
    field missing from the data (the message lists the fields that exist).
    """
    splits = _as_files(path_or_files)
    if split is None:
        split = next(iter(splits)) if len(splits) == 1 else "train"
    if split not in splits:
        raise ValueError(f"split {split!r} not among the given splits {sorted(splits)}")
    files = splits[split]
    if not files:
        raise ValueError(f"split {split!r}: no data files given")
    for file in files:
        if not os.path.isfile(file):
            raise FileNotFoundError(f"data file not found: {file}")
        if os.path.getsize(file) == 0:
            raise ValueError(f"data file is empty: {file}")
    builder = _builder(files)
    records = []
    for file in files:
        records += _records(builder, file, prompt_field, answer_field)
    if not records:
        raise ValueError(f"no records in {', '.join(files)}")
    return records


def _records(builder: str, file: str, prompt_field: str, answer_field: str) -> list[dict]:
    """The prompt records of one file; ValueError naming the file, line or record, and field of the
    first one that lacks a field or has it null or empty."""
    rows = _read_rows(builder, file)
    records = []
    for i, row in enumerate(rows):
        values = {}
        for field in (prompt_field, answer_field):
            try:
                values[field] = _get_field(row, field)
            except KeyError:
                values[field] = None
            if values[field] is None:
                available = list(dict.fromkeys(name for r in rows for name in _flat_fields(r)))
                if field not in available:
                    raise ValueError(f"field {field!r} not found in {file}; available fields: {available}")
                raise ValueError(f"{_where(builder, file, i)}: the record has no {field!r} (or it is null)")
        answer = extract_answer(str(values[answer_field]), fallback="whole")
        if answer is None:
            raise ValueError(f"{_where(builder, file, i)}: the record's {answer_field!r} is empty")
        try:
            prompt = _prompt_text(values[prompt_field], prompt_field)
        except ValueError as err:
            raise ValueError(f"{_where(builder, file, i)}: {err}") from None
        records.append({"prompt": prompt, "answer": normalize_answer(answer)})
    return records
