"""benchmarks/grpo_compare.py: step-time medians, speedups and validation-curve gaps of GRPO runs."""

import json
import sys

import pytest

from tests.benchmarks.scripts import load_script

grpo_compare = load_script("grpo_compare")


def write_run(path, step_s, generation_s, accuracy, compiles_at=(), acceptance=1.0, cut_at=()):
    """A run's metrics.jsonl: validation at steps 0, 10, ... (`accuracy`), 10 training steps per eval;
    cut_at: steps where one answer in 128 ran to the cap."""
    rows = []
    for i, acc in enumerate(accuracy):
        rows.append({"step": 10 * i, "eval_accuracy": acc})
        if i == len(accuracy) - 1:
            break
        for step in range(10 * i + 1, 10 * i + 11):
            compiles = 1 if step in compiles_at else 0
            rows.append(
                {
                    "step": step,
                    "time_step_s": step_s + 100.0 * compiles,
                    "time_generation_s": generation_s,
                    "time_logprob_s": 0.1,
                    "time_train_s": 0.3,
                    "compiles": compiles,
                    "reward_mean": 0.5,
                    "acceptance_length": acceptance,
                    "response_length_mean": 200.0,
                    "truncated_frac": 1 / 128 if step in cut_at else 0.0,
                }
            )
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_accuracy_gap_over_shared_steps():
    base = [(0, 0.5), (10, 0.52), (20, 0.54), (30, 0.50)]
    run = [(0, 0.5), (10, 0.50), (20, 0.58), (30, 0.60)]
    gap = grpo_compare.accuracy_gap(run, base, {10, 20})
    assert gap["accuracy_gap_mean"] == pytest.approx(0.03)
    assert gap["accuracy_gap_max"] == pytest.approx(0.04)
    assert gap["accuracy_last5"] == pytest.approx(0.54)
    assert grpo_compare.accuracy_gap(run, base, set()) == {
        "accuracy_gap_mean": None,
        "accuracy_gap_max": None,
        "accuracy_last5": None,
    }


def test_summary_skips_warmup_and_compiling_steps(tmp_path):
    run = write_run(tmp_path / "a", step_s=1.5, generation_s=1.0, accuracy=[0.5, 0.5, 0.5], compiles_at=(7,))
    summary = grpo_compare.summarize(grpo_compare.load(run))
    assert summary["step_s"] == pytest.approx(1.5)  # step 7's 100 s compile is not a step time
    assert (summary["steps"], summary["timed_steps"], summary["compiling_steps"]) == (18, 17, 1)


def test_warmup_sets_the_first_timed_step(tmp_path, monkeypatch, capsys):
    """--warmup N leaves the first N steps out of the timings (1: a short run's second step is
    timed); a step that compiled stays out whatever N; a negative N is refused."""
    run = write_run(tmp_path / "a", step_s=1.5, generation_s=1.0, accuracy=[0.5, 0.5], compiles_at=(1,))
    rows = grpo_compare.load(run)
    timed = {warmup: sorted(grpo_compare.summarize(rows, warmup=warmup)["answers"]) for warmup in (0, 1, 2)}
    assert timed == {0: list(range(2, 11)), 1: list(range(2, 11)), 2: list(range(3, 11))}
    assert grpo_compare.summarize(rows, warmup=0)["compiling_steps"] == 1
    assert grpo_compare.summarize(rows, warmup=1)["compiling_steps"] == 0
    out = tmp_path / "summary.json"
    monkeypatch.setattr(sys, "argv", ["grpo_compare.py", "--warmup", "1", "--out", str(out), f"a={run}"])
    grpo_compare.main()
    assert "timings over steps 2-10" in capsys.readouterr().out
    assert json.loads(out.read_text())["a"]["timed_steps"] == 9
    monkeypatch.setattr(sys, "argv", ["grpo_compare.py", "--warmup", "-1", "--out", str(out), f"a={run}"])
    with pytest.raises(SystemExit) as refused:
        grpo_compare.main()
    assert refused.value.code == 2 and "--warmup must be >= 0, got -1" in capsys.readouterr().err


def test_main_compares_against_the_first_run(tmp_path, monkeypatch, capsys):
    ar = write_run(tmp_path / "ar", 1.5, 1.0, [0.50, 0.52, 0.54, 0.56])
    spec = write_run(tmp_path / "spec", 1.0, 0.5, [0.50, 0.53, 0.52, 0.58], acceptance=3.5, cut_at=(2, 4, 15, 25))
    short = write_run(tmp_path / "short", 1.2, 0.8, [0.50, 0.52, 0.50])  # two evaluations after step 0
    out = tmp_path / "summary.json"
    monkeypatch.setattr(
        sys, "argv", ["grpo_compare.py", "--out", str(out), f"ar={ar}", f"spec={spec}", f"short={short}"]
    )
    grpo_compare.main()
    result = json.loads(out.read_text())
    assert result["spec"]["step_speedup"] == pytest.approx(1.5)
    assert result["spec"]["generation_speedup"] == pytest.approx(2.0)
    assert result["spec"]["acceptance_length"] == pytest.approx(3.5)
    # gaps over steps 10 and 20, the evaluations after step 0 that every run reached
    assert result["spec"]["accuracy_gap_mean"] == pytest.approx(0.015)
    assert result["spec"]["accuracy_gap_max"] == pytest.approx(0.02)
    assert result["short"]["accuracy_gap_max"] == pytest.approx(0.04)
    assert result["ar"]["accuracy_gap_max"] == 0.0
    assert result["spec"]["cut_steps"] == [4, 15] and result["ar"]["cut_steps"] == []  # timed steps 3-20 only
    printed = capsys.readouterr().out
    assert "timings over steps 3-20" in printed
    assert "spec: answers cut at max_new_tokens in timed steps [4, 15]" in printed


