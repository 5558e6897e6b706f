"""benchmarks/slot_profile.py: the rows' limits drawn from a workload's length law, the kernel
phases read from a trace's scope names, and the copies listed from a loop program's HLO."""

import json
import sys
from pathlib import Path

import jax
import numpy as np

from jaxspec import rollout
from jaxspec.config_io import load_config
from jaxspec.data_cli import response_lengths
from jaxspec.pretrain.config import PretrainConfig
from jaxspec.rollout import generate
from jaxspec.tasks import generate_problems
from tests.benchmarks.scripts import load_script

slot_profile = load_script("slot_profile")
LONG = str(Path(__file__).resolve().parents[2] / "configs" / "pretrain_long.yaml")
SMALL = str(Path(__file__).resolve().parents[2] / "configs" / "pretrain_small.yaml")


def tiny_model(tmp_path: Path) -> Path:
    """A config.json of `small`'s vocabulary with 2 layers of width 64."""
    config = json.loads((Path(__file__).resolve().parents[2] / "configs/models/small-policy.json").read_text())
    config |= {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    config |= {"num_key_value_heads": 2, "head_dim": 16}
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(config))
    return model


def test_row_limits_are_the_workloads_response_lengths_capped():
    """One draw of the long workload's law per row: its first problems' response lengths under its
    tokenizer, each capped at the call's max_new_tokens."""
    data = load_config(PretrainConfig, LONG, []).data
    lengths = np.asarray(
        response_lengths(data, generate_problems(48, data.seed, data.levels, data.kinds, tally=data.tally))[0]
    )
    cap = int(np.median(lengths))
    limits = np.asarray(slot_profile.workload_lengths(LONG, 48, cap))
    np.testing.assert_array_equal(limits, np.minimum(lengths, cap))
    assert (limits == cap).sum() >= 24 and len(set(limits.tolist())) > 10  # capped half, the rest spread


def test_a_kernel_is_charged_to_its_innermost_phase():
    assert slot_profile.phase_of("jit__loop/while/body/verify_forward/layer/attention") == "verify_forward"
    assert slot_profile.phase_of("jit__loop/while/body/propose/verify/x") == "verify"
    assert slot_profile.phase_of("jit__loop/while/body/schedule/admit/gather") == "jit__loop/while/body/schedule"


def test_a_short_warm_up_compiles_what_the_timed_call_runs(tmp_path, monkeypatch):
    """The rows' limits are data: a warm-up whose rows stop after 2 tokens compiles every program of
    the timed call, so that no compilation lands in its time (each run counts them)."""
    model = tiny_model(tmp_path)
    argv = [str(tmp_path / "work"), "--model", str(model), "--rows", "8", "--new", "12", "--slots", "4"]
    monkeypatch.setattr(sys, "argv", ["slot_profile.py", *argv, "--warmup-new", "2", "--lengths", LONG])
    slot_profile.main()
    runs = json.loads((tmp_path / "work" / "slot_profile.json").read_text())
    assert set(runs) == {"staged", "slots K=default"}
    for run in runs.values():
        assert run["compiles"] == 0 and "error" not in run
        assert run["tokens"] > 8 * 2  # the timed call ran past the warm-up's limits
    # negative control: with the compiled programs dropped before every call, the timed one compiles
    monkeypatch.setattr(rollout, "generate", lambda *a, **k: (jax.clear_caches(), generate(*a, **k))[1])
    monkeypatch.setattr(sys, "argv", ["slot_profile.py", *argv, "--engines", "slots"])
    slot_profile.main()
    [run] = json.loads((tmp_path / "work" / "slot_profile.json").read_text()).values()
    assert run["compiles"] > 0 and "during the timed call" in run["error"]


LOOP_HLO = """HloModule jit__loop

%region_1.2 (arg: bf16[256,16,2,32]) -> bf16[256,16,2,32] {
  %arg = bf16[256,16,2,32]{3,2,1,0} parameter(0)
  ROOT %copy.1 = bf16[256,16,2,32]{3,2,1,0} copy(%arg)
}

ENTRY %main.3 (x: bf16[256,16,2,32], p: pred[]) -> bf16[256,16,2,32] {
  %x = bf16[256,16,2,32]{3,2,1,0} parameter(0)
  %p = pred[] parameter(1)
  %c = bf16[256,16,2,32]{3,2,1,0} conditional(%p, %x, %x), branch_computations={%region_1.2, %region_1.2}, @META
  ROOT %copy.2 = bf16[256,16,2,32]{3,2,1,0} copy(%c)
}
""".replace("@META", 'metadata={op_name="jit(_loop)/while/body/cond"}')


def test_copies_are_listed_per_loop_program_with_what_runs_them(tmp_path):
    """A loop program's copies of 256 KiB or more, by computation, with the op_name of the branch
    that runs it; the entry's copy and other programs' dumps are not read."""
    (tmp_path / "module_0001.jit__loop.cpu_after_optimizations.txt").write_text(LOOP_HLO)
    (tmp_path / "module_0002.jit_prefill.cpu_after_optimizations.txt").write_text(LOOP_HLO)
    found = slot_profile.copies_in_loops(tmp_path)
    assert found == {
        "module_0001.jit__loop.cpu_after_optimizations.txt": [["region_1.2", 1, 0.5, "jit(_loop)/while/body/cond"]]
    }


