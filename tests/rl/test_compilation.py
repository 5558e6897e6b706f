"""Compiling the trainer ahead of time and the persistent compilation cache: no stalls after step 1,
fewer compilations in a second run, and a failed background compilation compiled again instead of
ending the run."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec.rl.compilation as compilation
import jaxspec.rl.loop as loop
from jaxspec.rl.batch import TrainingRows, pack_rows, packed_row_count, packed_row_counts
from jaxspec.rl.compilation import Program, cache_dir, compilation_cache, compile_failed, precompile
from jaxspec.rl.metrics import PhaseTimer
from jaxspec.run import Batcher
from jaxspec.tasks import ChatTokenizer, generate_problems, write_problems
from tests.rl.runs import read_metrics, train_cli, without_machine_keys, write_config

pytestmark = pytest.mark.slow

STEPS = 3


def test_packed_row_counts_hold_every_packing():
    rng = np.random.default_rng(0)
    width, shortest = 40, 9
    for multiple_of in (1, 2, 4):
        counts = packed_row_counts(16, width, shortest, multiple_of)
        assert counts == sorted(counts) and all(r % multiple_of == 0 for r in counts)
        seen = set()
        for low, high in ((shortest, shortest), (shortest, 20), (15, 30), (width // 2 + 1, width), (width, width)):
            for _ in range(20):
                lengths = rng.integers(low, high + 1, size=16)
                attn_mask = np.arange(width)[None, :] < lengths[:, None]
                rows = TrainingRows(
                    tokens=np.ones((16, width), np.int32),
                    attn_mask=attn_mask,
                    resp_index=np.zeros((16, 2), np.int32),
                    resp_tokens=np.zeros((16, 2), np.int32),
                    resp_mask=np.ones((16, 2), bool),
                )
                seen.add(pack_rows(rows, multiple_of).tokens.shape[0])
        assert seen <= set(counts) and {counts[0], counts[-1]} <= seen, (multiple_of, seen, counts)


def test_packed_row_count_is_the_smallest_2k_or_3_2k_with_at_most_a_third_padding():
    sizes = sorted({1 << k for k in range(10)} | {3 << k for k in range(10)})  # 1, 2, 3, 4, 6, 8, 12, ...
    for multiple_of in (1, 2, 4):
        for filled in range(1, 300):
            rows = packed_row_count(filled, multiple_of)
            groups = -(-filled // multiple_of)
            assert rows % multiple_of == 0 and rows // multiple_of == min(s for s in sizes if s >= groups)
            assert rows - groups * multiple_of <= rows / 3, (filled, multiple_of, rows)
    assert [packed_row_count(n) for n in (5, 7, 9, 13, 17, 25)] == [6, 8, 12, 16, 24, 32]


class _BarrierProgram:
    """A stand-in for a jitted function whose compilation waits until `parties` compile at once."""

    def __init__(self, barrier: threading.Barrier, timeout_s: float):
        self.barrier, self.timeout_s = barrier, timeout_s

    def lower(self, *args):
        return self

    def compile(self):
        self.barrier.wait(timeout=self.timeout_s)


def test_precompile_compiles_threads_programs_at_once(capsys):
    """train.precompile_threads programs compile concurrently: each of these finishes only once 3
    are compiling together, so fewer workers break the barrier, and the future lists them failed."""
    barrier = threading.Barrier(3)
    programs = [Program("update", r, _BarrierProgram(barrier, 30.0), ()) for r in range(6)]
    assert precompile(programs, threads=3).result(timeout=60) == []
    barrier = threading.Barrier(3)
    programs = [Program("update", r, _BarrierProgram(barrier, 1.0), ()) for r in range(3)]
    assert precompile(programs, threads=2).result(timeout=60) == programs
    assert capsys.readouterr().out.count("BrokenBarrierError") == 3


class _FlakyProgram:
    """A stand-in for a jitted function whose first `failures` compilations raise."""

    def __init__(self, failures: int):
        self.failures, self.compiled = failures, 0

    def lower(self, *args):
        return self

    def compile(self):
        if self.failures:
            self.failures -= 1
            raise jax.errors.JaxRuntimeError("NOT_FOUND: All configs failed during profiling\nmore detail")
        self.compiled += 1


def test_a_failed_background_compilation_is_logged_and_compiled_again(capsys):
    """One line names the program, its row count and the error; `compile_failed` compiles it in the
    calling thread, and a failure that repeats there raises."""
    fine, flaky = _FlakyProgram(0), _FlakyProgram(1)
    programs = [Program("log-prob scoring", 12, fine, ()), Program("minibatch update", 24, flaky, ())]
    failed = precompile(programs, threads=2).result(timeout=60)
    assert failed == programs[1:] and (fine.compiled, flaky.compiled) == (1, 0)
    assert capsys.readouterr().out.splitlines() == [
        "precompile: the minibatch update for R = 24 packed rows failed to compile (JaxRuntimeError: NOT_FOUND: "
        "All configs failed during profiling); it compiles again in the foreground"
    ]
    compile_failed(failed)
    assert flaky.compiled == 1
    with pytest.raises(jax.errors.JaxRuntimeError, match="All configs failed"):
        compile_failed([Program("minibatch update", 24, _FlakyProgram(2), ())] * 2)


def test_cache_dir_setting(tmp_path):
    assert cache_dir(True, tmp_path) == tmp_path / "xla_cache"
    assert cache_dir(False, tmp_path) is None
    assert cache_dir(None, tmp_path, backend="cpu") is None  # the default: off on the CPU
    assert cache_dir(None, tmp_path, backend="gpu") == tmp_path / "xla_cache"
    assert cache_dir(str(tmp_path / "shared"), tmp_path / "run") == tmp_path / "shared"


def test_cached_programs_are_read_back_not_compiled(tmp_path):
    f = jax.jit(lambda x: jnp.cos(x) * 5)
    session_cache = jax.config.jax_compilation_cache_dir
    with compilation_cache(tmp_path, min_compile_s=0.0):
        f(np.ones(6, np.float32)).block_until_ready()
        assert any(path.name.startswith("jit_") for path in tmp_path.iterdir())
        jax.clear_caches()
        timer = PhaseTimer()
        f(np.ones(6, np.float32)).block_until_ready()
        record = timer.record()
    assert record["compiles"] == 0 and record["compiles_cached"] == 1
    assert jax.config.jax_compilation_cache_dir == session_cache  # the settings end with the block


def _prompt_file(path, tokenizer_dir) -> str:
    """8 prompts whose rollouts pack into 16 rows at step 1 and 32 at step 2: 3 short arithmetic
    problems (<= 16 tokens with the template: 3 sequences share a row of W = 64 + 8 tokens), all in
    step 1, and 5 long word problems (57-64 tokens: a row each). Every step holds a long prompt, so
    the rollouts keep one prompt bucket and their compilations."""
    tok = ChatTokenizer.from_file(tokenizer_dir)
    problems = generate_problems(200, 0, (1,))
    short = [p for p in problems if len(tok.encode_prompt(p["question"])) <= 16][:3]
    long = [p for p in problems if 57 <= len(tok.encode_prompt(p["question"])) <= 64][:5]
    order = Batcher(8, 4, seed=0).indices(0)  # the run's first prompts (data.seed 0)
    problems = long[:]
    for i in sorted(order[:3]):
        problems.insert(i, short.pop())
    return str(write_problems(path, problems))


@pytest.fixture(scope="module")
def precompiled_run(tiny_policy, tmp_path_factory):
    """STEPS steps of the shared run config (online draft, log-prob recomputation, KL) from cleared jit
    caches, one minibatch per epoch (the head trains on the first epoch's; the second runs the
    policy-only update: both programs are precompiled), the trainer precompiled by
    train.precompile_threads = 2 workers and every program written to a persistent cache. Returns
    (config, overrides, run dir, cache dir, the (sequences, packed rows) of each step's packings)."""
    root = tmp_path_factory.mktemp("precompiled")
    config = write_config(root / "run.yaml", tiny_policy[0], steps=STEPS, eval_every=0, checkpoint_every=STEPS)
    overrides = [
        f"data.train={_prompt_file(root / 'train.jsonl', tiny_policy[0])}",
        "loss.minibatches=1",
        "draft.train_every=2",
        "train.precompile=true",
        "train.precompile_threads=2",
        f"train.compilation_cache={root / 'cache'}",
        "train.compilation_cache_min_compile_s=0",
    ]
    rows_per_step, precompile_threads = [], []
    run_step, pack, start_precompile = loop.GRPORun.run_step, loop.pack_rows, loop.precompile

    def counting_step(run):
        rows_per_step.append(set())
        return run_step(run)

    def counting_pack(rows, multiple_of=1):
        packed = pack(rows, multiple_of)
        rows_per_step[-1].add(packed.resp_index.shape[:1] + packed.tokens.shape[:1])  # (S, R)
        return packed

    jax.clear_caches()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop.GRPORun, "run_step", counting_step)
        patch.setattr(loop, "pack_rows", counting_pack)
        patch.setattr(
            loop,
            "precompile",
            lambda programs, threads: (precompile_threads.append(threads), start_precompile(programs, threads))[1],
        )
        assert train_cli("--config", config, "--run-dir", root / "run", *overrides) == 0
    assert precompile_threads == [2], "train.precompile_threads sets the compiling workers"
    return config, overrides, root / "run", root / "cache", rows_per_step


