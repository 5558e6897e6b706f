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
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml

from jaxspec.config_io import to_dict
from jaxspec.draft.checkpoint import load_eagle3, save_eagle3
from jaxspec.draft.config import DraftConfig, check_compatible
from jaxspec.draft.loss import eagle3_loss
from jaxspec.draft.model import init_eagle3, merge_buffers, split_buffers
from jaxspec.draft_training.config import DraftTrainConfig, HeadLossConfig, HeadOptimConfig
from jaxspec.draft_training.data import RolloutBatch, RolloutSource, count_tokens, prompt_pool
from jaxspec.models.checkpoint import load_hf
from jaxspec.models.config import ModelConfig
from jaxspec.models.sharding import Sharding, shard_params
from jaxspec.models.transformer import Params, forward_hidden
from jaxspec.optim import make_optimizer
from jaxspec.placement import Placement, abstract
from jaxspec.run import Checkpointer, Progress, StopSignals, truncate_metrics
from jaxspec.run import check_run_dir as run_dir_guard
from jaxspec.tasks.tokenizer import ChatTokenizer

_FIXED_SECTIONS = ("policy", "data", "generation", "head")
_EVAL_SEED_OFFSET = 1_000_003  # evaluation prompts and rollouts never share the training stream


def check_run_dir(cfg: DraftTrainConfig, run_dir: Path, resume: bool) -> None:
    """`jaxspec.run.check_run_dir`: a resumed run keeps its policy, data, generation and head."""
    run_dir_guard(
        run_dir,
        resume,
        cfg,
        lambda key: key.split(".")[0] in _FIXED_SECTIONS,
        f"resume with the same {', '.join(_FIXED_SECTIONS)} settings",
    )


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


def _log(file, record: dict) -> None:
    file.write(json.dumps(record) + "\n")
    file.flush()


def _floats(values) -> list[float]:
    return [round(float(v), 6) for v in np.asarray(values)]


