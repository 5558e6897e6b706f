"""`jaxspec bench spec` runs end to end on CPU with the embedded tiny policy and head: every
configuration generates the same prompts, and each row reports its loop's stages."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxspec
from jaxspec.cli import main

pytestmark = pytest.mark.slow

ASSETS = Path(jaxspec.__file__).parent / "assets"


def test_bench_spec_smoke(tmp_path):
    out = tmp_path / "spec.json"
    assert (
        main(
            [
                "bench",
                "spec",
                "--policy",
                str(ASSETS / "tiny-policy"),
                "--draft",
                str(ASSETS / "tiny-eagle3"),
                "--batch",
                "4",
                "--new",
                "16",
                "--k",
                "2",
                "--trees",
                "--stage-k",
                "2,3",
                "--stage-trees",
                "2,4:1,2",
                "--levels",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["benchmark"] == "spec" and result["baseline"]["max_new_tokens"] == 16
    rows = {r["config"]: r for r in result["rows"]}
    stage_tree = "eagle3 tree w=2 n=4 d=1/2 by stage"
    assert set(rows) == {"ar", "eagle3 chain k=2", "eagle3 chain k=2/3 by stage", stage_tree, "ngram chain k=3"}
    assert rows["ar"]["speedup"] == 1.0 and rows["ar"]["acceptance_length"] == 1.0
    assert rows["ar"]["throughput_speedup"] == 1.0
    for row in rows.values():
        assert row["batch"] == 4 and 4 <= row["tokens"] <= 4 * 16
        assert len(row["stage_rows"]) == len(row["stage_steps"]) >= 1 and row["stage_rows"][0] == 4
        assert row["step_ms"] == pytest.approx(1e3 * row["seconds"] / max(sum(row["stage_steps"]), 1))
        assert row["throughput_speedup"] == pytest.approx(row["tokens_per_s"] / rows["ar"]["tokens_per_s"])
        assert row["first_call_seconds"] > row["seconds"]  # the first call compiles
    assert len(rows["eagle3 chain k=2"]["acceptance_per_position"]) == 2
    # A batch of 4 runs in one stage, which drafts the first depth only.
    assert len(rows["eagle3 chain k=2/3 by stage"]["acceptance_per_position"]) == 2
    assert len(rows[stage_tree]["acceptance_per_position"]) == 1 and rows[stage_tree]["acceptance_length"] > 1.0
    # one stage of a k=2 chain: tokens per step = 1 + r0 + r0 * r1 (step i + 1 is tested iff i accepted)
    chain = rows["eagle3 chain k=2"]
    rates = np.nan_to_num(np.asarray(chain["acceptance_per_position"], np.float64))  # NaN: never tested
    assert chain["acceptance_length"] == pytest.approx(1 + rates[0] + rates[0] * rates[1], rel=1e-4)


def test_bench_prompts_repeat_each_problem_as_a_group():
    from jaxspec.bench.spec import bench_prompts
    from jaxspec.tasks import ChatTokenizer

    tok = ChatTokenizer.from_file(ASSETS / "tiny-policy")
    prompts = bench_prompts(tok, 6, 3, seed=0, levels=[1])
    assert len(prompts) == 6 and prompts[0] == prompts[1] == prompts[2]
    assert prompts[3] == prompts[4] == prompts[5] != prompts[0]
    assert bench_prompts(tok, 2, 1, seed=0, levels=[1]) == [prompts[0], prompts[3]]
    with pytest.raises(ValueError, match="--batch 6 is not a positive multiple of --samples 4"):
        bench_prompts(tok, 6, 4, seed=0, levels=[1])


def test_bench_spec_draws_prompts_from_a_data_config(tmp_path):
    """--data-config configs/pretrain_long.yaml: the long-answer workload's questions (tally problems)."""
    from jaxspec.bench.spec import bench_prompts
    from jaxspec.tasks import ChatTokenizer, TallyConfig

    tok = ChatTokenizer.from_file(ASSETS / "tiny-policy")
    prompts = bench_prompts(tok, 4, 2, seed=0, levels=[1], kinds=("tally",), tally=TallyConfig())
    assert prompts[0] == prompts[1] != prompts[2] == prompts[3]
    assert all(tok.decode(ids).rstrip().endswith("days?") for ids in prompts)
    out = tmp_path / "spec.json"
    assert (
        main(
            [
                "bench",
                "spec",
                "--policy",
                str(ASSETS / "tiny-policy"),
                "--draft",
                str(ASSETS / "tiny-eagle3"),
                "--batch",
                "2",
                "--new",
                "4",
                "--k",
                "--trees",
                "--no-ngram",
                "--data-config",
                "configs/pretrain_long.yaml",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    baseline = json.loads(out.read_text())["baseline"]
    assert baseline["kinds"] == ["tally"] and baseline["data_config"] == "configs/pretrain_long.yaml"
    assert baseline["tally"]["variation"] == 0.5


def test_bench_spec_draft_model_rows(tmp_path):
    """`--draft-model` adds a draft_model chain per `--draft-model-k`; the tiny policy drafts for
    itself here, so (drafts greedy, verification at T=1) most of its drafts are accepted."""
    out = tmp_path / "spec.json"
    assert (
        main(
            [
                "bench",
                "spec",
                "--policy",
                str(ASSETS / "tiny-policy"),
                "--draft",
                str(ASSETS / "tiny-eagle3"),
                "--draft-model",
                str(ASSETS / "tiny-policy"),
                "--draft-model-k",
                "2",
                "--batch",
                "4",
                "--new",
                "16",
                "--k",
                "--trees",
                "--no-ngram",
                "--levels",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["baseline"]["draft_model"] == str(ASSETS / "tiny-policy")
    rows = {r["config"]: r for r in result["rows"]}
    assert set(rows) == {"ar", "draft_model chain k=2"}
    assert len(rows["draft_model chain k=2"]["acceptance_per_position"]) == 2
    assert rows["draft_model chain k=2"]["acceptance_length"] > 1.5


def test_bench_spec_rejects_a_draft_model_with_another_vocabulary(tmp_path, capsys):
    from jaxspec.models import ModelConfig, load_hf, save_hf
    from tests.models.hf_reference import random_params

    cfg, _ = load_hf(ASSETS / "tiny-policy")
    other = ModelConfig(
        family="qwen3",
        vocab_size=cfg.vocab_size + 1,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=64,
    )
    save_hf(other, random_params(other, jax.random.key(0)), tmp_path / "other")
    assert (
        main(
            [
                "bench",
                "spec",
                "--policy",
                str(ASSETS / "tiny-policy"),
                "--draft",
                str(ASSETS / "tiny-eagle3"),
                "--draft-model",
                str(tmp_path / "other"),
                "--batch",
                "4",
                "--new",
                "4",
                "--levels",
                "1",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert f"--draft-model {tmp_path / 'other'}: vocabulary of {cfg.vocab_size + 1} tokens" in err
    assert f"the policy's has {cfg.vocab_size}" in err


def test_rollout_summary_grades_answers_and_estimates_entropy_from_the_sampled_tokens():
    from jaxspec.bench.spec import bench_problems, rollout_summary
    from jaxspec.tasks import ChatTokenizer

    tok = ChatTokenizer.from_file(ASSETS / "tiny-policy")
    problems = bench_problems(2, 1, seed=0, levels=[1])
    right = tok.encode_response(problems[0]["solution"])
    wrong = tok.encode(f"So the answer is \\boxed{{{int(float(problems[1]['answer'])) + 1}}}.")
    width = max(len(right), len(wrong)) + 3
    tokens = np.zeros((2, width), np.int32)
    tokens[0, : len(right)], tokens[1, : len(wrong)] = right, wrong
    lengths = np.array([len(right), len(wrong)], np.int32)
    logprobs = np.zeros((2, width), np.float32)
    logprobs[0, : len(right)], logprobs[1, : len(wrong)] = -0.5, -2.0
    summary = rollout_summary(tok, problems, tokens, logprobs, lengths)
    assert summary["accuracy"] == 0.5  # the reference solution scores 1, an answer off by one 0
    assert summary["nats_per_token"] == pytest.approx((0.5 * len(right) + 2.0 * len(wrong)) / lengths.sum())
    assert summary["lengths"] == lengths.tolist() and summary["length_max"] == lengths.max()


def test_bench_spec_runs_every_configuration_on_the_slot_engine_too(tmp_path):
    out = tmp_path / "spec.json"
    argv = ["bench", "spec", "--policy", str(ASSETS / "tiny-policy"), "--draft", str(ASSETS / "tiny-eagle3")]
    argv += ["--batch", "4", "--new", "16", "--k", "2", "--trees", "--no-ngram", "--levels", "1"]
    assert main([*argv, "--slots", "2", "--out", str(out)]) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"ar", "eagle3 chain k=2", "ar slots=2", "eagle3 chain k=2 slots=2"}
    assert rows["ar"]["slots"] is None and rows["ar slots=2"]["slots"] == 2
    for label in ("ar slots=2", "eagle3 chain k=2 slots=2"):
        assert rows[label]["stage_rows"] == [2] and 4 <= rows[label]["tokens"] <= 4 * 16  # 2 slots, 4 rows
        # the staged autoregressive run stays the baseline
        assert rows[label]["throughput_speedup"] == pytest.approx(
            rows[label]["tokens_per_s"] / rows["ar"]["tokens_per_s"]
        )
    assert rows["eagle3 chain k=2 slots=2"]["acceptance_length"] > 1.0
    assert rows["ar"]["slot_loop"] is None and rows["eagle3 chain k=2"]["slot_loop"] is None
    for label in ("ar slots=2", "eagle3 chain k=2 slots=2"):
        loop = rows[label]["slot_loop"]
        # every decode step counted at one width; the default pool holds every slot's longest row
        assert loop["step_widths"] == [2] and sum(loop["width_steps"]) == sum(rows[label]["stage_steps"]) > 0
        assert loop["preemptions"] == 0 and 0 < loop["peak_kv_pages"] <= loop["kv_pages"]
    assert main([*argv, "--slots", "2", "--staged-ar-only", "--out", str(out)]) == 0
    assert [r["config"] for r in json.loads(out.read_text())["rows"]] == [
        "ar",
        "ar slots=2",
        "eagle3 chain k=2 slots=2",
    ]


def test_bench_spec_runs_the_staged_engine_in_sub_batches_and_the_slots_on_a_given_pool(tmp_path):
    out = tmp_path / "spec.json"
    argv = ["bench", "spec", "--policy", str(ASSETS / "tiny-policy"), "--draft", str(ASSETS / "tiny-eagle3")]
    argv += ["--batch", "4", "--new", "16", "--k", "2", "--trees", "--no-ngram", "--levels", "1"]
    # 8 decode steps between two rounds of scheduling: at the engine's default of 16 this pool
    # happens not to run short, and the preemption below would go untested
    argv += ["--sub-batch", "2", "--slots", "4", "--kv-pages", "5", "--decode-steps", "8"]
    assert main([*argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["config"]: r for r in result["rows"]}
    assert result["baseline"]["sub_batch"] == 2 and result["baseline"]["kv_pages"] == 5
    assert result["baseline"]["decode_steps"] == 8
    for label in ("ar", "eagle3 chain k=2"):  # two calls of two rows, one after another
        assert len(rows[label]["lengths"]) == 4
        assert sum(rows[label]["stage_steps"]) == int(round(rows[label]["seconds"] * 1e3 / rows[label]["step_ms"]))
    assert rows["eagle3 chain k=2"]["acceptance_length"] > 1.0
    assert rows["ar slots=4"]["stage_rows"] == [4] and len(rows["ar slots=4"]["lengths"]) == 4
    for label in ("ar slots=4", "eagle3 chain k=2 slots=4"):
        loop = rows[label]["slot_loop"]
        assert loop["kv_pages"] == 5 and loop["peak_kv_pages"] == 5  # 4 rows need more: the pool fills
    # a draft-and-verify step needs pages for its draft too: on this pool the speculative rows run short
    assert rows["eagle3 chain k=2 slots=4"]["slot_loop"]["preemptions"] > 0


def test_generate_rows_joins_the_sub_batches_as_one_rollout():
    from jaxspec.bench.spec import generate_rows
    from jaxspec.models import load_hf
    from jaxspec.rollout import Sampling, generate

    cfg, params = load_hf(ASSETS / "tiny-policy", dtype="float32")
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    sampling = Sampling(temperature=1.0, max_new_tokens=8)
    key = jax.random.key(3)
    joined = generate_rows(cfg, params, prompts, key, sampling, None, None, None, 2)
    for i in range(2):
        part = generate(cfg, params, prompts[2 * i : 2 * i + 2], jax.random.fold_in(key, i), sampling)
        np.testing.assert_array_equal(joined.tokens[2 * i : 2 * i + 2], part.tokens)
        np.testing.assert_array_equal(joined.lengths[2 * i : 2 * i + 2], part.lengths)
    assert joined.stats["generated_tokens"] == int(joined.lengths.sum())
    with pytest.raises(ValueError, match="--sub-batch 3 does not divide the batch of 4 rows"):
        generate_rows(cfg, params, prompts, key, sampling, None, None, None, 3)


def test_bench_spec_suffix_and_hybrid_drafts_on_both_engines(tmp_path):
    """--suffix adds group-suffix chains and hybrid EAGLE-3 + suffix trees; with groups of 2 rows
    of a prompt, the suffix drafts read the sibling's answer and are accepted."""
    out = tmp_path / "spec.json"
    argv = ["bench", "spec", "--policy", str(ASSETS / "tiny-policy"), "--draft", str(ASSETS / "tiny-eagle3")]
    argv += ["--batch", "4", "--samples", "2", "--new", "16", "--k", "--trees", "--no-ngram", "--levels", "1"]
    assert main([*argv, "--suffix", "--slots", "2", "--out", str(out)]) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    labels = ("suffix chain k=3", "hybrid eagle3+suffix k=3")
    assert set(rows) == {"ar", *labels, "ar slots=2", *(f"{label} slots=2" for label in labels)}
    for label in (*labels, *(f"{label} slots=2" for label in labels)):
        assert len(rows[label]["lengths"]) == 4 and rows[label]["acceptance_length"] >= 1.0, rows[label]
    assert rows["hybrid eagle3+suffix k=3"]["acceptance_length"] > 1.0


def test_bench_spec_random_head_and_adaptive_chains(tmp_path):
    """--random-draft adds chains drafted by a random head of the trained one's shape, --adaptive
    every chain with Spec.adaptive; with a cost model in which a drafted token costs 5 decode steps,
    the adaptive chains fall back to autoregressive iterations (depth 0), the fixed ones never do."""
    out = tmp_path / "spec.json"
    argv = ["bench", "spec", "--policy", str(ASSETS / "tiny-policy"), "--draft", str(ASSETS / "tiny-eagle3")]
    argv += ["--batch", "4", "--new", "24", "--k", "2", "--trees", "--no-ngram", "--levels", "1"]
    argv += ["--random-draft", "--adaptive", "--verify-token-cost", "5"]
    assert main([*argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["config"]: r for r in result["rows"]}
    heads = ("eagle3", "eagle3-random")
    assert set(rows) == {"ar", *(f"{h} chain k=2{a}" for h in heads for a in ("", " adaptive"))}
    assert result["baseline"]["random_draft"] is True
    for head in heads:
        fixed, adaptive = rows[f"{head} chain k=2"], rows[f"{head} chain k=2 adaptive"]
        assert fixed["fallback_steps"] == fixed["depth_steps"][0] == 0
        assert adaptive["fallback_steps"] == adaptive["depth_steps"][0] > sum(adaptive["depth_steps"][1:])
    assert rows["eagle3 chain k=2"]["acceptance_length"] > rows["eagle3-random chain k=2"]["acceptance_length"]


def test_bench_spec_writes_each_row_as_it_finishes(tmp_path, monkeypatch):
    """A run cut short (here: the second configuration fails) leaves the rows before it in --out."""
    from jaxspec.bench import spec as bench_spec

    calls = []
    real = bench_spec.generate_rows

    def failing_after_ar(*args, **kwargs):
        calls.append(args[5])  # spec: None for the AR run, which runs twice (warm-up and timed)
        if args[5] is not None:
            raise RuntimeError("cut short")
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_spec, "generate_rows", failing_after_ar)
    out = tmp_path / "spec.json"
    argv = ["bench", "spec", "--policy", str(ASSETS / "tiny-policy"), "--draft", str(ASSETS / "tiny-eagle3")]
    argv += ["--batch", "2", "--new", "4", "--k", "1", "--levels", "1", "--no-ngram", "--out", str(out)]
    assert main(argv) != 0  # the CLI reports the error and exits non-zero
    assert calls[:2] == [None, None] and calls[2] is not None
    rows = json.loads(out.read_text())["rows"]
    assert [r["config"] for r in rows] == ["ar"]


def test_bench_spec_coupled_rows_are_the_autoregressive_rows(tmp_path, capsys):
    """--coupled in float32: every configuration, on the staged engine and on slots, samples the
    autoregressive run's rows (rows_as_ar 1.0); the second row times the autoregressive run with the
    default draws against it (other rows: no agreement reported); --stochastic beside it is refused."""
    out = tmp_path / "spec.json"
    common = ["bench", "spec", "--policy", str(ASSETS / "tiny-policy"), "--draft", str(ASSETS / "tiny-eagle3")]
    common += ["--batch", "4", "--new", "16", "--levels", "1", "--dtype", "float32", "--coupled"]
    assert main([*common, "--k", "2", "--trees", "--slots", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["baseline"]["coupled"] is True
    default, rows = result["rows"][1], result["rows"][:1] + result["rows"][2:]
    assert default["config"] == "ar default draws" and default["rows_as_ar"] is None
    assert default["acceptance_length"] == 1.0 and default["speedup"] > 0
    assert len(rows) >= 6 and {r["slots"] for r in rows} == {None, 2}
    assert all(r["rows_as_ar"] == r["prefix_as_ar"] == 1.0 for r in rows), [
        (r["config"], r["rows_as_ar"]) for r in rows
    ]
    assert rows[0]["speedup"] == 1.0  # the coupled autoregressive run is the baseline
    assert any(r["acceptance_length"] > 1.0 for r in rows)
    capsys.readouterr()
    assert main([*common, "--stochastic"]) == 2
    assert "--coupled needs deterministic drafts" in capsys.readouterr().err


def test_agreement_counts_equal_rows_and_the_prefix_before_the_first_difference():
    from jaxspec.bench.spec import agreement

    reference = np.array([[1, 2, 3, 4], [1, 2, 3, 4]])
    assert agreement(reference, reference) == {"rows_as_ar": 1.0, "prefix_as_ar": 1.0}
    assert agreement(reference, np.array([[1, 2, 3, 4], [1, 2, 0, 4]])) == {"rows_as_ar": 0.5, "prefix_as_ar": 0.75}
