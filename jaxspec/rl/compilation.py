"""Compiling the trainer before its first use, and the persistent XLA compilation cache.

`pack_rows` packs the sequences of a minibatch into R rows, and each R is a new input shape of
the programs that read packed rows: the minibatch update (the online draft's update is part of
it; with draft.train_every > 1 also the policy-only update of the minibatches the head skips)
and, with loss.recompute_logprobs or loss.kl_beta > 0, the log-prob scoring of the whole
batch. `precompile` compiles them for every R the run can produce (`packed_row_counts`) in
background threads. The executables land in JAX's jit caches, so the loop's ordinary calls find
them; a call whose program is still compiling waits for that compilation instead of starting
its own.

A background compilation that fails does not end the run. On a GPU, XLA's autotuner times
candidate kernels on the device while the rollouts (and the other compilations' autotuning) run
there, and it can reject every candidate of a fusion on a spurious check ("All configs failed
during profiling ... Redzone mismatch") in a start that is otherwise fine. The failure is logged
in one line naming the program and its R, and the program compiles again in the foreground
(`compile_failed`, step 1's "precompile" phase), once step 1 has trained and its rollouts are
done: nothing else runs on the device then. A call that needs the program earlier compiles it
itself (JAX keeps no failed compilation). A failure that repeats in the foreground is the
program's own, and raises. Background compilations keep the autotuner on: a program compiled
with `xla_gpu_autotune_level` 0 runs untuned kernels for the whole run, and its compiler options
are part of the jit cache key, so the loop's calls would compile it once more anyway.

`compilation_cache` points JAX's persistent cache at a directory for the length of a run, so a
resumed or repeated run reads its programs back instead of compiling them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache as cache
from tqdm import tqdm

from jaxspec.models.config import ModelConfig
from jaxspec.models.moe import expert_id_dtype
from jaxspec.rl.batch import PackedRows, packed_row_counts
from jaxspec.rl.config import GRPOConfig, GRPOLossConfig
from jaxspec.rl.online_draft import OnlineDraftState
from jaxspec.rl.step import MinibatchUpdate
from jaxspec.run.placement import Placement, abstract


class Program(NamedTuple):
    """One call of a packed-row program, compiled ahead of the loop's: `fn` (a jitted function or
    a `MinibatchUpdate`, its programs) on the abstract arguments `args`, whose packed rows number
    `rows` (R); `name` says which program it is in the logs."""

    name: str
    rows: int
    fn: Callable
    args: tuple


def packed_inputs(
    placement: Placement,
    rows: int,
    seqs: int,
    width: int,
    max_new: int,
    loss: GRPOLossConfig | None,
    seq_resp_mask: bool = False,
    model: ModelConfig | None = None,
) -> PackedRows:
    """The abstract `PackedRows` of S = seqs sequences in R = rows rows of width W (N = max_new),
    placed as `Placement.rows` places them, with the fields the run's step fills in: the rows alone
    (loss None: log-prob scoring) or a minibatch with `loss`'s inputs (ref_logp with loss.kl_beta >
    0, behaviour_logp with `GRPOLossConfig.weighs_behaviour`) and seq_resp_mask when the online head trains on it.
    model: the mixture-of-experts policy whose rollouts record their experts (None: not recorded),
    which the rows for scoring hold, and a minibatch with loss.routing_replay."""

    def array(shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=placement.row_sharding(shape))

    experts = None
    if model is not None and (loss is None or loss.routing_replay):
        experts = array(
            (rows, width, len(model.sparse_layers), model.num_experts_per_tok), expert_id_dtype(model.num_experts)
        )
    packed = PackedRows(
        tokens=array((rows, width), np.int32),
        segment_ids=array((rows, width), np.int32),
        resp_index=array((seqs, max_new), np.int32),
        resp_tokens=array((seqs, max_new), np.int32),
        experts=experts,
    )
    if loss is None:
        return packed
    logp = array((seqs, max_new), np.float32)
    return packed.replace(
        seq_resp_mask=array((rows, width), np.bool_) if seq_resp_mask else None,
        advantages=array((seqs,), np.float32),
        prox_logp=logp,
        loss_mask=array((seqs, max_new), np.bool_),
        loss_denominator=array((seqs,), np.float32),
        ref_logp=logp if loss.kl_beta > 0 else None,
        behaviour_logp=logp if loss.weighs_behaviour else None,
    )


def trainer_programs(
    cfg: GRPOConfig,
    state: dict,
    placement: Placement,
    width: int,
    shortest: int,
    *,
    score: Callable,
    ref_score: Callable,
    update: Callable,
    policy_update: Callable | None,
    online: bool,
    model: ModelConfig | None = None,
) -> list[Program]:
    """Every call of a run's packed-row programs, one per row count R: the log-prob scoring of the
    whole batch (with loss.recompute_logprobs), the reference scoring (with loss.kl_beta > 0) and
    the minibatch updates (`update` with the online head when `online`, `policy_update` without
    it), each in ascending R. state: the run's training state (arrays or their abstract values);
    width: the packed row width; shortest: the fewest tokens of a prompt plus one response token;
    model: the policy when its rollouts record their experts (`packed_inputs`), else None."""
    state = abstract(state)
    batch = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt

    def calls(seqs: int, loss: GRPOLossConfig | None, seq_resp_mask: bool = False) -> Iterator[tuple[int, PackedRows]]:
        for rows in packed_row_counts(seqs, width, shortest, placement.row_shards):
            yield (
                rows,
                packed_inputs(placement, rows, seqs, width, cfg.rollout.max_new_tokens, loss, seq_resp_mask, model),
            )

    def scored(rows: PackedRows) -> tuple:
        return rows.tokens, rows.segment_ids, rows.resp_index, rows.resp_tokens

    programs = []
    if cfg.loss.recompute_logprobs:
        programs += [
            Program(
                "log-prob scoring",
                r,
                score,
                (state["params"], *scored(rows), *([] if rows.experts is None else [rows.experts])),
            )
            for r, rows in calls(batch, None)
        ]
    if cfg.loss.kl_beta > 0:
        programs += [
            Program("reference scoring", r, ref_score, (state["ref_params"], *scored(rows)))
            for r, rows in calls(batch, None)
        ]
    seqs = batch // cfg.loss.minibatches
    if online:
        draft = OnlineDraftState.from_checkpoint(state).update_args()
        programs += [
            Program("minibatch update", r, update, (state["params"], state["opt_state"], *draft, rows))
            for r, rows in calls(seqs, cfg.loss, seq_resp_mask=True)
        ]
    if policy_update is not None:
        name = "minibatch update" if not online else "policy-only update"
        programs += [
            Program(name, r, policy_update, (state["params"], state["opt_state"], None, None, None, rows))
            for r, rows in calls(seqs, cfg.loss)
        ]
    return programs


def precompile_enabled(setting: bool | None) -> bool:
    """train.precompile; null = on when the devices are accelerators, whose host cores compile
    beside the rollouts, off on the CPU, where compiling takes the rollouts' cores."""
    return jax.default_backend() != "cpu" if setting is None else setting