def test_no_step_after_the_first_compiles(precompiled_run):
    _, _, run_dir, _, rows_per_step = precompiled_run
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[0]["compiles"] > 0 and [r["compiles"] for r in records[1:]] == [0] * (STEPS - 1)
    assert records[0]["time_precompile_s"] >= 0 and all("time_precompile_s" not in r for r in records[1:])
    # Step 2 packed 32 rollouts into 32 rows instead of 16 and still compiled nothing.
    assert rows_per_step[:2] == [{(32, 16)}, {(32, 32)}], rows_per_step


def test_a_second_run_reads_the_compilation_cache(precompiled_run, tmp_path):
    config, overrides, first_dir, cache, _ = precompiled_run
    for program in ("jit_minibatch_gradients-", "jit_minibatch_step-"):  # the update's two programs
        assert any(path.name.startswith(program) for path in cache.iterdir()), program
    jax.clear_caches()  # as in a new process
    session_cache = jax.config.jax_compilation_cache_dir
    assert (
        train_cli(
            "--config", config, "--run-dir", tmp_path / "second", *overrides, "train.steps=1", "train.precompile=false"
        )
        == 0
    )
    first, second = read_metrics(first_dir)[0], read_metrics(tmp_path / "second")[0]
    assert second["compiles"] < first["compiles"] / 4 and second["compiles_cached"] > 0, (first, second)
    assert second["time_compile_s"] < first["time_compile_s"] / 4
    assert jax.config.jax_compilation_cache_dir == session_cache  # the run's cache settings end with it


