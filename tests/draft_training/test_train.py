"""`jaxspec draft train` end to end on a tiny random policy folder: rollouts, training, metrics,
checkpoints, export in the public layout, refusal to overwrite, and resume."""

import json
import os
import shutil
import signal

import jax
import numpy as np
import pytest

from jaxspec.cli import main as jaxspec_main
from jaxspec.config_io import load_config
from jaxspec.draft import build_vocab_maps, load_eagle3
from jaxspec.draft_training.config import DraftTrainConfig, validate
from jaxspec.draft_training.data import RolloutBatches, prompt_pool
from jaxspec.models import ModelConfig, load_hf, save_hf
from jaxspec.run import EXIT_CHECKPOINTED
from jaxspec.tasks import generate_problems, train_tokenizer
from jaxspec.tasks.tokenizer import ChatTokenizer
from tests.models.hf_reference import random_params
from tests.run.damage import empty_metadata

CONFIG = "configs/head_tiny.yaml"


@pytest.mark.parametrize("path", ["configs/head_tiny.yaml", "configs/head_tiny_ood.yaml", "configs/head_small.yaml"])
def test_shipped_configs_are_valid(path):
    validate(load_config(DraftTrainConfig, path), path)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    """HF folder of a random 2-layer Qwen3 over a BPE trained on generated problems."""
    folder = tmp_path_factory.mktemp("policy")
    problems = generate_problems(200, seed=0, levels=(1,))
    train_tokenizer((t for p in problems for t in (p["question"], p["solution"])), 300, folder / "tokenizer.json")
    tok = ChatTokenizer.from_file(folder / "tokenizer.json")
    cfg = ModelConfig(
        family="qwen3",
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
    save_hf(cfg, random_params(cfg, jax.random.key(0)), folder / "policy", tokenizer_file=folder / "tokenizer.json")
    return folder / "policy", cfg


def _args(run_dir, policy, *extra):
    return [
        "draft",
        "train",
        "--config",
        CONFIG,
        "--run-dir",
        str(run_dir),
        f"policy={policy}",
        "train.batch_size=8",
        "train.log_every=2",
        "train.checkpoint_every=2",
        "train.progress=false",
        "generation.max_new_tokens=12",
        "data.num_prompts=64",
        "head.vocab_count_batches=2",
        "head.draft_vocab_size=100",
        "loss.num_steps=2",
        "optim.warmup_steps=1",
        "eval.batches=1",
        "data.max_prompt_len=48",
        "eval.data.num_prompts=16",
        "eval.data.max_prompt_len=48",
        "generation.batches_per_call=3",
        *extra,
    ]


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_rollouts_are_sampled_a_group_of_batches_per_call(policy_dir):
    """With batches_per_call=3, steps 3..5 are the three slices of one generate call, and any step
    comes out the same whether or not the steps before it were drawn (resume needs that)."""
    policy, cfg = policy_dir
    run = load_config(
        DraftTrainConfig,
        CONFIG,
        [f"policy={policy}", "generation.max_new_tokens=12", "generation.batches_per_call=3", "data.max_prompt_len=48"],
    )
    tok = ChatTokenizer.from_file(policy)
    params = load_hf(policy)[1]
    pool = prompt_pool(run.data, tok)
    calls = []

    def source():
        src = RolloutBatches(cfg, params, tok, pool, run.generation, run.data.max_prompt_len, 4, seed=7)
        generate_group = src._generate
        src._generate = lambda group: calls.append(group) or generate_group(group)
        return src

    walked = source()
    batches = [walked.batch(s) for s in range(6)]
    assert calls == [0, 1]
    assert all(b.tokens.shape == (4, 48 + 12) for b in batches)
    assert not np.array_equal(batches[3].tokens, batches[4].tokens)
    fresh = source().batch(4)
    for name in ("tokens", "loss_mask", "attn_mask"):
        np.testing.assert_array_equal(getattr(fresh, name), getattr(batches[4], name))


def test_slots_stream_a_call_into_the_staged_engines_rows(policy_dir, monkeypatch):
    """generation.slots=5: a call's 12 rows stream through 5 decode slots and come out as the staged
    engine's rows (float32: the same key gives the same tokens on either engine)."""
    from jaxspec.draft_training import data

    policy, cfg = policy_dir
    overrides = [f"policy={policy}", "generation.max_new_tokens=12", "generation.batches_per_call=3"]
    overrides.append("data.max_prompt_len=48")
    tok = ChatTokenizer.from_file(policy)
    params = load_hf(policy)[1]
    engines = []

    def recorded(*args, **kwargs):
        out = generate(*args, **kwargs)
        engines.append((kwargs["slots"], out.stats.get("slots")))
        return out

    generate = data.generate
    monkeypatch.setattr(data, "generate", recorded)
    batches = {}
    for slots in ("null", "5"):
        run = load_config(DraftTrainConfig, CONFIG, [*overrides, f"generation.slots={slots}"])
        src = RolloutBatches(cfg, params, tok, prompt_pool(run.data, tok), run.generation, 48, 4, seed=7)
        batches[slots] = [src.batch(s) for s in range(3)]
    assert engines == [(None, None), (5, 5)]
    for staged, slotted in zip(batches["null"], batches["5"]):
        for name in ("tokens", "loss_mask", "attn_mask"):
            np.testing.assert_array_equal(getattr(slotted, name), getattr(staged, name))


@pytest.mark.parametrize("slots", ["0", "-2", "many", "true"])
def test_bad_slots_are_refused_by_name(slots):
    with pytest.raises(ValueError, match="generation.slots"):
        validate(load_config(DraftTrainConfig, CONFIG, [f"generation.slots={slots}"]), CONFIG)


def test_train_export_refuse_and_resume_exactly(tmp_path, policy_dir, capsys):
    policy, cfg = policy_dir
    run_dir = tmp_path / "run"
    assert jaxspec_main(_args(run_dir, policy, "train.steps=6")) == 0
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == [2, 4, 6, 6]
    assert len(records[0]["top1_agreement"]) == 2 and len(records[0]["step_loss"]) == 2
    assert len(records[-1]["eval_top1_agreement"]) == 2 and records[-1]["eval_positions"] > 0
    dcfg, first = load_eagle3(run_dir / "draft", policy=cfg)
    assert dcfg.draft_vocab_size == 100 and dcfg.aux_layer_ids == (1, 0, 0)
    d2t, t2d = build_vocab_maps(np.load(run_dir / "token_counts.npy"), 100)  # the generated data's top tokens
    np.testing.assert_array_equal(first["d2t"], d2t)
    np.testing.assert_array_equal(first["t2d"], t2d)

    assert jaxspec_main(_args(run_dir, policy, "train.steps=6")) == 2
    assert "--resume" in capsys.readouterr().err
    assert jaxspec_main(_args(run_dir, policy, "train.steps=6", "head.draft_vocab_size=90", "--resume")) == 2
    assert "head section differs" in capsys.readouterr().err

    # Damage the final checkpoint: resume reports it, moves it aside and restores step 4 (the
    # middle of the rollout group of steps 3..5), which regenerates the same rollouts and ends in
    # bit-identical weights; the metrics of steps 5..6 are written once, as in the first run.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["4", "6"]
    empty_metadata(run_dir / "checkpoints" / "6")
    assert jaxspec_main(_args(run_dir, policy, "train.steps=6", "--resume")) == 0
    out = capsys.readouterr().out
    assert f"checkpoint {run_dir / 'checkpoints' / '6'} is damaged (JSONDecodeError" in out
    assert "resumed from step 4" in out
    assert [p.name.split(".")[0] for p in (run_dir / "checkpoints").iterdir()].count("6") == 2  # new and aside
    resumed_records = _metrics(run_dir)
    assert [r["step"] for r in resumed_records] == [2, 4, 6, 6]
    assert [r.get("loss") for r in resumed_records] == [r.get("loss") for r in records]
    _, resumed = load_eagle3(run_dir / "draft", policy=cfg)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(first)):
        np.testing.assert_array_equal(a, b)

    # Fine-tuning an exported head keeps its vocabulary and moves its weights.
    tuned_dir = tmp_path / "tuned"
    assert jaxspec_main(_args(tuned_dir, policy, "train.steps=6", f"head.init={run_dir / 'draft'}")) == 0
    _, tuned = load_eagle3(tuned_dir / "draft", policy=cfg)
    np.testing.assert_array_equal(tuned["d2t"], first["d2t"])
    assert not np.array_equal(tuned["lm_head"], first["lm_head"])


