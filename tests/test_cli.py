"""Smoke tests of the `jaxspec` command line, run in-process through `jaxspec.cli.main`."""

import contextlib
import io
import json
import re

import pytest

from jaxspec.assets import tiny_eagle3_path
from jaxspec.bench.forward import forward_flops_per_token
from jaxspec.cli import BENCHMARKS, COMMANDS, main
from jaxspec.exits import EXIT_INPUT
from jaxspec.models import ModelConfig

TINY_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
# Greedy, so a speculative run must print exactly the same responses.
GENERATE = ["generate", "--num-problems", "3", "--max-new-tokens", "24", "--temperature", "0", "--show", "3"]
SUMMARY = re.compile(
    r"^3 responses, mean reward (\d\.\d{3}), (\d+) tokens in [\d.]+ s \(incl\. compilation\), "
    r"acceptance length (\d+\.\d\d)$"
)


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    usage = capsys.readouterr().out
    for name in COMMANDS:
        assert re.search(rf"^  {name} ", usage, re.M), name
    for name in BENCHMARKS:
        assert re.search(rf"^  bench {name} ", usage, re.M), name
    assert main([]) == 2  # no command: usage, but a failure
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0 and "--spec-method" in capsys.readouterr().out


def test_unknown_command_returns_2(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
    assert main(["bench", "frobnicate"]) == 2
    assert "jaxspec bench: expected one of" in capsys.readouterr().err


def test_bench_forward_writes_json(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_CONFIG))
    out = tmp_path / "results" / "forward.json"
    argv = [
        "bench",
        "forward",
        "--model",
        str(config),
        "--batch",
        "1",
        "--seq",
        "16",
        "--iters",
        "1",
        "--matmul-size",
        "64",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    assert "measured bf16 matmul rate" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["benchmark"] == "forward" and result["device"].startswith("cpu")
    assert {"jax", "python"} <= result.keys()
    baseline = result["baseline"]
    assert baseline["model"] == str(config) and baseline["dtype"] == "bfloat16"
    assert baseline["params"] == ModelConfig.from_json(config).num_params() and baseline["matmul_tflops"] > 0
    assert [row["pass"] for row in result["rows"]] == ["forward", "fwd+bwd"]
    flops = forward_flops_per_token(ModelConfig.from_json(config), 16) * 16
    for row, passes in zip(result["rows"], (1, 3)):  # fwd+bwd counts 3 forwards
        assert row["batch"] == 1 and row["seq"] == 16 and row["ms"] > 0
        assert row["tokens_per_s"] == pytest.approx(16 / (row["ms"] / 1e3))
        assert row["mfu"] == pytest.approx(passes * flops / (row["ms"] / 1e3) / (baseline["matmul_tflops"] * 1e12))


def _run(argv: list[str]) -> tuple[int, str, str]:
    """(return code, stdout, stderr) of `jaxspec <argv>`."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _run_generate(extra: list[str]) -> tuple[str, re.Match]:
    """stdout of `jaxspec generate` before its summary line, and the parsed summary."""
    code, out, err = _run(GENERATE + extra)
    assert code == 0, err
    *responses, summary = out.rstrip("\n").split("\n")
    match = SUMMARY.match(summary)
    assert match, summary
    return "\n".join(responses), match


@pytest.fixture(scope="module")
def autoregressive() -> tuple[str, re.Match]:
    """`jaxspec generate` on the embedded tiny policy without speculation."""
    return _run_generate([])


def test_generate_prints_responses_and_mean_reward(autoregressive):
    responses, summary = autoregressive
    rewards = [float(r) for r in re.findall(r"^reward (\S+) \(answer ", responses, re.M)]
    assert len(rewards) == 3 and set(rewards) <= {0.0, 1.0}
    assert float(summary.group(1)) == pytest.approx(sum(rewards) / 3, abs=5e-4)
    assert summary.group(3) == "1.00"
    assert responses.count("Q: ") == 3 and responses.count("A: ") == 3


def test_generate_with_ngram_speculation_prints_the_same_responses(autoregressive):
    responses, summary = _run_generate(["--spec-method", "ngram"])
    assert responses == autoregressive[0]  # greedy speculative decoding is lossless
    assert summary.group(1, 2) == autoregressive[1].group(1, 2)
    assert float(summary.group(3)) >= 1.0


def test_generate_with_hybrid_trees_prints_the_same_responses(autoregressive):
    """--suffix-branches: the embedded head's tree merged with suffix branches (one row per
    problem: they match its own prompt and response)."""
    draft = str(tiny_eagle3_path())
    responses, summary = _run_generate(["--spec-method", "eagle3", "--draft", draft, "--suffix-branches"])
    assert responses == autoregressive[0]
    assert summary.group(1, 2) == autoregressive[1].group(1, 2)
    assert float(summary.group(3)) > 1.0


def test_generate_on_slots_with_adaptive_depth_prints_the_same_responses(autoregressive):
    """--slots and --spec-set: the continuous-batching engine, adaptive n-gram chains whose
    verification cost is given by batch size; greedy, so the responses are the autoregressive ones."""
    extra = ["--spec-method", "ngram", "--slots", "2", "--spec-set", "adaptive=true"]
    extra += ["--spec-set", "verify_token_cost=[[1, 0.0], [64, 0.2]]"]
    responses, summary = _run_generate(extra)
    assert responses == autoregressive[0]
    assert summary.group(1, 2) == autoregressive[1].group(1, 2)


def test_generate_coupled_sampled_speculation_prints_the_autoregressive_responses():
    """--coupled at temperature 1: the EAGLE-3 run prints the autoregressive run's responses (the
    draws depend on the row and position alone); the control without --coupled does not."""
    sampled = ["--temperature", "1", "--seed", "3"]
    draft = ["--spec-method", "eagle3", "--draft", str(tiny_eagle3_path())]
    coupled_ar = _run_generate(sampled + ["--coupled"])
    coupled_spec = _run_generate(sampled + draft + ["--coupled"])
    assert coupled_spec[0] == coupled_ar[0]
    assert float(coupled_spec[1].group(3)) > 1.0
    assert _run_generate(sampled + draft)[0] != _run_generate(sampled)[0]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--policy", "{tmp}/missing"], r"checkpoint folder not found: .*missing"),
        (["--spec-method", "ngram", "--spec-set", "bogus=1"], r"--spec-set 'bogus=1': unknown spec setting 'bogus' .*"),
        (
            ["--spec-method", "ngram", "--spec-set", "tree_width=0"],
            r"--spec-set tree_width: must be an integer >= 1, got 0",
        ),
        (["--spec-set", "adaptive=true"], r"--spec-set needs a --spec-method"),
        (["--slots", "0"], r"--slots must be a positive integer or 'auto', got '0'"),
        (["--spec-method", "eagle3"], r"--draft is required with --spec-method eagle3"),
        (["--spec-method", "ngram", "--suffix-branches"], r"--suffix-branches needs --spec-method eagle3, got ngram"),
        (["--num-problems", "0"], r"--num-problems must be >= 1, got 0"),
        (
            [
                "--spec-method",
                "eagle3",
                "--draft",
                str(tiny_eagle3_path()),
                "--coupled",
                "--spec-set",
                "draft_sampling=stochastic",
            ],
            r"Sampling.coupled needs deterministic drafts: .*",
        ),
    ],
)
def test_generate_bad_argument_is_a_one_line_error(tmp_path, extra, message):
    code, out, err = _run(["generate"] + [a.format(tmp=tmp_path) for a in extra])
    assert code == EXIT_INPUT and out == ""  # as every command's bad input
    lines = err.strip().split("\n")
    assert len(lines) == 1 and re.fullmatch(rf"jaxspec generate: error: {message}", lines[0]), err


def test_the_error_line_starts_a_line_of_its_own_after_a_thread_flushed_part_of_one():
    """A background thread's traceback can reach stderr in pieces (a long message is written
    through): the error line must not be glued to the piece already out."""
    import subprocess
    import sys

    program = (
        "import os, threading, time\n"
        "from jaxspec.cli import _say_last\n"
        "threading.Thread(target=time.sleep, args=(2,), daemon=True).start()\n"
        "os.write(2, b'RuntimeError: ')\n"
        "_say_last('jaxspec train: error: the disk is full')\n"
    )
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[-1] == "jaxspec train: error: the disk is full"
