"""`jaxspec train`'s driver: runs (or resumes) a GRPO run's steps (`jaxspec.rl.loop.GRPORun`), logs
each step's metrics, stops cleanly on SIGTERM / Ctrl-C and exports the trained policy and head.

Run directory layout:
    config.yaml          the resolved config (a resumed run must keep everything but RESUMABLE_KEYS)
    data/                generated prompt files (when data.train / data.eval are not given)
    checkpoints/<step>/  orbax checkpoints of the training state (see `checkpointing`)
    metrics.jsonl        one JSON object per step (and one for the validation before training)
    tensorboard/         TensorBoard scalars (train.tensorboard)
    policy/              the trained policy as an HF folder, with its tokenizer
    draft/               the adapted EAGLE-3 head (draft.online), public EAGLE-3 layout
    xla_cache/           the persistent compilation cache (train.compilation_cache: true)

SIGTERM (e.g. SLURM preemption) or Ctrl-C makes the run checkpoint at the next step boundary and
return (`jaxspec.run.StopSignals`), and so does a time limit (JAXSPEC_STOP_BY: at the last step
boundary from which another step and a checkpoint would still end in time, `jaxspec.run.deadline`);
--resume restores the newest checkpoint that restores completely (`jaxspec.run.Checkpointer.resume`).
When the run fails, the first error is the one raised: closing the checkpointer and the logs
afterwards stays silent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from jaxspec.distributed import any_process, is_main, say
from jaxspec.rl.checkpointing import check_run_dir
from jaxspec.rl.compilation import cache_dir, compilation_cache
from jaxspec.rl.config import GRPOConfig
from jaxspec.rl.loop import GRPORun
from jaxspec.rl.metrics import MetricsLog
from jaxspec.rl.resources import RunInputs, check_inputs
from jaxspec.run import Progress, StopSignals
from jaxspec.run.deadline import Deadline


def train(
    cfg: GRPOConfig,
    run_dir,
    resume: bool = False,
    inputs: RunInputs | None = None,
    on_step: Callable[[dict], None] | None = None,
) -> dict:
    """Runs (or resumes) GRPO for cfg.train.steps steps.

    inputs: the result of `check_inputs(cfg)` when the caller already checked the config.
    on_step: called on process 0 with each metrics record as it is logged (e.g. live plots).
    Returns {"step", "preempted", "last": the last step's metrics record, "run_dir"}.
    """
    run_dir = Path(run_dir)
    inputs = check_inputs(cfg) if inputs is None else inputs
    check_run_dir(cfg, run_dir, resume)
    deadline = Deadline.from_env()
    run_dir.mkdir(parents=True, exist_ok=True)
    with compilation_cache(cache_dir(cfg.train.compilation_cache, run_dir), cfg.train.compilation_cache_min_compile_s):
        return _train(cfg, run_dir, resume, inputs, on_step if is_main() else None, deadline)


def _train(
    cfg: GRPOConfig,
    run_dir: Path,
    resume: bool,
    inputs: RunInputs,
    on_step: Callable[[dict], None] | None,
    deadline: Deadline,
) -> dict:
    run = GRPORun(cfg, run_dir, resume, inputs)
    log = MetricsLog(
        run_dir / "metrics.jsonl", run_dir / "tensorboard" if cfg.train.tensorboard else None, enabled=is_main()
    )
    deadline.record(run.history[-3:])
    last: dict = {}
    preempted, failed, start, first_step = False, True, time.perf_counter(), run.step
    try:
        with (
            StopSignals(announce=is_main()) as stop,
            Progress("grpo", cfg.train.steps, run.step, cfg.train.progress and is_main()) as bar,
        ):
            if run.eval_set is not None and run.step == 0:
                last = {"step": 0, **run.evaluate()}
                log.write(last)
                if on_step is not None:
                    on_step(last)
                say(f"step 0: validation accuracy {last['eval_accuracy']:.3f}")
            while run.step < cfg.train.steps and not any_process(stop.requested or _out_of_time(deadline, run)):
                last = run.run_step()
                log.write(last)
                deadline.record([last])
                if on_step is not None:
                    on_step(last)
                bar.update(
                    1,
                    reward=f"{last['reward_mean']:.3f}",
                    acc=f"{last['accuracy']:.2f}",
                    accept=f"{last['acceptance_length']:.2f}",
                    step_s=f"{last['time_step_s']:.1f}",
                )
                if "eval_accuracy" in last:
                    say(f"step {run.step}: validation accuracy {last['eval_accuracy']:.3f}")
            if run.step < cfg.train.steps:
                preempted = True
                if run.checkpointer.latest_step() != run.step:
                    run.save()
                why = stop.name or ("SIGTERM" if not deadline.too_late() else f"time limit ({deadline.reason()})")
                say(f"{why}: checkpointed step {run.step} in {run_dir / 'checkpoints'}; continue with --resume")
        failed = False
    finally:
        _close(run, log, quietly=failed)
    if not preempted:
        run.export()
        say(_summary(run, last, time.perf_counter() - start, first_step))
    return {"step": run.step, "preempted": preempted, "last": last, "run_dir": str(run_dir)}


def _out_of_time(deadline: Deadline, run: GRPORun) -> bool:
    deadline.checkpoint_written(run.checkpointer.longest_write_s)
    return deadline.too_late()


def _close(run: GRPORun, log: MetricsLog, quietly: bool) -> None:
    """Closes the rollout worker, the metrics log and the checkpointer (waiting for the checkpoint
    in flight); raises the first error, unless `quietly` (the run is failing: its first error is
    the one to report)."""
    closers = ([run.async_rollouts.close] if run.async_rollouts is not None else []) + [
        log.close,
        run.checkpointer.close,
    ]
    first = None
    for close in closers:
        try:
            close()
        except Exception as err:
            first = first or err
    if first is not None and not quietly:
        raise first


def _summary(run: GRPORun, last: dict, seconds: float, first_step: int) -> str:
    """The end-of-run line: steps, wall time, the last step's reward and acceptance, the outputs."""
    parts = [f"grpo done: {run.step} steps ({run.step - first_step} in this process) in {seconds:.1f} s"]
    if "reward_mean" in last:
        parts.append(
            f"final reward {last['reward_mean']:.3f}, accuracy {last['accuracy']:.2f}, "
            f"acceptance length {last['acceptance_length']:.2f}"
        )
    outputs = f"policy in {run.run_dir / 'policy'}"
    if run.online is not None:
        outputs += f", draft in {run.run_dir / 'draft'}"
    return "; ".join(parts + [outputs])
