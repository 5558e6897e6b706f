import dataclasses
import json
import os
import shutil
import signal
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import jaxspec
from jaxspec.config_io import load_config
from jaxspec.models import forward, load_hf, moe
from jaxspec.pretrain import main
from jaxspec.pretrain.config import PretrainConfig, validate
from jaxspec.run import EXIT_CHECKPOINTED
from jaxspec.tasks import MAX_LEVEL
from tests.run.damage import truncate_largest_data_file

pytestmark = pytest.mark.slow

CONFIG = """
data: {num_train: 600, num_eval: 6, seed: 3, levels: [1], vocab_size: 512, max_len: 64}
model: {hidden_size: 32, intermediate_size: 64, num_layers: 2, num_heads: 2, num_kv_heads: 1, head_dim: 16,
        max_position_embeddings: 128}
optim: {learning_rate: 1.0e-2, warmup_steps: 4}
train: {steps: 24, batch_size: 16, log_every: 4, eval_every: 12, eval_max_new_tokens: 12,
        checkpoint_every: 12, keep_checkpoints: 3, progress: false}
"""


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrain")
    config = root / "pretrain_tiny.yaml"
    config.write_text(CONFIG)
    run_dir = root / "run"
    assert main(["--config", str(config), "--run-dir", str(run_dir)]) == 0
    return config, run_dir


