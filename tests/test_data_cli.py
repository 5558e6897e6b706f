"""`jaxspec data stats`, run in-process through `jaxspec.cli.main`."""

import json
import re

import pytest

from jaxspec.cli import main

SHORT = ["data.tally.steps.median=8", "data.tally.steps.sigma=0.4", "data.tally.steps.max_steps=20"]


def test_stats_prints_lengths_entropy_and_acceptance(tmp_path, capsys):
    out = tmp_path / "report.json"
    argv = [
        "data",
        "stats",
        "--config",
        "configs/pretrain_long.yaml",
        "--num",
        "40",
        "--max-draft",
        "4",
        "--sweep",
        "0",
        "1",
        "--json",
        str(out),
        *SHORT,
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert re.search(r"^40 problems \(seed 0\) generated in [\d.]+ s; tokenizer: a byte-level BPE", text, re.M)
    assert re.search(
        r"^response tokens \(solution \+ eos\): p10 \d+  p50 \d+  p90 \d+  p99 \d+  max \d+  mean \d+$", text, re.M
    )
    assert re.search(r"^entropy: \d\.\d{3} nats per response token", text, re.M)
    assert re.search(r"^ideal greedy drafter, acceptance length: k=1 [\d.]+±[\d.]+ .* k=4 [\d.]+±[\d.]+$", text, re.M)
    report = json.loads(out.read_text())
    lines = report["solution_lines"]
    assert 5 <= lines["p10"] <= lines["max"] <= 22  # start + days + answer, 3 <= days <= 20
    assert sum(count for _, _, count in report["histogram"]) == 40
    zero, one = report["sweep"]
    assert (zero["variation"], one["variation"]) == (0.0, 1.0)
    assert zero["entropy_per_token"] == 0.0 and zero["ideal_acceptance"][0] > 1.95
    assert one["entropy_per_token"] > report["analysis"]["entropy_per_token"] > 0
    assert len(one["ideal_acceptance"]) == 4 and one["ideal_acceptance"][2] < report["analysis"]["ideal_acceptance"][2]


def test_stats_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "figures" / "workload.png"
    argv = [
        "data",
        "stats",
        "--config",
        "configs/pretrain_long.yaml",
        "--num",
        "20",
        "--sweep",
        "0.5",
        "--plot",
        str(plot),
        *SHORT,
    ]
    assert main(argv) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"figures: {plot}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sweep", "1.5"], "--sweep: variation values must be in [0, 1], got [1.5]"),
        (["--num", "0"], "--num must be >= 1, got 0"),
        (
            ["data.tally.variation=2"],
            "command-line override 'data.tally.variation=2': data.tally.variation: must be in",
        ),
        (["data.tally.stepz.median=3"], "unknown key 'data.tally.stepz'"),
        (["--tokenizer", "absent/tokenizer.json"], "--tokenizer: file not found: absent/tokenizer.json"),
    ],
)
def test_bad_input_is_refused_naming_it(args, message, capsys):
    assert main(["data", "stats", "--config", "configs/pretrain_long.yaml", *args]) == 2  # bad input (jaxspec.exits)
    err = capsys.readouterr().err
    assert err.startswith("jaxspec data: error: ") and message in err


def test_usage(capsys):
    assert main(["data"]) == 2
    assert "usage: jaxspec data {stats}" in capsys.readouterr().err
    assert main(["data", "plot"]) == 2
    assert main(["data", "--help"]) == 0
    assert main(["data", "stats", "--config", "missing.yaml"]) == 2
    assert "config file not found: missing.yaml" in capsys.readouterr().err
