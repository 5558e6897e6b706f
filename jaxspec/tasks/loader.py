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
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

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


def _prompt_text(value: Any, field: str, source: str) -> str:
    """A string prompt, or the content of the last user message of a chat-message list."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, Mapping) for m in value):
        users = [m.get("content") for m in value if m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
    raise ValueError(f"{source}: field {field!r} is neither a string nor a list of chat messages "
                     f"with a user turn (got {type(value).__name__})")


def _read_rows(builder: str, files: list[str], split: str):
    """Rows of the files as dicts: a `datasets.Dataset`, or a list where `datasets` is not installed."""
    try:
        import datasets  # lazy: only data loading needs it, and some machines lack the package
    except ImportError:
        return _read_rows_plain(builder, files)
    return datasets.load_dataset(builder, data_files={split: files}, split=split)


def _read_rows_plain(builder: str, files: list[str]) -> list[dict]:
    rows: list[dict] = []
    for file in files:
        if builder == "parquet":
            import pyarrow.parquet as pq

            rows += pq.read_table(file).to_pylist()
            continue
        with open(file, encoding="utf-8") as f:
            text = f.read()
        if text.lstrip().startswith("["):
            rows += json.loads(text)
        else:
            rows += [json.loads(line) for line in text.splitlines() if line.strip()]
    return rows


def load_prompts(path_or_files: PathLike | Sequence[PathLike] | Mapping[str, Any],
                 prompt_field: str = "question", answer_field: str = "answer",
                 split: str | None = None) -> list[dict]:
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
    dataset = _read_rows(_builder(files), files, split)
    source = ", ".join(files)
    if len(dataset) == 0:
        raise ValueError(f"no records in {source}")
    available = _flat_fields(dataset[0])
    for field in (prompt_field, answer_field):
        if field not in available:
            raise ValueError(f"field {field!r} not found in {source}; available fields: {available}")
    records = []
    for i, row in enumerate(dataset):
        try:
            prompt, raw_answer = _get_field(row, prompt_field), _get_field(row, answer_field)
        except KeyError as e:
            raise ValueError(f"{source}: record {i} lacks field {e.args[0]!r}") from None
        answer = extract_answer(str(raw_answer), fallback="whole")
        if answer is None:
            raise ValueError(f"{source}: record {i} has an empty answer in field {answer_field!r}")
        records.append({"prompt": _prompt_text(prompt, prompt_field, source), "answer": normalize_answer(answer)})
    return records