def test_loss_falls_and_metrics_are_logged(first_run):
    _, run_dir = first_run
    records = _metrics(run_dir)
    losses = [r["loss"] for r in records if "loss" in r]
    assert [r["step"] for r in records if "loss" in r] == [4, 8, 12, 16, 20, 24]
    assert losses[-1] < 0.6 * losses[0]
    assert all(r["tokens_per_s"] > 0 and r["lr"] > 0 for r in records if "loss" in r)
    evals = [r for r in records if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [12, 24]
    assert all(0.0 <= r["eval_accuracy"] <= 1.0 and r["eval_problems"] == 6 for r in evals)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == ["12", "24"]
    held_out = {json.loads(line)["question"] for line in (run_dir / "data" / "eval.jsonl").read_text().splitlines()}
    train = {json.loads(line)["question"] for line in (run_dir / "data" / "train.jsonl").read_text().splitlines()}
    assert len(held_out) == 6 and not held_out & train


def test_resume_continues_from_checkpoint_exactly(first_run, tmp_path, capsys):
    config, run_dir = first_run
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    # A damaged step-24 checkpoint (a truncated data file) is moved aside and the run resumes from 12.
    truncate_largest_data_file(resumed / "checkpoints" / "24")
    shutil.rmtree(resumed / "policy")
    capsys.readouterr()
    assert main(["--config", str(config), "--run-dir", str(resumed), "--resume"]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint {resumed / 'checkpoints' / '24'} is damaged (ValueError: OUT_OF_RANGE" in out
    assert "resumed from step 12 (data position 192)" in out
    assert len(list((resumed / "checkpoints").glob("24.damaged-*"))) == 1
    ours = load_file(resumed / "policy" / "model.safetensors")
    reference = load_file(run_dir / "policy" / "model.safetensors")
    assert ours.keys() == reference.keys()
    for name in ours:
        np.testing.assert_array_equal(ours[name], reference[name], err_msg=name)
    assert [r["step"] for r in _metrics(resumed)] == [r["step"] for r in _metrics(run_dir)]  # none twice
    evals = [r["eval_accuracy"] for r in _metrics(resumed) if "eval_accuracy" in r]
    assert evals == [r["eval_accuracy"] for r in _metrics(run_dir) if "eval_accuracy" in r]
    losses = [(r["step"], r["loss"]) for r in _metrics(resumed) if "loss" in r]
    assert losses == [(r["step"], r["loss"]) for r in _metrics(run_dir) if "loss" in r]


def test_sigterm_checkpoints_and_resume_finishes_the_same_run(first_run, tmp_path, monkeypatch, capsys):
    """SIGTERM during step 5: the run checkpoints step 5 and exits 75 without exporting; --resume
    ends in the uninterrupted run's weights and metrics."""
    import jaxspec.run.loop as run_module

    class SigtermAtStep5(run_module.Progress):
        def update(self, steps=1, **fields):
            super().update(steps, **fields)
            if self.step == 5:
                os.kill(os.getpid(), signal.SIGTERM)

    config, run_dir = first_run
    stopped = tmp_path / "stopped"
    monkeypatch.setattr(run_module, "Progress", SigtermAtStep5)
    assert main(["--config", str(config), "--run-dir", str(stopped)]) == EXIT_CHECKPOINTED
    assert f"SIGTERM: checkpointed step 5 in {stopped / 'checkpoints'}" in capsys.readouterr().out
    assert [p.name for p in (stopped / "checkpoints").iterdir()] == ["5"] and not (stopped / "policy").exists()
    monkeypatch.undo()
    assert main(["--config", str(config), "--run-dir", str(stopped), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "resumed from step 5 (data position 80)" in out and "pretrain done: 24 steps in " in out
    assert _losses(stopped) == _losses(run_dir)
    ours, reference = (load_file(d / "policy" / "model.safetensors") for d in (stopped, run_dir))
    for name in reference:
        np.testing.assert_array_equal(ours[name], reference[name], err_msg=name)


def _losses(run_dir):
    return [(r["step"], r["loss"]) for r in _metrics(run_dir) if "loss" in r]


def test_a_mesh_trains_the_same_steps(first_run, tmp_path, capsys):
    """Rows split over 2 data x 2 fsdp devices (params sharded too) give the one-device run's losses
    and weights up to float summation order; a mesh run resumes onto one device and vice versa."""
    config, run_dir = first_run
    mesh_run = tmp_path / "mesh"
    assert main(["--config", str(config), "--run-dir", str(mesh_run), "mesh.data=2", "mesh.fsdp=2"]) == 0
    assert "training on the mesh {'data': 2, 'fsdp': 2, 'tensor': 1}" in capsys.readouterr().out
    (steps, ours), (_, reference) = (zip(*_losses(r)) for r in (mesh_run, run_dir))
    assert steps == (4, 8, 12, 16, 20, 24)
    np.testing.assert_allclose(ours, reference, rtol=2e-4)
    weights = [load_file(r / "policy" / "model.safetensors") for r in (mesh_run, run_dir)]
    for name in weights[1]:
        np.testing.assert_allclose(weights[0][name], weights[1][name], atol=2e-4, err_msg=name)

    shutil.rmtree(mesh_run / "checkpoints" / "24")
    shutil.rmtree(mesh_run / "policy")
    assert main(["--config", str(config), "--run-dir", str(mesh_run), "--resume"]) == 0
    assert "resumed from step 12" in capsys.readouterr().out
    np.testing.assert_allclose([loss for _, loss in _losses(mesh_run)], reference, rtol=2e-4)


def test_mesh_must_split_the_batch_and_fit_the_devices(first_run, capsys):
    config, run_dir = first_run
    assert main(["--config", str(config), "--run-dir", str(run_dir) + "-odd", "mesh.data=3"]) == 2
    assert "train.batch_size: 16 rows do not split over mesh.data x mesh.fsdp = 3 devices" in capsys.readouterr().err
    assert main(["--config", str(config), "--run-dir", str(run_dir) + "-big", "mesh.data=16"]) == 2
    assert "mesh: data=16 x fsdp=1 x tensor=1 needs 16 devices, this process sees 8" in capsys.readouterr().err
    assert not Path(str(run_dir) + "-big").exists()
    assert main(["--config", str(config), "--run-dir", str(run_dir) + "-r", "mesh.rollout_devices=1"]) == 2
    assert "mesh.rollout_devices: a rollout mesh is for GRPO's rollout.mode async" in capsys.readouterr().err


def test_export_matches_transformers(first_run):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    _, run_dir = first_run
    export = run_dir / "policy"
    assert {p.name for p in export.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    cfg, params = load_hf(export, dtype="float32")
    assert cfg.family == "qwen3" and cfg.eos_token_id == 2 and cfg.pad_token_id == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 20)).astype(np.int32)
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    ours = np.asarray(forward(cfg, params, jnp.asarray(tokens)))
    rel = np.abs(ours - theirs).max() / np.abs(theirs).max()
    assert rel < 1e-5, rel


def test_bad_config_fails_fast_with_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(CONFIG.replace("num_layers: 2", "num_layer: 2"))
    run_dir = tmp_path / "run"
    assert main(["--config", str(bad), "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown key 'model.num_layer'" in err[0] and "bad.yaml" in err[0]
    assert not run_dir.exists()
    good = tmp_path / "good.yaml"
    good.write_text(CONFIG)
    assert main(["--config", str(good), "--run-dir", str(run_dir), "optim.warmup_steps=50"]) == 2
    assert "optim.warmup_steps" in capsys.readouterr().err
    assert main(["--config", str(tmp_path / "none.yaml"), "--run-dir", str(run_dir)]) == 2
    assert "none.yaml" in capsys.readouterr().err
    assert main(["--config", str(good), "--run-dir", str(run_dir), "data.tokenizer=absent/tokenizer.json"]) == 2
    assert "data.tokenizer: file not found: absent/tokenizer.json" in capsys.readouterr().err
    assert not run_dir.exists()


@pytest.mark.parametrize("name", ["pretrain_tiny.yaml", "pretrain_small.yaml", "pretrain_small_moe.yaml"])
def test_shipped_configs_are_valid(name):
    path = Path(__file__).resolve().parents[2] / "configs" / name
    cfg = load_config(PretrainConfig, path)
    validate(cfg, str(path))
    if name != "pretrain_tiny.yaml":  # the long levels' examples (up to ~1700 tokens) fit a row; ~32k tokens a step
        assert cfg.data.levels == tuple(range(1, MAX_LEVEL + 1))
        assert cfg.data.max_len == 2048 and cfg.data.max_len * cfg.train.batch_size == 32768


def test_draft_model_config_trains_on_the_policy_data_with_its_tokenizer():
    """configs/pretrain_draft_model_small.yaml: the small policy's problems, packing and tokenizer, a
    smaller model (valid once the policy's run has written its tokenizer)."""
    root = Path(__file__).resolve().parents[2] / "configs"
    policy = load_config(PretrainConfig, root / "pretrain_small.yaml")
    draft = load_config(PretrainConfig, root / "pretrain_draft_model_small.yaml")
    assert draft.data.tokenizer == "runs/small/tokenizer.json"
    same = ("num_train", "num_eval", "seed", "levels", "kinds", "max_len")
    assert [getattr(draft.data, f) for f in same] == [getattr(policy.data, f) for f in same]
    assert (draft.train.steps, draft.train.batch_size) == (policy.train.steps, policy.train.batch_size)
    assert draft.model.num_layers < policy.model.num_layers and draft.model.hidden_size < policy.model.hidden_size
    with pytest.raises(FileNotFoundError, match="data.tokenizer: file not found: runs/small/tokenizer.json"):
        validate(draft, "pretrain_draft_model_small.yaml")
    tokenizer = Path(jaxspec.__file__).parent / "assets" / "tiny-policy" / "tokenizer.json"
    validate(dataclasses.replace(draft, data=dataclasses.replace(draft.data, tokenizer=str(tokenizer))), "x")


def test_existing_run_needs_resume_and_same_data(first_run, capsys):
    config, run_dir = first_run
    assert main(["--config", str(config), "--run-dir", str(run_dir)]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["--config", str(config), "--run-dir", str(run_dir), "--resume", "data.seed=4"]) == 2
    assert "data section differs" in capsys.readouterr().err


MOE = [
    "model.num_experts=4",
    "model.num_experts_per_tok=2",
    "model.moe_intermediate_size=32",
    "model.router_aux_loss_coef=0.01",
]


def test_moe_policy_pretrains_with_the_router_loss_and_exports(tmp_path, capsys, monkeypatch):
    """One device, and the same steps with the experts split over 2 devices (expert parallelism)
    and with the grouped-matmul kernels (in Triton's interpreter, rows over 2 devices) in place of ragged_dot."""
    pytest.importorskip("torch", reason="Triton's interpreter runs on torch CPU tensors (the test extra has torch)")
    config = tmp_path / "pretrain_tiny.yaml"
    config.write_text(CONFIG)
    runs, weight_grads = {}, []
    kernels = moe.kernels()  # (needs triton)
    weight_grad = kernels.grouped_transposed_matmul_triton  # runs in the kernels' backward pass only

    def counted_weight_grad(*args, **kwargs):
        weight_grads.append(name)  # the run being traced
        return weight_grad(*args, **kwargs)

    monkeypatch.setattr(kernels, "grouped_transposed_matmul_triton", counted_weight_grad)
    for name, mesh in (
        ("one", []),
        ("expert", ["mesh.data=2", "mesh.expert=2"]),
        ("kernel", ["train.moe=triton-interpret", "mesh.data=2"]),
    ):
        runs[name] = tmp_path / name
        assert (
            main(
                [
                    "--config",
                    str(config),
                    "--run-dir",
                    str(runs[name]),
                    "train.steps=8",
                    "train.eval_every=0",
                    *MOE,
                    *mesh,
                ]
            )
            == 0
        )
    assert "training on the mesh {'data': 2, 'fsdp': 1, 'tensor': 1, 'expert': 2}" in capsys.readouterr().out
    assert weight_grads and set(weight_grads) == {"kernel"}
    records = [r for r in _metrics(runs["one"]) if "loss" in r]
    assert [r["step"] for r in records] == [4, 8]
    # top-2 of 4 experts: the load-balancing loss is 2 when balanced, at most 4
    assert all(1.9 < r["router_aux_loss"] <= 4.0 for r in records)
    for other in ("expert", "kernel"):
        same = [r for r in _metrics(runs[other]) if "loss" in r]
        for key in ("loss", "router_aux_loss", "grad_norm"):
            np.testing.assert_allclose([r[key] for r in same], [r[key] for r in records], rtol=2e-4, err_msg=other)
    cfg, params = load_hf(runs["one"] / "policy")
    assert cfg.family == "qwen3_moe" and cfg.sparse_layers == (0, 1) and cfg.router_aux_loss_coef == 0.01
    assert params["layers"][1]["experts_gate"].shape == (4, 32, 32)


def test_small_moe_is_small_with_experts_of_the_same_active_width():
    small, moe = (
        load_config(PretrainConfig, Path(__file__).resolve().parents[2] / "configs" / name)
        for name in ("pretrain_small.yaml", "pretrain_small_moe.yaml")
    )
    assert (moe.data, moe.optim, moe.train) == (small.data, small.optim, small.train)
    moe_fields = (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "router_aux_loss_coef",
    )
    assert dataclasses.replace(moe.model, **{f: getattr(small.model, f) for f in moe_fields}) == small.model
    assert moe.model.num_experts_per_tok * moe.model.moe_intermediate_size == small.model.intermediate_size


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.num_experts_per_tok=5", "model.num_experts_per_tok: must be in [1, model.num_experts=4], got 5"),
        ("model.moe_intermediate_size=0", "model.moe_intermediate_size: must be > 0, got 0"),
        (
            "train.moe=triton mesh.data=2 mesh.expert=2",
            "train.moe: 'triton' runs on whole experts: it needs mesh.expert = mesh.tensor = 1, got expert=2, tensor=1",
        ),
    ],
)
def test_bad_moe_shape_is_rejected(tmp_path, capsys, override, message):
    config = tmp_path / "pretrain_tiny.yaml"
    config.write_text(CONFIG)
    assert main(["--config", str(config), "--run-dir", str(tmp_path / "run"), *MOE, *override.split()]) == 2
    assert message in capsys.readouterr().err
