"""Reading an XLA dump and a profiler trace: every instruction's jax scope, and the leaf kernels of a
trace line (CPU, hand-written dumps and events)."""

from types import SimpleNamespace

import pytest

from jaxspec.bench import kernel_trace


def test_fusions_without_metadata_take_their_shared_scope(tmp_path):
    (tmp_path / "module_0007.jit__decode.cpu_after_optimizations.txt").write_text(
        "%fused_computation.1 (p: f32[2]) -> f32[2] {\n"
        '  %a = f32[2] negate(%p), metadata={op_name="jit(_decode)/while/body/forward/attention/neg"}\n'
        '  ROOT %b = f32[2] exp(%a), metadata={op_name="jit(_decode)/while/body/forward/attention/exp"}\n'
        "}\n"
        "ENTRY %main (x: f32[2]) -> f32[2] {\n"
        "  %x = f32[2] parameter(0)\n"
        '  %y = f32[2] add(%x, %x), metadata={op_name="jit(_decode)/while/body/sample/add"}\n'
        "  ROOT %fusion.3 = f32[2] fusion(%y), kind=kLoop, calls=%fused_computation.1\n"
        "}\n"
    )
    scopes = kernel_trace.op_scopes(tmp_path)
    assert scopes[(7, "y")] == "jit(_decode)/while/body/sample/add"
    assert scopes[(7, "fusion.3")] == "jit(_decode)/while/body/forward/attention"


def event(op: str, start: int, duration: int, module: str = "jit__decode") -> SimpleNamespace:
    """A profiler op event of program 3 (an HLO module) on a trace line."""
    stats = {"hlo_module": module, "hlo_op": op, "program_id": 3}
    return SimpleNamespace(start_ns=start, duration_ns=duration, stats=list(stats.items()))


def test_control_thunks_that_enclose_ops_are_skipped_and_compiled_calls_count():
    """On CPU a while thunk encloses its body's ops on its thread; a call XLA compiled into one
    kernel (a "small call") encloses none and is itself the kernel."""

    line = SimpleNamespace(
        events=[
            event("while.2", 0, 100),
            event("fusion.1", 10, 30),
            event("call.4", 50, 40),
            event("call.5", 200, 60),
            event("add.7", 300, 5, module="jit_other"),
        ]
    )
    assert [(e.op, e.start_ns, e.duration_ns) for e in kernel_trace._leaf_ops(line, {"jit__decode": "ar"})] == [
        ("fusion.1", 10, 30),
        ("call.4", 50, 40),
        ("call.5", 200, 60),
    ]


def test_idle_gaps_sum_the_idle_time_between_each_pair_of_kernels(monkeypatch):
    """Gaps between consecutive kernels of one program, per (before, after) pair; another
    program's kernels and overlapping kernels add none."""

    line = SimpleNamespace(
        events=[
            event("fusion.1", 0, 10),
            event("fusion.2", 15, 5),  # 5 idle after fusion.1
            event("fusion.1", 30, 10),  # 10 idle after fusion.2
            event("fusion.2", 47, 5),  # 7 idle after fusion.1
            event("fusion.1", 52, 10),  # back to back: no gap
            event("add.7", 70, 5, module="jit_other"),  # not the program's
        ]
    )
    monkeypatch.setattr(kernel_trace, "_trace_lines", lambda trace_dir: [line])
    scopes = {(3, "fusion.1"): "jit(_decode)/while/body/forward", (3, "fusion.2"): "jit(_decode)/while/cond"}
    gaps = kernel_trace.idle_gaps("unused", scopes, {"jit__decode": "ar"})
    assert [(g.before, g.after, g.ns, g.count) for g in gaps] == [
        ("fusion.1", "fusion.2", 12, 2),
        ("fusion.2", "fusion.1", 10, 1),
    ]
    assert gaps[0].before_name == "jit(_decode)/while/body/forward" and gaps[0].after_name == "jit(_decode)/while/cond"


def test_traced_seconds_is_the_device_time_of_a_calls_kernels(tmp_path):
    """A product of 8x the rows takes longer by the trace; a call that launches no kernel is an
    error, not a time of zero."""
    import jax
    import jax.numpy as jnp

    w = jnp.ones((512, 512))
    small = kernel_trace.traced_seconds(lambda x, w: x @ w, (jnp.ones((64, 512)), w), tmp_path / "small")
    large = kernel_trace.traced_seconds(lambda x, w: x @ w, (jnp.ones((512, 512)), w), tmp_path / "large")
    assert 0 < small < large
    with pytest.raises(ValueError, match="no kernel of jit_traced_call"):
        kernel_trace.traced_seconds(lambda x: (), (jnp.ones(4),), tmp_path / "none")
    jax.clear_caches()


def test_calls_in_turn_take_each_argument_set_and_the_copies_are_distinct_buffers(tmp_path):
    """`in_turn` cycles through its argument sets; `rotated_copies` keeps the first arrays and copies
    the rest into buffers of their own until the copies hold min_bytes; traced_seconds takes such a
    list."""
    import jax.numpy as jnp

    seen = []
    call = kernel_trace.in_turn(lambda *a: seen.append(a), [(1,), (2,), (3,)])
    for _ in range(7):
        call()
    assert seen == [(1,), (2,), (3,), (1,), (2,), (3,), (1,)]

    x, w = jnp.ones((4, 64)), jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32)  # w: 8 KiB
    sets = kernel_trace.rotated_copies((x, w), min_bytes=20 * 1024)
    assert len(sets) == 3 and sets[0][1] is w
    assert all(s[0] is x for s in sets)
    pointers = {s[1].unsafe_buffer_pointer() for s in sets}
    assert len(pointers) == 3 and all(bool((s[1] == w).all()) for s in sets)
    assert len(kernel_trace.rotated_copies((x, w), min_bytes=1)) == 1
    assert kernel_trace.traced_seconds(lambda x, w: x @ w, sets, tmp_path / "turns") > 0