def test_a_run_whose_background_compilations_fail_goes_on_unchanged(precompiled_run, tmp_path, capsys):
    """The fault of a GPU start (XLA's autotuner failing a background compilation beside the
    rollouts), injected: the first compilation of the update with the online head at R = 16 rows
    (step 1 calls it) and at R = 32 (step 2's) raises. The run logs each in one line, compiles them
    in the foreground, and matches the run without the fault: the same metrics, and still nothing
    compiled after step 1 (the programs come from the first run's persistent cache)."""
    config, overrides, first_dir, _, _ = precompiled_run
    compile_one, failed = compilation._compile_one, []

    def failing_once(program):
        if program.name == "minibatch update" and program.rows in (16, 32) and program.rows not in failed:
            failed.append(program.rows)
            raise jax.errors.JaxRuntimeError("NOT_FOUND: All configs failed during profiling (injected)")
        compile_one(program)

    jax.clear_caches()
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compilation, "_compile_one", failing_once)
        assert train_cli("--config", config, "--run-dir", tmp_path / "run", *overrides) == 0
    logged = [line for line in capsys.readouterr().out.splitlines() if line.startswith("precompile:")]
    assert sorted(failed) == [16, 32] and sorted(logged) == [
        f"precompile: the minibatch update for R = {rows} packed rows failed to compile (JaxRuntimeError: "
        "NOT_FOUND: All configs failed during profiling (injected)); it compiles again in the foreground"
        for rows in (16, 32)
    ]
    records = read_metrics(tmp_path / "run")
    assert without_machine_keys(records) == without_machine_keys(read_metrics(first_dir))
    assert [(r["compiles"], r["compiles_cached"]) for r in records[1:]] == [(0, 0)] * (STEPS - 1), records


def test_gathered_rollout_weights_compile_nothing_after_the_first_step(tiny_policy, tmp_path):
    """rollout.gather_weights on an fsdp=2 mesh: the sync's cast-and-gather program and the rollouts
    that read the gathered copy compile in step 1 only (a precompiled trainer without draft or
    reference, to keep it short). The last step is left out: on a mesh, the first checkpoint
    compiles programs of its own (slices)."""
    steps = STEPS
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=steps, eval_every=0, checkpoint_every=steps)
    overrides = [
        f"data.train={_prompt_file(tmp_path / 'train.jsonl', tiny_policy[0])}",
        "loss.minibatches=1",
        "spec.method=none",
        "draft.online=false",
        "loss.kl_beta=0",
        "train.precompile=true",
        "train.compilation_cache=false",
        "mesh.fsdp=2",
        "rollout.dtype=bfloat16",
        "rollout.gather_weights=true",
    ]
    jax.clear_caches()
    assert train_cli("--config", config, "--run-dir", tmp_path / "run", *overrides) == 0
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert records[0]["compiles"] > 0 and [r["compiles"] for r in records[1:-1]] == [0] * (steps - 2), records
