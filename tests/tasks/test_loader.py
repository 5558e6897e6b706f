import importlib.util
import json
import sys

import pytest

from jaxspec.tasks import generate_problems, load_prompts, write_dataset


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_generated_files_jsonl_and_parquet(tmp_path):
    problems = generate_problems(20, seed=4, levels=(3, 4))
    jsonl = write_dataset(tmp_path / "p.jsonl", 20, seed=4, levels=(3, 4))
    records = load_prompts(jsonl)
    assert [r["prompt"] for r in records] == [p["question"] for p in problems]
    assert [r["answer"] for r in records] == [p["answer"] for p in problems]
    pytest.importorskip("pyarrow")
    parquet = write_dataset(tmp_path / "p.parquet", 20, seed=4, levels=(3, 4))
    assert load_prompts(parquet) == records


def test_gsm8k_style(tmp_path):
    path = _write_jsonl(
        tmp_path / "gsm8k.jsonl",
        [
            {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
            {"question": "A big sum?", "answer": "Add them.\n#### 1,234"},
        ],
    )
    records = load_prompts(path, prompt_field="question", answer_field="answer")
    assert records == [
        {"prompt": "Tom has 3 apples and buys 4 more. How many?", "answer": "7"},
        {"prompt": "A big sum?", "answer": "1234"},
    ]


def test_math_style(tmp_path):
    path = _write_jsonl(
        tmp_path / "math.jsonl",
        [
            {
                "problem": "Compute $\\frac{3}{8} + \\frac{3}{8}$.",
                "level": "Level 2",
                "type": "Prealgebra",
                "solution": "We add: $\\frac{3}{8}+\\frac{3}{8} = \\boxed{\\frac{3}{4}}$.",
            },
            {
                "problem": "What is $\\sqrt{2}\\cdot 1$?",
                "level": "Level 1",
                "type": "Algebra",
                "solution": "It is $\\boxed{\\sqrt{2}}$.",
            },
        ],
    )
    records = load_prompts(path, prompt_field="problem", answer_field="solution")
    assert [r["answer"] for r in records] == ["3/4", "\\sqrt{2}"]
    assert records[0]["prompt"].startswith("Compute")


def test_dapo_style_dotted_fields_and_chat_prompts(tmp_path):
    rows = [
        {
            "data_source": "math_dapo",
            "prompt": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Solve 2+2. Put the answer after 'Answer:'."},
            ],
            "reward_model": {"ground_truth": "4", "style": "rule-math"},
        },
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": "Half of 3?"}],
            "reward_model": {"ground_truth": "\\frac{3}{2}", "style": "rule-math"},
        },
    ]
    path = _write_jsonl(tmp_path / "dapo.jsonl", rows)
    records = load_prompts(path, prompt_field="prompt", answer_field="reward_model.ground_truth")
    assert records == [
        {"prompt": "Solve 2+2. Put the answer after 'Answer:'.", "answer": "4"},
        {"prompt": "Half of 3?", "answer": "3/2"},
    ]


def test_several_files_and_splits(tmp_path):
    a = write_dataset(tmp_path / "a.jsonl", 5, seed=1)
    b = write_dataset(tmp_path / "b.jsonl", 7, seed=2)
    assert len(load_prompts([a, b])) == 12
    splits = {"train": [str(a)], "test": str(b)}
    assert len(load_prompts(splits, split="test")) == 7
    assert len(load_prompts(splits)) == 5
    with pytest.raises(ValueError, match="split 'dev'"):
        load_prompts(splits, split="dev")


def test_errors_name_the_problem(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompts(missing)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty.jsonl"):
        load_prompts(empty)
    path = _write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "reward_model": {"ground_truth": "1"}}])
    with pytest.raises(ValueError, match=r"'answer' not found.*d\.jsonl.*reward_model\.ground_truth"):
        load_prompts(path)
    with pytest.raises(ValueError, match=r"'reward_model\.truth' not found.*'reward_model\.ground_truth'"):
        load_prompts(path, answer_field="reward_model.truth")
    csv = tmp_path / "x.csv"
    csv.write_text("question,answer\nq,1\n")
    with pytest.raises(ValueError, match="x.csv.*extension"):
        load_prompts(csv)


def test_reads_the_same_without_datasets(tmp_path, monkeypatch):
    rows = [
        {"prompt": [{"role": "user", "content": "2+2?"}], "reward_model": {"ground_truth": "4"}},
        {"prompt": [{"role": "user", "content": "half of 3?"}], "reward_model": {"ground_truth": "1.5"}},
    ]
    jsonl = _write_jsonl(tmp_path / "d.jsonl", rows)
    generated = write_dataset(tmp_path / "g.jsonl", 10, seed=0)
    with_datasets = [load_prompts(jsonl, "prompt", "reward_model.ground_truth"), load_prompts(generated)]
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    assert [load_prompts(jsonl, "prompt", "reward_model.ground_truth"), load_prompts(generated)] == with_datasets
    if importlib.util.find_spec("pyarrow") is not None:
        parquet = write_dataset(tmp_path / "g.parquet", 10, seed=0)
        assert load_prompts(parquet) == with_datasets[1]


@pytest.mark.parametrize("with_datasets", [True, False])
def test_a_record_without_its_answer_is_refused_naming_file_line_and_field(tmp_path, monkeypatch, with_datasets):
    if not with_datasets:
        monkeypatch.setitem(sys.modules, "datasets", None)
    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"question": "1+1?", "answer": "2"}\n\n{"question": "2+2?"}\n{"question": "3+3?", "answer": "6"}\n'
    )
    with pytest.raises(ValueError) as err:
        load_prompts(path)
    assert str(err.value) == f"{path}: line 3: the record has no 'answer' (or it is null)"
    path.write_text('{"question": "1+1?", "answer": "2"}\n{"question": null, "answer": "4"}\n')
    with pytest.raises(ValueError) as err:
        load_prompts(path)
    assert str(err.value) == f"{path}: line 2: the record has no 'question' (or it is null)"
    array = tmp_path / "a.json"
    array.write_text(json.dumps([{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": None}]))
    with pytest.raises(ValueError) as err:
        load_prompts(array)
    assert str(err.value) == f"{array}: record 2: the record has no 'answer' (or it is null)"


@pytest.mark.parametrize("with_datasets", [True, False])
def test_a_malformed_line_is_one_error_naming_file_and_line(tmp_path, monkeypatch, capfd, with_datasets):
    if not with_datasets:
        monkeypatch.setitem(sys.modules, "datasets", None)
    good = _write_jsonl(tmp_path / "good.jsonl", [{"question": "1+1?", "answer": "2"}])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": "4"\n')
    with pytest.raises(ValueError) as err:
        load_prompts([good, bad])
    assert str(err.value) == f"{bad}: line 2: not valid JSON (Expecting ',' delimiter, column 35)"
    assert err.value.__cause__ is None and err.value.__suppress_context__  # no chained library traceback
    assert capfd.readouterr().err == ""  # nor datasets' log line or progress bar