def precompile(programs: Sequence[Program], threads: int) -> Future:
    """Compiles `programs` in the background, up to `threads` at once. The future's result, once
    all are done, is the list of those whose compilation raised (each logged in one line), for
    `compile_failed`."""
    driver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="precompile")
    future = driver.submit(_compile, programs, threads)
    driver.shutdown(wait=False)
    return future


def compile_failed(programs: Sequence[Program]) -> None:
    """Compiles, one at a time in the calling thread, the programs whose background compilation
    failed (`precompile`'s result): a second failure raises."""
    for program in programs:
        _compile_one(program)


def _compile(programs: Sequence[Program], threads: int) -> list[Program]:
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="precompile-program") as pool:
        compiled = [pool.submit(_try_compile, program) for program in programs]
        return [program for program, done in zip(programs, compiled) if not done.result()]


def _try_compile(program: Program) -> bool:
    """Whether `program` compiled; a failure is logged in one line (the program, its R and the
    error's first line)."""
    try:
        _compile_one(program)
        return True
    except Exception as error:  # retried by compile_failed, which raises if it fails again
        lines = str(error).strip().splitlines()
        cause = f"{type(error).__name__}: {lines[0][:200] if lines else ''}"
        prefix = "" if jax.process_count() == 1 else f"process {jax.process_index()}: "
        tqdm.write(
            f"{prefix}precompile: the {program.name} for R = {program.rows} packed rows failed to compile "
            f"({cause}); it compiles again in the foreground"
        )
        return False


def _compile_one(program: Program) -> None:
    if isinstance(program.fn, MinibatchUpdate):
        program.fn.compile(*program.args)
    else:
        program.fn.lower(*program.args).compile()


def cache_dir(setting: bool | str | None, run_dir: Path, backend: str | None = None) -> Path | None:
    """train.compilation_cache as a directory: true = <run-dir>/xla_cache, false = None (off),
    None = <run-dir>/xla_cache unless `backend` (default: JAX's) is the CPU."""
    if isinstance(setting, str):
        return Path(setting)
    if setting is None:
        setting = (backend or jax.default_backend()) != "cpu"
    return run_dir / "xla_cache" if setting else None


@contextlib.contextmanager
def compilation_cache(path: Path | None, min_compile_s: float) -> Iterator[None]:
    """JAX's persistent compilation cache in `path` inside the block (None: JAX's settings are left
    as they are). Programs that took at least `min_compile_s` seconds to compile are written there,
    whatever their size, and read back by later compilations of the same program; the previous
    settings return after the block."""
    if path is None:
        yield
        return
    settings = {
        "jax_compilation_cache_dir": str(path),
        "jax_persistent_cache_min_compile_time_secs": min_compile_s,
        "jax_persistent_cache_min_entry_size_bytes": -1,
    }
    previous = {name: getattr(jax.config, name) for name in settings}
    _configure(settings)
    try:
        yield
    finally:
        _configure(previous)


def _configure(settings: dict) -> None:
    """Applies cache settings; the cache reopens at its (new) directory on the next compilation."""
    for name, value in settings.items():
        jax.config.update(name, value)
    cache.reset_cache()