def _initial_head(
    cfg: ModelConfig, run: DraftTrainConfig, source: RolloutSource, run_dir: Path, resume: bool
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
    source = RolloutSource(
        cfg,
        policy,
        tok,
        prompt_pool(data, tok),
        run.generation,
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


def train_draft(run: DraftTrainConfig, run_dir, resume: bool = False) -> dict:
    """Trains (or resumes) a head and exports it. Returns {"export_dir", "step", "preempted",
    "eval_*", ...}. SIGTERM or Ctrl-C checkpoints at the next step and returns with preempted
    True, without evaluating or exporting."""
    run_dir = Path(run_dir)
    check_run_dir(run, run_dir, resume)
    policy_dir = run.policy_path()
    cfg, policy = load_hf(policy_dir, dtype=run.train.policy_dtype)
    tok = ChatTokenizer.from_file(policy_dir)
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"{policy_dir}: tokenizer has {tok.vocab_size} tokens, the policy only {cfg.vocab_size}")
    if run.head.init is None:  # fail on head settings the policy cannot take before generating data
        try:
            DraftConfig.for_policy(cfg, run.head.draft_vocab_size, run.head.aux_layer_ids)
        except ValueError as err:
            raise ValueError(f"head: {err}") from None
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(run), sort_keys=False))
    t = run.train
    placement = Placement(run.mesh)
    if placement.sharding is not None:
        policy = shard_params(placement.sharding, policy)
        print(f"training on the mesh {dict(placement.sharding.mesh.shape)}")
    source = RolloutSource(
        cfg,
        policy,
        tok,
        prompt_pool(run.data, tok),
        run.generation,
        run.data.max_prompt_len,
        t.batch_size,
        t.seed,
        placement.sharding,
    )
    dcfg, dparams, pregenerated = _initial_head(cfg, run, source, run_dir, resume)
    check_compatible(cfg, dcfg)
    weights, buffers = split_buffers(dparams)
    optimizer, schedule = make_optimizer(run.optim, t.steps)
    # The head, its optimizer state and the step replicated over the mesh; a checkpoint is restored
    # onto this layout, whatever mesh wrote it.
    state = placement.state(
        {"weights": weights, "buffers": buffers, "opt_state": optimizer.init(weights), "step": jnp.int32(0)}
    )
    layout = abstract((state["weights"], state["opt_state"]))
    checkpointer = Checkpointer(run_dir / "checkpoints", t.keep_checkpoints)
    restored = checkpointer.resume(state) if resume else None
    if restored is not None:
        state = restored
        print(f"resumed from step {int(state['step'])}")
    weights, buffers, opt_state, step = state["weights"], state["buffers"], state["opt_state"], int(state["step"])
    print(
        f"draft head: vocabulary {dcfg.draft_vocab_size} of {dcfg.vocab_size}, aux layers "
        f"{list(dcfg.aux_layer_ids)}; {len(source.pool)} prompts"
    )

    start = time.perf_counter()
    truncate_metrics(run_dir / "metrics.jsonl", step)
    result: dict = {"preempted": False}
    with (
        open(run_dir / "metrics.jsonl", "a") as metrics_file,
        StopSignals() as stop,
        Progress("draft", t.steps, step, t.progress) as bar,
    ):
        window = {"start": time.perf_counter(), "tokens": 0, "generate_s": 0.0}
        while step < t.steps and not stop.requested:
            gen_start = time.perf_counter()
            batch = pregenerated.pop(step, None) or source.batch(step)
            window["generate_s"] += time.perf_counter() - gen_start
            weights, opt_state, out = train_step(
                cfg,
                dcfg,
                run.optim,
                t.steps,
                run.loss,
                weights,
                opt_state,
                buffers,
                policy,
                _device_batch(batch, placement),
                sharding=placement.sharding,
            )
            weights, opt_state = placement.pin((weights, opt_state), layout)
            jax.block_until_ready(out)  # so that the next batch's time is generation alone
            step += 1
            window["tokens"] += batch.response_tokens
            record = None
            if step % t.log_every == 0 or step == t.steps:
                elapsed = time.perf_counter() - window["start"]
                record = {
                    "step": step,
                    "loss": float(out["loss"]),
                    "grad_norm": float(out["grad_norm"]),
                    "lr": float(schedule(step - 1)),
                    "step_loss": _floats(out["step_loss"]),
                    "top1_agreement": _floats(out["top1_agreement"]),
                    "response_tokens_per_s": window["tokens"] / elapsed,
                    "generate_fraction": window["generate_s"] / elapsed,
                    "elapsed_s": time.perf_counter() - start,
                }
                _log(metrics_file, record)
                result["loss"] = record["loss"]
                window = {"start": time.perf_counter(), "tokens": 0, "generate_s": 0.0}
            bar.update(
                1,
                **(
                    {}
                    if record is None
                    else {"loss": f"{record['loss']:.3f}", "top1": f"{record['top1_agreement'][0]:.2f}"}
                ),
            )
            if step % t.checkpoint_every == 0 or step == t.steps or (stop.requested and step < t.steps):
                checkpointer.save(
                    {"weights": weights, "buffers": buffers, "opt_state": opt_state, "step": jnp.int32(step)}
                )
        dparams = merge_buffers(weights, buffers)
        result |= {"step": step, "train_seconds": time.perf_counter() - start, "preempted": step < t.steps}
        if result["preempted"]:
            print(f"{stop.name}: checkpointed step {step} in {run_dir / 'checkpoints'}; continue with --resume")
        elif run.eval.batches:
            result |= evaluate(cfg, dcfg, dparams, policy, tok, run, placement)
            _log(metrics_file, {"step": step, **{k: v for k, v in result.items() if k.startswith("eval_")}})
            print(f"step {step}: eval top-1 agreement per position {result['eval_top1_agreement']}")
    checkpointer.close()
    if result["preempted"]:
        return result
    export_dir = Path(t.export_dir) if t.export_dir else run_dir / "draft"
    save_eagle3(dcfg, dparams, export_dir, dtype=t.export_dtype)
    result["export_dir"] = str(export_dir)
    agreement = f", eval top-1 agreement {result['eval_top1_agreement'][0]:.3f}" if run.eval.batches else ""
    print(
        f"draft train done: {step} steps in {result['train_seconds']:.1f} s, final loss "
        f"{result.get('loss', float('nan')):.4f}{agreement}; exported draft head to {export_dir}"
    )
    return result