def test_branches_the_warm_up_never_ran_are_named():
    """A draft depth or a step width that ran in the timed call and not in the warm-up is named (its
    first execution loads its kernels inside the timed call); those the warm-up ran are not."""
    warm = {"depth_steps": [14, 0, 0, 1], "width_steps": [15, 0, 0], "step_widths": [8, 4, 1]}
    timed = {"depth_steps": [250, 4, 0, 1], "width_steps": [200, 40, 15], "step_widths": [8, 4, 1]}
    assert slot_profile.first_runs(warm, timed) == ["draft depths [1]", "step widths [4, 1]"]
    assert slot_profile.first_runs(timed, timed) == []
    assert (
        slot_profile.first_runs({"width_steps": [3], "step_widths": [2]}, {"width_steps": [5], "step_widths": [2]})
        == []
    )


def test_the_kv_read_counts_every_decode_steps_positions():
    """Row lengths 1, 3 and 0 after a prompt of 2: the first token is the prefill's; the steps that
    write tokens 1 and 2 of the second row attend over 3 and 4 positions; 10 bytes a position."""
    assert slot_profile.kv_read_bytes([1, 3, 0], 2, 10) == (3 + 4) * 10
    lengths = np.random.default_rng(0).integers(0, 50, 20)
    brute = sum(7 + i for n in lengths for i in range(1, n))
    assert slot_profile.kv_read_bytes(lengths, 7, 3) == 3 * brute


def test_a_short_warm_up_runs_every_step_width_of_the_timed_call(tmp_path, monkeypatch):
    """--warmup-new's ladder of row limits (1, 1, 1, 1, 2, ... of 32 rows) narrows the slot loop
    through the widths that the timed call, whose rows end at the `small` workload's spread lengths
    (19 of 32 under 64 tokens), narrows through; capping every row at the same limit instead ends
    them together, at full width, and the timed call's narrower width is an error."""
    assert slot_profile.warmup_lengths([9, 9, 1, 9], 8) == [2, 4, 1, 8]
    model = tiny_model(tmp_path)
    argv = [str(tmp_path / "work"), "--model", str(model), "--rows", "32", "--new", "64", "--slots", "32"]
    argv += ["--engines", "slots", "--temperature", "0", "--lengths", SMALL, "--warmup-new", "8"]
    flat = lambda limits, most: [min(limit, most) for limit in limits]  # noqa: E731
    for ladder, error in ((slot_profile.warmup_lengths, False), (flat, True)):
        monkeypatch.setattr(slot_profile, "warmup_lengths", ladder)
        monkeypatch.setattr(sys, "argv", ["slot_profile.py", *argv])
        slot_profile.main()
        [run] = json.loads((tmp_path / "work" / "slot_profile.json").read_text()).values()
        assert run["compiles"] == 0 and len(run["stage_rows"]) > 1
        assert ("step widths [" in run.get("error", "")) == error, run


def test_a_warm_up_that_never_drafts_makes_the_adaptive_run_an_error_row(tmp_path, monkeypatch):
    """A warm-up of one token per row runs no decode step, so the timed calls' step widths and the
    adaptive call's depths are all first executions: their rows say so; warmed up by the whole call,
    the same runs are clean."""
    model = tiny_model(tmp_path)
    argv = [str(tmp_path / "work"), "--model", str(model), "--rows", "2", "--new", "8", "--slots", "2"]
    argv += ["--engines", "slots", "--spec", "2", "--adaptive", "--no-fixed", "--temperature", "0"]
    for warm_up, error in ((["--warmup-new", "1"], True), ([], False)):
        monkeypatch.setattr(sys, "argv", ["slot_profile.py", *argv, *warm_up])
        slot_profile.main()
        runs = json.loads((tmp_path / "work" / "slot_profile.json").read_text())
        assert set(runs) == {"slots K=default", "slots K=default eagle3 k=2 adaptive"}
        for label, run in runs.items():
            assert run["compiles"] == 0
            assert ("step widths [" in run.get("error", "")) == error, run
            assert ("draft depths [" in run.get("error", "")) == (error and "adaptive" in label), run


def test_staged_calls_split_the_rows_and_size_the_slot_pool(tmp_path, monkeypatch):
    """--staged-calls 2: the staged engine gets the rows as two calls of half of them, one after the
    other, its row counted with both calls' steps and tokens; the slot engine gets every row at once
    and a pool of half the rows' prompt and answer (8 rows x ceil((60 + 8) / 16) = 40 pages)."""
    model = tiny_model(tmp_path)
    calls = []

    def recorded(cfg, params, prompts, *args, **kwargs):
        out = generate(cfg, params, prompts, *args, **kwargs)
        calls.append((kwargs["slots"], len(prompts), kwargs["kv_pages"], int(out.stats["steps"]), out))
        return out

    monkeypatch.setattr(rollout, "generate", recorded)
    argv = [str(tmp_path / "work"), "--model", str(model), "--rows", "16", "--new", "8", "--slots", "16"]
    monkeypatch.setattr(sys, "argv", ["slot_profile.py", *argv, "--staged-calls", "2", "--lengths", LONG])
    slot_profile.main()
    runs = json.loads((tmp_path / "work" / "slot_profile.json").read_text())
    staged = [call for call in calls if call[0] is None]
    assert [(rows, pages) for _, rows, pages, _, _ in staged] == [(8, None)] * 4  # warm-up, then timed
    assert [(rows, pages) for slots, rows, pages, _, _ in calls if slots] == [(16, 40)] * 2
    timed = staged[2:]
    assert runs["staged"]["steps"] == sum(steps for *_, steps, _ in timed)
    assert runs["staged"]["tokens"] == sum(int(np.asarray(out.lengths).sum()) for *_, out in timed)
    assert runs["staged"]["stage_steps"] == [sum(n) for n in zip(*(out.stats["stage_steps"] for *_, out in timed))]
