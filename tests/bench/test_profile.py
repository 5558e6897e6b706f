"""`jaxspec bench profile` charges every traced kernel of the decode loops to its phase (CPU, tiny assets)."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.bench import profile
from jaxspec.bench.kernel_trace import Kernel

pytestmark = pytest.mark.slow

ASSETS = Path(profile.__file__).resolve().parents[1] / "assets"
REPO = ASSETS.parents[1]


def test_classify_reads_the_loop_scopes():
    assert profile.classify("jit(speculative_decode)/while/body/propose/lm_head/dot_general") == ("propose", "lm_head")
    assert profile.classify("jit(_decode)/while/body/forward/attention/exp") == ("forward", "attention")
    assert profile.classify("jit(speculative_decode)/while/body/add") == ("bookkeeping", "layers")
    assert profile.classify("") == ("unattributed", "layers")


def test_stages_collect_the_kernels_of_their_loops():
    def kernel(op_name, ns, launches):
        return Kernel("spec", "fusion", op_name, ns, launches)

    kernels = [
        kernel("jit(speculative_decode)/stage0/while/body/propose/dot_general", 4e6, 20),
        kernel("jit(speculative_decode)/stage1/while/body/verify_forward/add", 3e6, 30),
        kernel("jit(speculative_decode)/stage1/while/body/verify/exp", 1e6, 10),
        kernel("jit(speculative_decode)/stage_move/gather", 5e6, 1),
    ]
    first, second, third = profile.by_stage(kernels, [8, 4, 2], [2, 4, 0])
    assert (first["rows"], first["ms"], first["ms_per_iteration"], first["kernels_per_iteration"]) == (8, 4, 2, 10)
    assert (second["rows"], second["ms"], second["ms_per_iteration"], second["kernels_per_iteration"]) == (4, 4, 1, 10)
    assert third == {"rows": 2, "iterations": 0, "ms": 0.0, "ms_per_iteration": 0.0, "kernels_per_iteration": 0.0}


def test_profile_runs_on_the_tiny_policy_and_head(tmp_path):
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxspec.cli",
            "bench",
            "profile",
            "--policy",
            str(ASSETS / "tiny-policy"),
            "--draft",
            str(ASSETS / "tiny-eagle3"),
            "--batch",
            "4",
            "--samples",
            "2",
            "--new",
            "8",
            "--levels",
            "1",
            "--k",
            "2",
            "--stage-k",
            "1,2",
            "--stage-trees",
            "2,4:1,2",
            "--trace-dir",
            str(tmp_path / "trace"),
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    stage_tree = "eagle3 tree w=2 n=4 d=1/2 by stage"
    assert set(rows) == {"ar", "eagle3 chain k=2", "eagle3 chain k=1/2 by stage", stage_tree, "ngram chain k=3"}
    ar, spec = rows["ar"], rows["eagle3 chain k=2"]
    assert {"forward", "sample"} <= set(ar["phases_ms"]) and "propose" not in ar["phases_ms"]
    assert {"propose", "verify_forward", "verify", "draft_update"} <= set(spec["phases_ms"])
    assert spec["parts_ms"]["attention"] > 0 and ar["parts_ms"]["attention"] > 0
    for row in rows.values():
        assert row["step_ms"] == pytest.approx(sum(row["phases_ms"].values()))
        assert row["steps"] >= 1 and row["prefill_ms"] > 0 and row["top_kernels"]
        assert row["kernels_per_step"] == pytest.approx(sum(row["phase_kernels_per_step"].values()))
        assert set(row["phase_kernels_per_step"]) == set(row["phases_ms"])
        grouped = sum(g["launches"] for g in row["kernels_by_op_name"])
        (stage,) = row["stages"]  # 4 rows run in one stage
        assert stage["rows"] == 4 and stage["iterations"] == row["steps"]
        assert 0 < stage["ms_per_iteration"] <= row["step_ms"] + 1e-9 and stage["kernels_per_iteration"] > 0
        assert 0 < grouped <= row["kernels_per_step"] + 1e-9
    assert spec["kernels_per_step"] > ar["kernels_per_step"] > 0
    assert ar["step_over_ar"] == 1.0


def test_profile_of_a_random_model_sets_its_parts_against_the_bytes_they_read(tmp_path):
    from jaxspec.bench.decode import kv_read_bytes, weight_read_bytes
    from jaxspec.models import ModelConfig

    out, config = tmp_path / "profile.json", ASSETS / "tiny-policy" / "config.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxspec.cli",
            "bench",
            "profile",
            "--model",
            str(config),
            "--batch",
            "2",
            "--prompt",
            "16",
            "--new",
            "8",
            "--k",
            "--copy-bytes",
            str(1 << 20),
            "--trace-dir",
            str(tmp_path / "trace"),
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    (row,) = result["rows"]  # --k with no depth: the AR loop alone
    assert row["config"] == "ar" and row["steps"] == 7  # every row decodes --new tokens: no eos
    cfg, roof = ModelConfig.from_json(config), row["roofline"]
    assert roof["weights_gb"] == pytest.approx(weight_read_bytes(cfg, 2, 2) / 1e9)
    assert roof["kv_gb"] == pytest.approx(kv_read_bytes(cfg, 2, 16, 8, 2) / 1e9)
    parts = row["parts_ms"]
    assert roof["weights_tb_s"] == pytest.approx(roof["weights_gb"] / (parts["layers"] + parts["lm_head"]))
    assert roof["attention_tb_s"] == pytest.approx(roof["kv_gb"] / parts["attention"])
    assert roof["step_frac"] == pytest.approx(roof["copy_bound_ms"] / row["step_ms"])
    assert 0 < roof["attention_frac"] <= 1 and 0 < roof["weights_frac"] <= 1
    assert result["baseline"]["copy_TBps_in_loop"] == pytest.approx(roof["copy_tb_s"])


def test_a_random_model_drafts_with_a_random_head_of_the_asked_vocabulary():
    args = argparse.Namespace(
        model=str(ASSETS / "tiny-policy" / "config.json"),
        policy=None,
        batch=3,
        prompt=5,
        new=4,
        k=[1, 3],
        draft_vocab=64,
        dtype="float32",
    )
    cfg, _, prompts, sampling, configs = profile._workload(args)
    assert [label for label, _ in configs] == ["ar", "eagle3 chain k=1, random head", "eagle3 chain k=3, random head"]
    assert np.shape(prompts) == (3, 5) and sampling.eos_ids(cfg.eos_token_id) == () and sampling.max_new_tokens == 4
    (_, ar), (_, k1), (_, k3) = configs
    dcfg, _ = k3.draft
    assert ar is None and (k1.num_draft_tokens, k3.num_draft_tokens) == (1, 3) and dcfg.draft_vocab_size == 64


def test_profile_refuses_a_process_that_already_used_jax():
    jnp.zeros(1).block_until_ready()
    with pytest.raises(ValueError, match="before anything in this process has used JAX"):
        profile.main(["--policy", str(ASSETS / "tiny-policy")])
