"""benchmarks/compiled_kernels.py: the launches it counts in an optimized module's entry computation,
with a loop's body once per trip."""

from tests.benchmarks.scripts import load_script

compiled = load_script("compiled_kernels")

# The shape of XLA's GPU output (abridged): a fused computation that must not count, then the entry.
HLO = """HloModule jit_step, is_scheduled=true

%fused_add (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %add.1 = f32[4]{0} add(%p0, %p0)
}

ENTRY %main.3 (a.1: bf16[2,8], w.1: bf16[8,16]) -> (bf16[2,16], f32[4]) {
  %a.1 = bf16[2,8]{1,0} parameter(0)
  %w.1 = bf16[8,16]{1,0} parameter(1)
  %constant_1 = f32[] constant(0)
  %bitcast.2 = bf16[16]{0} bitcast(%a.1)
  %gemm = bf16[2,16]{1,0} fusion(%a.1, %w.1), kind=kCustom, backend_config={"kind":"__triton_nested_gemm_fusion"}
  %loop = f32[4]{0} fusion(%constant_1), kind=kLoop, calls=%fused_add
  %norm = f32[4]{0} fusion(%loop), kind=kInput, calls=%fused_add
  %kernel = (bf16[2,16]{1,0}, f32[4]{0}) custom-call(%gemm, %norm), custom_call_target="triton_kernel_call"
  %gte.1 = bf16[2,16]{1,0} get-tuple-element(%kernel), index=0
  %gte.2 = f32[4]{0} get-tuple-element(%kernel), index=1
  %copy.3 = bf16[2,16]{1,0} copy(%gte.1)
  ROOT %tuple.4 = (bf16[2,16]{1,0}, f32[4]{0}) tuple(%copy.3, %gte.2)
}
"""


def test_each_launch_of_the_entry_computation_is_counted_by_kind():
    assert compiled.launches(HLO) == {
        "fusion:kCustom:__triton_nested_gemm_fusion": 1,
        "fusion:kLoop": 1,
        "fusion:kInput": 1,
        "custom-call:triton_kernel_call": 1,
        "copy": 1,
    }


LOOP = """HloModule jit_search, is_scheduled=true

%fused_add (p0: s32[]) -> s32[] {
  %p0 = s32[] parameter(0)
  ROOT %add.1 = s32[] add(%p0, %p0)
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %step = s32[] fusion(%i), kind=kLoop, calls=%fused_add
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %select = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_add
  ROOT %out = (s32[], f32[4]) tuple(%step, %select)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]) parameter(0)
  ROOT %lt = pred[] fusion(%t), kind=kLoop, calls=%fused_add
}

ENTRY %main.2 (a.1: f32[4]) -> f32[4] {
  %a.1 = f32[4]{0} parameter(0)
  %init = (s32[], f32[4]) tuple(%a.1, %a.1)
  %while.1 = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"8"}}
  %while.2 = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body, backend_config={}
  ROOT %r = f32[4]{0} get-tuple-element(%while.1), index=1
}
"""


def test_a_loops_body_counts_once_per_trip():
    """A loop of known trip count 8 runs its body's two launches 8 times; one of unknown trip count
    is counted once and said to be so."""
    assert compiled.launches(LOOP) == {"while": 2, "fusion:kLoop": 2 * 8 + 2, "while:unknown trips": 1}


def test_every_setting_runs_the_attention_kernel_as_a_gpu_does():
    assert all(env.get("JAXSPEC_PAGED_ATTENTION") == "triton" for env in compiled.SETTINGS.values())
    assert set(compiled.SETTINGS["all"]) >= {
        "JAXSPEC_ATTENTION_PROLOGUE",
        "JAXSPEC_RESIDUAL_NORM",
        "JAXSPEC_THIN_MATMUL",
    }


def test_the_largest_copy_is_measured_in_bytes():
    assert compiled.largest_copy_bytes(HLO) == 2 * 16 * 2  # copy.3: bf16 [2, 16]
    assert compiled.largest_copy_bytes(HLO.replace("copy(", "negate(")) == 0


def test_xla_flags_reach_the_compiling_child_after_the_environments_own(monkeypatch, tmp_path):
    import argparse
    import json
    import subprocess

    model = tmp_path / "model.json"
    model.write_text(json.dumps({"num_hidden_layers": 2}))
    seen = {}

    def child(argv, env, **_):
        seen["flags"] = env.get("XLA_FLAGS")
        stdout = json.dumps({"kinds": {"fusion:kLoop": 4}, "largest_copy_bytes": 0})
        return subprocess.CompletedProcess(argv, 0, stdout=stdout, stderr="")

    monkeypatch.setattr(compiled.subprocess, "run", child)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=somewhere")
    args = argparse.Namespace(devices=1, context=64, page_size=16, draft=False, xla_flags="--a_flag=1")
    row = compiled.count(str(model), 8, 1, "gpu_default", args)
    assert seen["flags"] == "--xla_dump_to=somewhere --a_flag=1"
    assert row["launches"] == 4 and row["per_layer"] == 2.0
    compiled.count(str(model), 8, 1, "gpu_default", argparse.Namespace(**{**vars(args), "xla_flags": None}))
    assert seen["flags"] == "--xla_dump_to=somewhere"