def test_async_runs_report_the_overlap(tmp_path, monkeypatch, capsys):
    """An async step of 1.1 s whose rollout mesh generated for 1.0 s while the trainer scored,
    trained and synced for 0.1 + 0.3 + 0.2 s: overlap 1.1 / max(1.0, 0.6)."""
    run = write_run(tmp_path / "async", step_s=1.1, generation_s=1.0, accuracy=[0.5, 0.5])
    records = grpo_compare.load(run)
    for r in records:
        if "time_step_s" in r:
            r.update(staleness=1, time_sync_s=0.2, time_rollout_wait_s=0.5)
    summary = grpo_compare.summarize(records)
    assert summary["overlap"] == pytest.approx(1.1)
    assert summary["sync_s"] == pytest.approx(0.2) and summary["rollout_wait_s"] == pytest.approx(0.5)
    colocated = write_run(tmp_path / "colocated", 1.5, 1.0, [0.5, 0.5])
    assert "overlap" not in grpo_compare.summarize(grpo_compare.load(colocated))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    monkeypatch.setattr(
        sys, "argv", ["grpo_compare.py", "--out", str(tmp_path / "out.json"), f"colocated={colocated}", f"async={run}"]
    )
    grpo_compare.main()
    assert "async: sync 0.200 s, waits 0.500 s for rollouts, overlap 1.10" in capsys.readouterr().out


def test_missing_metrics_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        grpo_compare.load(tmp_path / "nothing")


def test_tail_speedup_takes_the_longest_answers_draw_out(tmp_path, monkeypatch, capsys):
    """Generation time proportional to each step's longest answer: two runs at the same cost per
    token of it compare 1.0x however differently they drew, while their raw generation ratio
    follows the draw; a run at half the cost per token compares 2.0x."""

    def longest(step):  # 4000-8000 tokens, a different draw every step
        return 4000 + (step * 1237) % 4001

    def write(name, ms_per_token, draw):
        rows = [{"step": 0, "eval_accuracy": 0.5}]
        for step in range(1, 21):
            tokens = draw(step)
            rows.append(
                {
                    "step": step,
                    "time_step_s": 1e-3 * ms_per_token * tokens + 5.0,
                    "time_generation_s": 1e-3 * ms_per_token * tokens,
                    "time_train_s": 5.0,
                    "reward_mean": 0.5,
                    "response_length_mean": 1500.0,
                    "response_length_max": tokens,
                }
            )
        path = tmp_path / name
        path.mkdir()
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return f"{name}={path}"

    runs = [
        write("ar", 1.6, longest),
        write("same_rate_shorter_draw", 1.6, lambda step: longest(step) - 2000),
        write("twice_as_fast", 0.8, lambda step: longest(step) + 1000),
    ]
    out = tmp_path / "summary.json"
    monkeypatch.setattr(sys, "argv", ["grpo_compare.py", "--out", str(out), *runs])
    grpo_compare.main()
    result = json.loads(out.read_text())
    same, fast = result["same_rate_shorter_draw"], result["twice_as_fast"]
    assert same["generation_speedup"] > 1.3  # the draw alone
    assert same["tail_generation_speedup"] == pytest.approx(1.0)
    assert same["generation_ms_per_longest_token"] == pytest.approx(1.6)
    assert fast["tail_generation_speedup"] == pytest.approx(2.0)
    assert fast["generation_speedup"] < 2.0
    assert same["same_answers"] == fast["same_answers"] == 0.0  # other draws
    assert "twice_as_fast: longest answer" in capsys.readouterr().out


def test_same_answers_counts_the_steps_a_run_answered_as_the_baseline(tmp_path, monkeypatch, capsys):
    """A coupled run answers as the baseline does: its share of timed steps with the baseline's
    answers is 1.0; a run whose mean length differs at one of the 18 timed steps has 17/18."""
    ar = write_run(tmp_path / "ar", step_s=2.0, generation_s=1.5, accuracy=[0.5, 0.5, 0.5])
    coupled = write_run(tmp_path / "coupled", step_s=1.5, generation_s=1.0, accuracy=[0.5, 0.5, 0.5])
    other = write_run(tmp_path / "other", step_s=1.5, generation_s=1.0, accuracy=[0.5, 0.5, 0.5])
    rows = [json.loads(line) for line in (other / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        row["response_length_mean"] = 201.0 if row["step"] == 12 else row.get("response_length_mean")
    (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "summary.json"
    monkeypatch.setattr(
        sys, "argv", ["grpo_compare.py", "--out", str(out), f"ar={ar}", f"coupled={coupled}", f"other={other}"]
    )
    grpo_compare.main()
    result = json.loads(out.read_text())
    assert result["coupled"]["same_answers"] == 1.0
    assert result["other"]["same_answers"] == pytest.approx(17 / 18)
    assert "coupled: the baseline's answers in 100% of the timed steps" in capsys.readouterr().out


def test_tail_speedup_is_none_without_the_longest_answer(tmp_path):
    run = write_run(tmp_path / "a", step_s=1.5, generation_s=1.0, accuracy=[0.5, 0.5, 0.5])
    summary = grpo_compare.summarize(grpo_compare.load(run))
    assert summary["generation_ms_per_longest_token"] is None and summary["longest_response"] is None