def test_a_mesh_trains_the_same_steps(tmp_path, policy_dir, capsys):
    """On a (2, 2, 2) mesh (policy sharded, head replicated, rollouts and rows split over 4
    devices) the losses and the exported head match the one-device run up to float summation
    order; the mesh run resumes onto another mesh and ends at the same head."""
    policy, cfg = policy_dir
    single, mesh = tmp_path / "single", tmp_path / "mesh"
    assert jaxspec_main(_args(single, policy, "train.steps=4", "eval.batches=0")) == 0
    assert (
        jaxspec_main(
            _args(mesh, policy, "train.steps=4", "eval.batches=0", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
        )
        == 0
    )
    assert "training on the mesh {'data': 2, 'fsdp': 2, 'tensor': 2}" in capsys.readouterr().out
    losses = [[r["loss"] for r in _metrics(d)] for d in (single, mesh)]
    assert len(losses[0]) == 2
    np.testing.assert_allclose(losses[1], losses[0], rtol=2e-4)
    _, reference = load_eagle3(single / "draft", policy=cfg)

    def assert_head_matches(folder):
        _, ours = load_eagle3(folder, policy=cfg)
        jax.tree_util.tree_map_with_path(
            lambda path, a, b: np.testing.assert_allclose(a, b, atol=2e-4, err_msg=jax.tree_util.keystr(path)),
            ours,
            reference,
        )

    assert_head_matches(mesh / "draft")

    shutil.rmtree(mesh / "checkpoints" / "4")
    shutil.rmtree(mesh / "draft")
    assert jaxspec_main(_args(mesh, policy, "train.steps=4", "eval.batches=0", "mesh.data=4", "--resume")) == 0
    out = capsys.readouterr().out
    assert "training on the mesh {'data': 4, 'fsdp': 1, 'tensor': 1}" in out and "resumed from step 2" in out
    np.testing.assert_allclose([r["loss"] for r in _metrics(mesh)], losses[0], rtol=2e-4)
    assert_head_matches(mesh / "draft")


def test_mesh_must_split_the_batch_and_fit_the_devices(tmp_path, policy_dir, capsys):
    policy, _ = policy_dir
    assert jaxspec_main(_args(tmp_path / "odd", policy, "train.steps=2", "mesh.data=3")) == 2
    assert "train.batch_size: 8 rows do not split over mesh.data x mesh.fsdp = 3 devices" in capsys.readouterr().err
    assert jaxspec_main(_args(tmp_path / "big", policy, "train.steps=2", "train.batch_size=16", "mesh.data=16")) == 2
    assert "mesh: data=16 x fsdp=1 x tensor=1 needs 16 devices, this process sees 8" in capsys.readouterr().err
    assert not (tmp_path / "big").exists()


def test_sigterm_checkpoints_and_resume_writes_each_step_once(tmp_path, policy_dir, monkeypatch, capsys):
    import jaxspec.run.loop as train_module

    class SigtermAtStep3(train_module.Progress):
        def update(self, steps=1, **fields):
            super().update(steps, **fields)
            if self.step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    policy, _ = policy_dir
    run_dir = tmp_path / "run"
    args = _args(run_dir, policy, "train.steps=4", "train.log_every=1", "train.checkpoint_every=4", "eval.batches=0")
    monkeypatch.setattr(train_module, "Progress", SigtermAtStep3)
    assert jaxspec_main(args) == EXIT_CHECKPOINTED
    assert f"SIGTERM: checkpointed step 3 in {run_dir / 'checkpoints'}" in capsys.readouterr().out
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["3"] and not (run_dir / "draft").exists()
    monkeypatch.undo()
    assert jaxspec_main(args + ["--resume"]) == 0
    assert "draft train done: 4 steps in " in capsys.readouterr().out
    assert [r["step"] for r in _metrics(run_dir)] == [1, 2, 3, 4] and (run_dir / "draft").is_dir()


def test_missing_policy_is_a_clear_error(tmp_path, capsys):
    assert jaxspec_main(_args(tmp_path / "run", tmp_path / "nowhere", "train.steps=2")) == 2
    assert "policy folder not found" in capsys.readouterr().err
