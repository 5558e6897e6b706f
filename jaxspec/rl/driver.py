"""`jaxspec train`'s driver: runs (or resumes) a GRPO run's steps (`jaxspec.rl.loop.GRPORun`) in the
loop every training command shares (`jaxspec.run.RunLoop`: metrics, progress, SIGTERM / Ctrl-C and
the job's time limit, the end of the run), and exports the trained policy and head.

Run directory layout:
    config.yaml          the resolved config (a resumed run must keep everything but RESUMABLE_KEYS)
    data/                generated prompt files (when data.train / data.eval are not given)
    checkpoints/<step>/  orbax checkpoints of the training state (see `checkpointing`)
    metrics.jsonl        one JSON object per step (and one for the validation before training)
    tensorboard/         TensorBoard scalars (train.tensorboard)
    policy/              the trained policy as an HF folder, with its tokenizer
    draft/               the adapted EAGLE-3 head (draft.online), public EAGLE-3 layout
    xla_cache/           the persistent compilation cache (train.compilation_cache: true, or null with accelerators)

SIGTERM (e.g. SLURM preemption) or Ctrl-C makes the run checkpoint at the next step boundary and
return, and so does a time limit (JAXSPEC_STOP_BY: at the last step boundary from which another
step and a checkpoint would still end in time, `jaxspec.run.deadline`); --resume restores the
newest checkpoint that restores completely (`jaxspec.run.Checkpointer.resume`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from jaxspec.distributed import say
from jaxspec.rl.compilation import cache_dir, compilation_cache
from jaxspec.rl.config import FIXED_ON_RESUME, GRPOConfig
from jaxspec.rl.loop import GRPORun, rollout_source
from jaxspec.rl.resources import RunInputs, check_inputs
from jaxspec.rl.rollout_source import RolloutSetup, RolloutSource
from jaxspec.run import RunLoop, check_run_dir


def train(
    cfg: GRPOConfig,
    run_dir,
    resume: bool = False,
    inputs: RunInputs | None = None,
    on_step: Callable[[dict], None] | None = None,
    make_rollouts: Callable[[RolloutSetup], RolloutSource] = rollout_source,
) -> dict:
    """Runs (or resumes) GRPO for cfg.train.steps steps.

    inputs: the result of `check_inputs(cfg)` when the caller already checked the config.
    on_step: called on process 0 with each metrics record as it is logged (e.g. live plots).
    make_rollouts: the run's rollout source (`GRPORun`); the one rollout.mode asks for by default.
    Returns {"step", "preempted", "last": the last step's metrics record, "run_dir"}.
    """
    run_dir = Path(run_dir)
    inputs = check_inputs(cfg) if inputs is None else inputs
    check_run_dir(run_dir, resume, cfg, FIXED_ON_RESUME)
    loop = RunLoop(run_dir, progress=cfg.train.progress, tensorboard=cfg.train.tensorboard, on_record=on_step)
    run_dir.mkdir(parents=True, exist_ok=True)
    with compilation_cache(cache_dir(cfg.train.compilation_cache, run_dir), cfg.train.compilation_cache_min_compile_s):
        run = GRPORun(cfg, run_dir, resume, inputs, make_rollouts)
        outcome = loop.run(GRPOProgram(run))
    return {"step": run.step, "preempted": not outcome.finished, "last": outcome.last, "run_dir": str(run_dir)}


class GRPOProgram:
    """A GRPO run's part of `jaxspec.run.RunLoop`: its steps (validation and checkpoints inside
    them, timed in their records), the validation before the first step, the export."""

    name = "grpo"

    def __init__(self, run: GRPORun):
        self.run = run
        self.steps, self.resumed, self.checkpointer = run.cfg.train.steps, run.resumed, run.checkpointer
        self.first_step, self._last = run.step, {}

    @property
    def step(self) -> int:
        return self.run.step

    def run_step(self) -> tuple[list[dict], dict[str, str]]:
        record = self._last = self.run.run_step()
        if "eval_accuracy" in record:
            say(f"step {record['step']}: validation accuracy {record['eval_accuracy']:.3f}")
        fields = {
            "reward": f"{record['reward_mean']:.3f}",
            "acc": f"{record['accuracy']:.2f}",
            "accept": f"{record['acceptance_length']:.2f}",
            "step_s": f"{record['time_step_s']:.1f}",
        }
        return [record], fields

    def save(self) -> None:
        self.run.save()

    def evaluate(self, final: bool) -> dict | None:
        """The validation before training (step 0); the last step's is in its record."""
        if final or self.run.eval_set is None:
            return None
        record = {"step": 0, **self.run.evaluate()}
        say(f"step 0: validation accuracy {record['eval_accuracy']:.3f}")
        return record

    def export(self, seconds: float) -> None:
        self.run.export()
        say(self._summary(seconds))

    def close(self) -> None:
        self.run.rollouts.close()

    def _summary(self, seconds: float) -> str:
        """The end-of-run line: steps, wall time, the last step's reward and acceptance, the outputs."""
        run, last = self.run, self._last
        parts = [f"grpo done: {run.step} steps ({run.step - self.first_step} in this process) in {seconds:.1f} s"]
        if "reward_mean" in last:
            parts.append(
                f"final reward {last['reward_mean']:.3f}, accuracy {last['accuracy']:.2f}, "
                f"acceptance length {last['acceptance_length']:.2f}"
            )
        outputs = f"policy in {run.run_dir / 'policy'}"
        if run.online is not None:
            outputs += f", draft in {run.run_dir / 'draft'}"
        return "; ".join(parts + [outputs])
