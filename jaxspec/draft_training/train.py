"""Offline EAGLE-3 training against a frozen policy that generates its own training data.

Each step: B prompts -> the policy samples responses (`jaxspec.rollout.generate`) -> one
`forward_hidden` over prompt || response for the aux hidden states and logits -> `eagle3_loss`
on the response positions -> AdamW update of the head.

Run directory layout:
    config.yaml          the resolved config (a resumed run must keep policy/data/generation/head)
    token_counts.npy     policy-token counts the reduced vocabulary was chosen from
    checkpoints/<step>/  orbax checkpoints of {weights, buffers, opt_state, step}
    metrics.jsonl        one JSON object per log line, and the final evaluation
    draft/               the exported head in the public EAGLE-3 layout (or train.export_dir)
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml

from jaxspec.config_io import to_dict
from jaxspec.distributed import say
from jaxspec.draft.checkpoint import load_eagle3, save_eagle3
from jaxspec.draft.config import DraftConfig, check_compatible
from jaxspec.draft.loss import eagle3_loss
from jaxspec.draft.model import init_eagle3, merge_buffers, split_buffers
from jaxspec.draft_training.config import FIXED_ON_RESUME, DraftTrainConfig, HeadLossConfig, HeadOptimConfig
from jaxspec.draft_training.data import RolloutBatch, RolloutBatches, count_tokens, prompt_pool
from jaxspec.models.checkpoint import load_hf
from jaxspec.models.config import ModelConfig
from jaxspec.models.params import Params
from jaxspec.models.sharding import Sharding, shard_params
from jaxspec.models.transformer import forward_hidden
from jaxspec.optim import make_optimizer
from jaxspec.run import Checkpointer, RunLoop, check_run_dir
from jaxspec.run.placement import Placement, abstract
from jaxspec.tasks.tokenizer import ChatTokenizer

_EVAL_SEED_OFFSET = 1_000_003  # evaluation prompts and rollouts never share the training stream


def _features(cfg: ModelConfig, dcfg: DraftConfig, policy: Params, batch: dict, sharding: Sharding | None):
    """Policy logits [B, W, V] and aux hidden states [3, B, W, H] of a batch (no gradient); on a
    mesh the activations are split over its batch axes like the rows."""
    logits, aux = forward_hidden(
        cfg, policy, batch["tokens"], dcfg.aux_layer_ids, mask=batch["attn_mask"], sharding=sharding
    )
    return jax.lax.stop_gradient(logits), jax.lax.stop_gradient(aux)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), static_argnames=("sharding",), donate_argnums=(5, 6))
def train_step(
    cfg: ModelConfig,
    dcfg: DraftConfig,
    optim: HeadOptimConfig,
    total_steps: int,
    loss: HeadLossConfig,
    weights: dict,
    opt_state,
    buffers: dict,
    policy: Params,
    batch: dict,
    *,
    sharding: Sharding | None = None,
):
    """One AdamW step of the head: -> (weights, opt_state, metrics). The policy is read only;
    weights and opt_state are donated. batch: {"tokens", "loss_mask", "attn_mask"} [B, W].
    sharding: the run's mesh (None on one device)."""
    optimizer, _ = make_optimizer(optim, total_steps)
    logits, aux = _features(cfg, dcfg, policy, batch, sharding)

    def loss_fn(w):
        return eagle3_loss(
            dcfg,
            merge_buffers(w, buffers),
            policy["embed"],
            aux,
            logits,
            batch["tokens"],
            batch["loss_mask"],
            loss.num_steps,
            loss.step_decay,
        )

    (value, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(weights)
    updates, opt_state = optimizer.update(grads, opt_state, weights)
    weights = optax.apply_updates(weights, updates)
    return weights, opt_state, {"loss": value, "grad_norm": optax.tree.norm(grads), **metrics}


@functools.partial(jax.jit, static_argnums=(0, 1, 2), static_argnames=("sharding",))
def eval_step(
    cfg: ModelConfig,
    dcfg: DraftConfig,
    loss: HeadLossConfig,
    dparams: dict,
    policy: Params,
    batch: dict,
    *,
    sharding: Sharding | None = None,
):
    """(loss, metrics) of the head on a batch, without an update."""
    logits, aux = _features(cfg, dcfg, policy, batch, sharding)
    return eagle3_loss(
        dcfg,
        dparams,
        policy["embed"],
        aux,
        logits,
        batch["tokens"],
        batch["loss_mask"],
        loss.num_steps,
        loss.step_decay,
    )


def _device_batch(batch: RolloutBatch, placement: Placement) -> dict:
    """The batch's arrays, their rows split over the mesh's batch axes (on one device: device 0)."""
    rows = {"tokens": batch.tokens, "loss_mask": batch.loss_mask, "attn_mask": batch.attn_mask}
    return jax.tree.map(jnp.asarray, rows) if placement.sharding is None else placement.rows(rows)


def _floats(values) -> list[float]:
    return [round(float(v), 6) for v in np.asarray(values)]


def _initial_head(
    cfg: ModelConfig, run: DraftTrainConfig, source: RolloutBatches, run_dir: Path, resume: bool
) -> tuple[DraftConfig, dict, dict[int, RolloutBatch]]:
    """(dcfg, dparams, pre-generated batches by step): a fresh head takes its vocabulary from
    the token counts of the first batches, which then serve as the first training batches."""
    head = run.head
    if head.init is not None:
        dcfg, dparams = load_eagle3(head.init, policy=cfg)
        if head.aux_layer_ids is not None and tuple(head.aux_layer_ids) != dcfg.aux_layer_ids:
            raise ValueError(
                f"head.aux_layer_ids={list(head.aux_layer_ids)} differs from {head.init}'s {list(dcfg.aux_layer_ids)}"
            )
        return dcfg, dparams, {}
    key = jax.random.fold_in(jax.random.key(run.train.seed), 1)
    counts_file = run_dir / "token_counts.npy"
    if resume and counts_file.exists():  # the maps come back from the checkpoint
        counts, batches = np.load(counts_file), {}
    else:
        batches = {s: source.batch(s) for s in range(head.vocab_count_batches)}
        counts = count_tokens(list(batches.values()), cfg.vocab_size)
        np.save(counts_file, counts)
    dcfg, dparams = init_eagle3(cfg, key, head.draft_vocab_size, counts, aux_layer_ids=head.aux_layer_ids)
    return dcfg, dparams, batches


def evaluate(
    cfg: ModelConfig,
    dcfg: DraftConfig,
    dparams: dict,
    policy: Params,
    tok: ChatTokenizer,
    run: DraftTrainConfig,
    placement: Placement,
) -> dict:
    """Mean loss and top-1 agreement per unrolled position on fresh batches of `run.eval.data`."""
    data = run.eval.data or dataclasses.replace(run.data, seed=run.data.seed + _EVAL_SEED_OFFSET)
    per_call = min(run.generation.batches_per_call, run.eval.batches)  # no more rows than the evaluation reads
    source = RolloutBatches(
        cfg,
        policy,
        tok,
        prompt_pool(data, tok),
        dataclasses.replace(run.generation, batches_per_call=per_call),
        data.max_prompt_len,
        run.train.batch_size,
        run.train.seed + _EVAL_SEED_OFFSET,
        placement.sharding,
    )
    losses, agreements, weights = [], [], []
    for i in range(run.eval.batches):
        loss, metrics = eval_step(
            cfg, dcfg, run.loss, dparams, policy, _device_batch(source.batch(i), placement), sharding=placement.sharding
        )
        losses.append(float(loss))
        agreements.append(np.asarray(metrics["top1_agreement"]) * np.asarray(metrics["positions"]))
        weights.append(np.asarray(metrics["positions"]))
    agreement = np.sum(agreements, axis=0) / np.maximum(np.sum(weights, axis=0), 1)
    return {
        "eval_loss": float(np.mean(losses)),
        "eval_top1_agreement": _floats(agreement),
        "eval_positions": int(np.sum(weights, axis=0)[0]),
        "eval_batches": run.eval.batches,
    }


def train_head(run: DraftTrainConfig, run_dir, resume: bool = False) -> dict:
    """Trains (or resumes) a head and exports it (`jaxspec.run.RunLoop`). Returns {"export_dir",
    "step", "preempted", "eval_*", ...}. SIGTERM, Ctrl-C or the job's time limit checkpoints at the
    next step and returns with preempted True, without evaluating or exporting."""
    run_dir = Path(run_dir)
    check_run_dir(run_dir, resume, run, FIXED_ON_RESUME)
    loop = RunLoop(run_dir, progress=run.train.progress, time_stamps=False)
    training = DraftTrainRun(run, run_dir, resume)
    outcome = loop.run(training)
    training.result |= {"step": training.step, "train_seconds": outcome.seconds, "preempted": not outcome.finished}
    return training.result


class DraftTrainRun:
    """One head-training run's part of `jaxspec.run.RunLoop`: the frozen policy and its rollouts,
    the head's training state (restored when resuming), its steps, final evaluation and export.

    The training state: weights (the head's trained params), buffers (its fixed vocabulary maps),
    opt_state, step. result: what `train_head` returns (loss: the last logged loss, eval_*).
    """

    name = "draft"

    def __init__(self, run: DraftTrainConfig, run_dir: Path, resume: bool):
        self.config, self.run_dir, t = run, run_dir, run.train
        self.steps = t.steps
        policy_dir = run.policy_path()
        self.cfg, policy = load_hf(policy_dir, dtype=t.policy_dtype)
        self.tok = ChatTokenizer.from_file(policy_dir)
        if self.tok.vocab_size > self.cfg.vocab_size:
            raise ValueError(
                f"{policy_dir}: tokenizer has {self.tok.vocab_size} tokens, the policy only {self.cfg.vocab_size}"
            )
        if run.head.init is None:  # fail on head settings the policy cannot take before generating data
            try:
                DraftConfig.for_policy(self.cfg, run.head.draft_vocab_size, run.head.aux_layer_ids)
            except ValueError as err:
                raise ValueError(f"head: {err}") from None
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(run), sort_keys=False))
        self.placement = Placement(run.mesh)
        if self.placement.sharding is not None:
            policy = shard_params(self.placement.sharding, policy)
            say(f"training on the mesh {dict(self.placement.sharding.mesh.shape)}")
        self.policy = policy
        self.source = RolloutBatches(
            self.cfg,
            policy,
            self.tok,
            prompt_pool(run.data, self.tok),
            run.generation,
            run.data.max_prompt_len,
            t.batch_size,
            t.seed,
            self.placement.sharding,
        )
        self.dcfg, dparams, self.pregenerated = _initial_head(self.cfg, run, self.source, run_dir, resume)
        check_compatible(self.cfg, self.dcfg)
        weights, buffers = split_buffers(dparams)
        optimizer, self.schedule = make_optimizer(run.optim, t.steps)
        # The head, its optimizer state and the step replicated over the mesh; a checkpoint is restored
        # onto this layout, whatever mesh wrote it.
        state = self.placement.state(
            {"weights": weights, "buffers": buffers, "opt_state": optimizer.init(weights), "step": jnp.int32(0)}
        )
        self.layout = abstract((state["weights"], state["opt_state"]))
        self.checkpointer = Checkpointer(run_dir / "checkpoints", t.keep_checkpoints)
        restored = self.checkpointer.resume(state) if resume else None
        self.resumed = restored is not None
        if restored is not None:
            state = restored
            say(f"resumed from step {int(state['step'])}")
        self.weights, self.buffers, self.opt_state = state["weights"], state["buffers"], state["opt_state"]
        self.step = int(state["step"])
        say(
            f"draft head: vocabulary {self.dcfg.draft_vocab_size} of {self.dcfg.vocab_size}, aux layers "
            f"{list(self.dcfg.aux_layer_ids)}; {len(self.source.pool)} prompts"
        )
        self.result: dict = {"preempted": False}
        self._start = time.perf_counter()
        self._window = {"start": self._start, "tokens": 0, "generate_s": 0.0}  # since the last record

    def run_step(self) -> tuple[list[dict], dict[str, str]]:
        """One update of the head on a fresh batch of rollouts; a record every train.log_every
        steps, a checkpoint every train.checkpoint_every."""
        run, t, window = self.config, self.config.train, self._window
        gen_start = time.perf_counter()
        batch = self.pregenerated.pop(self.step, None) or self.source.batch(self.step)
        window["generate_s"] += time.perf_counter() - gen_start
        self.weights, self.opt_state, out = train_step(
            self.cfg,
            self.dcfg,
            run.optim,
            t.steps,
            run.loss,
            self.weights,
            self.opt_state,
            self.buffers,
            self.policy,
            _device_batch(batch, self.placement),
            sharding=self.placement.sharding,
        )
        self.weights, self.opt_state = self.placement.pin((self.weights, self.opt_state), self.layout)
        jax.block_until_ready(out)  # so that the next batch's time is generation alone
        self.step += 1
        window["tokens"] += batch.response_tokens
        records, fields = [], {}
        if self.step % t.log_every == 0 or self.step == t.steps:
            elapsed = time.perf_counter() - window["start"]
            record = {
                "step": self.step,
                "loss": float(out["loss"]),
                "grad_norm": float(out["grad_norm"]),
                "lr": float(self.schedule(self.step - 1)),
                "step_loss": _floats(out["step_loss"]),
                "top1_agreement": _floats(out["top1_agreement"]),
                "response_tokens_per_s": window["tokens"] / elapsed,
                "generate_fraction": window["generate_s"] / elapsed,
                "elapsed_s": time.perf_counter() - self._start,
            }
            records.append(record)
            self.result["loss"] = record["loss"]
            self._window = {"start": time.perf_counter(), "tokens": 0, "generate_s": 0.0}
            fields = {"loss": f"{record['loss']:.3f}", "top1": f"{record['top1_agreement'][0]:.2f}"}
        if self.step % t.checkpoint_every == 0 or self.step == t.steps:
            self.save()
        return records, fields

    def save(self) -> None:
        self.checkpointer.save(
            {
                "weights": self.weights,
                "buffers": self.buffers,
                "opt_state": self.opt_state,
                "step": jnp.int32(self.step),
            }
        )

    def evaluate(self, final: bool) -> dict | None:
        """The head's loss and agreement on fresh batches after the last step (eval.batches > 0)."""
        if not final or not self.config.eval.batches:
            return None
        dparams = merge_buffers(self.weights, self.buffers)
        self.result |= evaluate(self.cfg, self.dcfg, dparams, self.policy, self.tok, self.config, self.placement)
        say(f"step {self.step}: eval top-1 agreement per position {self.result['eval_top1_agreement']}")
        return {"step": self.step, **{k: v for k, v in self.result.items() if k.startswith("eval_")}}

    def export(self, seconds: float) -> None:
        t = self.config.train
        export_dir = Path(t.export_dir) if t.export_dir else self.run_dir / "draft"
        save_eagle3(self.dcfg, merge_buffers(self.weights, self.buffers), export_dir, dtype=t.export_dtype)
        self.result["export_dir"] = str(export_dir)
        agreement = (
            f", eval top-1 agreement {self.result['eval_top1_agreement'][0]:.3f}" if self.config.eval.batches else ""
        )
        say(
            f"draft train done: {self.step} steps in {seconds:.1f} s, final loss "
            f"{self.result.get('loss', float('nan')):.4f}{agreement}; exported draft head to {export_dir}"
        )

    def close(self) -> None:
        """Nothing beyond the checkpointer."""
