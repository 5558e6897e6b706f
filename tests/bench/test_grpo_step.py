"""`jaxspec bench grpo-step` on a tiny random policy over a CPU mesh: every phase runs and is
reported, the projection follows from the measured speculative step, and --write-policy writes an HF
folder of the config's shape."""

import json

import pytest

from jaxspec.cli import main as jaxspec_main
from jaxspec.models import ModelConfig, load_hf

pytestmark = pytest.mark.slow

TINY = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}
PHASES = ["generate_ar", "generate_spec", "logprobs", "update", "update_draft", "checkpoint"]


def grpo_step(model_json, out, flags: str) -> int:
    """`jaxspec bench grpo-step` on the policy of `model_json` with `flags` (space-separated), its
    results written to `out`: the exit code."""
    return jaxspec_main(["bench", "grpo-step", "--model", str(model_json), *flags.split(), "--out", str(out)])


@pytest.fixture
def model_json(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return path


def test_every_phase_is_timed_and_the_projection_follows(model_json, tmp_path, capsys):
    out = tmp_path / "grpo_step.json"
    assert (
        grpo_step(
            model_json,
            out,
            "--mesh 1,2,1 --batch 4 --sub-batch 2 --prompt 4 --new 4 --minibatches 2 "
            "--k 2 --draft-vocab 32 --ttt-steps 1 --acceptance 2.0",
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "PROJECTION (computed from the measured costs above, not measured)" in printed
    assert "KV cache per sub-batch of 2 rows x 8 slots" in printed
    result = json.loads(out.read_text())
    rows = {r.get("phase") or r["projection"]: r for r in result["rows"]}
    assert [r["phase"] for r in result["rows"] if "phase" in r] == PHASES
    for phase in PHASES:
        assert rows[phase]["seconds"] > 0
        assert rows[phase]["peak_gb_per_device"] == [None] * 8  # CPU devices report no memory statistics
    # XLA's plan per device: the log-prob pass and an update's gradients donate nothing; its optimizer
    # step writes the policy and the optimizer states over the donated inputs
    assert rows["logprobs"]["xla_plan_gb"]["aliased"] == 0 < rows["logprobs"]["xla_plan_gb"]["arguments"]
    for phase in ("update", "update_draft"):
        gradients, step = rows[phase]["xla_plan_gb"]["gradients"], rows[phase]["xla_plan_gb"]["optimizer_step"]
        assert gradients["aliased"] == 0 < gradients["outputs"] <= gradients["arguments"]
        assert 0.95 * step["outputs"] <= step["aliased"] <= step["outputs"] < step["arguments"]
    draft_step = rows["update_draft"]["xla_plan_gb"]["draft_step"]  # the head alone, on its donated state
    assert 0.95 * draft_step["outputs"] <= draft_step["aliased"] <= draft_step["outputs"] < draft_step["arguments"]
    assert "draft_step" not in rows["update"]["xla_plan_gb"]
    ar, spec = rows["generate_ar"], rows["generate_spec"]
    assert ar["acceptance_length"] == 1.0 and ar["loop_steps"] >= 2 * 3  # 2 sub-batches, >= new - 1 steps each
    assert 1.0 <= spec["acceptance_length"] <= 3.0  # k = 2: at most 3 tokens per verification
    rest = rows["logprobs"]["seconds"] + rows["update_draft"]["seconds"]
    for tau in (2.5, 3.0, 3.3, 2.0):
        projected = rows[f"tau={tau}"]
        assert projected["generate_s"] == pytest.approx(2 * 4 / tau * spec["ms_per_loop_step"] / 1e3)
        assert projected["step_s"] == pytest.approx(projected["generate_s"] + rest)
        assert projected["speedup"] == pytest.approx((ar["seconds"] + rest) / projected["step_s"])
    assert result["baseline"]["kv_cache_bytes_per_sub_batch"] == 2 * 8 * 2 * 2 * 2 * 8 * 2  # B S (K,V) L Hkv D bf16


def test_write_policy_writes_the_config_shape(model_json, tmp_path):
    folder = tmp_path / "policy"
    assert jaxspec_main(["bench", "grpo-step", "--model", str(model_json), "--write-policy", str(folder)]) == 0
    cfg, params = load_hf(folder, dtype="bfloat16")
    assert cfg == ModelConfig.from_json(model_json)
    assert params["embed"].shape == (64, 32)


def test_batch_must_split_into_sub_batches(model_json, capsys):
    assert jaxspec_main(["bench", "grpo-step", "--model", str(model_json), "--batch", "6", "--sub-batch", "4"]) == 2
    assert "--batch 6 is not a multiple of --sub-batch 4" in capsys.readouterr().err


def test_a_phase_out_of_memory_ends_the_run_with_the_phases_before_it(model_json, tmp_path, monkeypatch):
    import jax

    from jaxspec.bench import grpo_phases

    def out_of_memory(self, with_draft):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9 GiB")

    monkeypatch.setattr(grpo_phases.Bench, "update", out_of_memory)
    out = tmp_path / "grpo_step.json"
    assert (
        grpo_step(
            model_json,
            out,
            "--batch 2 --sub-batch 2 --prompt 4 --new 4 --minibatches 1 --k 1 --draft-vocab 32 --ttt-steps 1",
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["phase"] for r in rows] == ["generate_ar", "generate_spec", "logprobs", "update"]
    assert rows[-1]["error"].startswith("out of device memory: RESOURCE_EXHAUSTED")
    assert rows[-1]["xla_plan_gb"] is None  # the failing phase here never compiled
    assert all("projection" not in r for r in rows)  # nothing is projected from a missing update


def test_gather_weights_and_state_dtype(model_json, tmp_path, monkeypatch):
    """--gather-weights: both generation phases read the policy whole on each fsdp device (the
    master weights stay split); --state-dtype bfloat16: the updates keep AdamW's first moment in
    bf16, as optim.state_dtype does."""
    import jax
    import jax.numpy as jnp

    from jaxspec.bench import grpo_phases

    generate, optimizer = grpo_phases.generate, grpo_phases.policy_optimizer
    read_fsdp_sharded, mu_dtypes = [], []

    def recording_generate(cfg, params, *args, **kwargs):
        read_fsdp_sharded.append("fsdp" in tuple(params["embed"].sharding.spec))
        return generate(cfg, params, *args, **kwargs)

    def recording_optimizer(optim):
        tx = optimizer(optim)

        def init(params):
            state = tx.init(params)
            mu_dtypes.extend({x.dtype for x in jax.tree.leaves(state) if x.shape == params["embed"].shape})
            return state

        return tx._replace(init=init)

    monkeypatch.setattr(grpo_phases, "generate", recording_generate)
    monkeypatch.setattr(grpo_phases, "policy_optimizer", recording_optimizer)
    out = tmp_path / "grpo_step.json"
    assert (
        grpo_step(
            model_json,
            out,
            "--mesh 1,2,1 --batch 2 --sub-batch 2 --prompt 4 --new 4 --minibatches 1 --k 1 "
            "--draft-vocab 32 --ttt-steps 1 --gather-weights --state-dtype bfloat16",
        )
        == 0
    )
    assert read_fsdp_sharded and not any(read_fsdp_sharded)
    assert set(mu_dtypes) == {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)}  # mu bf16, nu float32
    baseline = json.loads(out.read_text())["baseline"]
    assert baseline["gather_weights"] is True and baseline["state_dtype"] == "bfloat16"
    assert [r["phase"] for r in json.loads(out.read_text())["rows"] if "phase" in r] == PHASES


def test_phases_runs_the_listed_phases_with_those_they_read(model_json, tmp_path, capsys):
    out = tmp_path / "grpo_step.json"
    assert (
        grpo_step(
            model_json,
            out,
            "--batch 2 --sub-batch 2 --prompt 4 --new 4 --minibatches 1 --draft-vocab 32 --phases generate_ar",
        )
        == 0
    )
    assert [r["phase"] for r in json.loads(out.read_text())["rows"]] == ["generate_ar"]
    assert jaxspec_main(["bench", "grpo-step", "--model", str(model_json), "--phases", "generate_ar", "update"]) == 2
    assert "--phases: update reads the results of logprobs; add it" in capsys.readouterr().err


def test_training_phases_without_generation_read_full_length_random_rollouts(model_json, tmp_path):
    out = tmp_path / "grpo_step.json"
    assert (
        grpo_step(
            model_json,
            out,
            "--batch 4 --sub-batch 2 --prompt 4 --new 6 --minibatches 2 "
            "--draft-vocab 32 --phases logprobs update_draft checkpoint",
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["phase"] for r in rows] == ["logprobs", "update_draft", "checkpoint"]
    assert all(r["seconds"] > 0 for r in rows)


@pytest.mark.parametrize("phases", [["generate_ar"], ["logprobs", "update_draft"]])
def test_the_training_state_is_made_before_the_first_phase(model_json, phases):
    """Every phase runs next to the whole training state, as `jaxspec train` holds it: AdamW's
    moments laid out like the policy from the start, and the online head's optimizer state when
    update_draft is among the phases."""
    import jax

    from jaxspec.bench import grpo_phases, grpo_step

    args = grpo_step.parser().parse_args(
        [
            "--model",
            str(model_json),
            "--mesh",
            "1,2,1",
            "--batch",
            "2",
            "--sub-batch",
            "2",
            "--draft-vocab",
            "32",
            "--state-dtype",
            "bfloat16",
            "--phases",
            *phases,
        ]
    )
    bench = grpo_phases.Bench(args)
    mu, nu = bench.opt_state[1][0].mu, bench.opt_state[1][0].nu
    for moment, dtype in ((mu, "bfloat16"), (nu, "float32")):
        for p, m in zip(jax.tree.leaves(bench.params), jax.tree.leaves(moment)):
            assert m.shape == p.shape and m.dtype == dtype and m.sharding.is_equivalent_to(p.sharding, p.ndim)
    assert (bench.head is not None) == ("update_draft" in phases)
