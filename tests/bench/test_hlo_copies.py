"""Reading the copies inside a program's loops and branches from its optimized HLO (hand-written)."""

from jaxspec.bench.hlo_copies import Copy, callers, loop_copies

HLO = """HloModule jit__loop

%fused_computation.1 (p: bf16[4,8]) -> bf16[8,4] {
  %p = bf16[4,8]{1,0} parameter(0)
  ROOT %copy.1 = bf16[8,4]{0,1} copy(%p)
}

%region_3.7 (arg: (bf16[4,16,2,32], s32[])) -> (bf16[4,16,2,32], s32[]) {
  %arg = (bf16[4,16,2,32]{3,2,1,0}, s32[]) parameter(0)
  %gte.1 = bf16[4,16,2,32]{3,2,1,0} get-tuple-element(%arg), index=0
  %copy.2 = bf16[4,16,2,32]{3,2,1,0} copy(%gte.1), metadata={op_name="jit(_loop)/while/body"}
  %gte.2 = s32[] get-tuple-element(%arg), index=1
  ROOT %tuple = (bf16[4,16,2,32]{3,2,1,0}, s32[]) tuple(%copy.2, %gte.2)
}

%region_4.8 (arg: (bf16[4,16,2,32], s32[])) -> (bf16[4,16,2,32], s32[]) {
  ROOT %arg = (bf16[4,16,2,32]{3,2,1,0}, s32[]) parameter(0)
}

ENTRY %main.9 (x: bf16[4,16,2,32], i: s32[]) -> bf16[4,16,2,32] {
  %x = bf16[4,16,2,32]{3,2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %t = (bf16[4,16,2,32]{3,2,1,0}, s32[]) tuple(%x, %i)
@COND@
  %f = bf16[8,4]{0,1} fusion(%x), kind=kLoop, calls=%fused_computation.1
  ROOT %copy.3 = bf16[4,16,2,32]{3,2,1,0} copy(%x)
}
"""
HLO = HLO.replace(
    "@COND@",
    "  %cond.5 = (bf16[4,16,2,32]{3,2,1,0}, s32[]) conditional(%i, %t, %t), "
    "branch_computations={%region_3.7, %region_4.8}, "
    'metadata={op_name="jit(_loop)/while/body/propose/cond"}',
)


def test_only_the_copies_inside_loops_and_branches_count():
    """The body's copy counts with its shape and size; the entry's (once per call) and the
    fusion's (a layout change inside a kernel) do not."""
    assert loop_copies(HLO) == [Copy("region_3.7", "copy.2", "bf16", (4, 16, 2, 32))]
    assert loop_copies(HLO)[0].bytes == 4 * 16 * 2 * 32 * 2


def test_a_computation_is_named_by_the_op_name_of_what_runs_it():
    """Both branches of the conditional take its op_name (the jax scope of the `cond`); the fusion,
    whose caller carries no op_name, is left out."""
    assert callers(HLO) == {
        "region_3.7": "jit(_loop)/while/body/propose/cond",
        "region_4.8": "jit(_loop)/while/body/propose/cond",
    }
