"""One pretraining run: data and tokenizer -> Qwen3 (or Qwen3-MoE) policy -> checkpoints, metrics -> HF export.

Run directory layout:
    config.yaml          the resolved config (a resumed run must keep its data and model sections)
    data/train.jsonl     generated training problems;  data/eval.jsonl: held-out problems
    tokenizer.json       trained (or copied) tokenizer
    checkpoints/<step>/  orbax checkpoints of the training state
    metrics.jsonl        one JSON object per log line / evaluation
    policy/              the exported HF folder (unless train.export_dir says otherwise)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import yaml

from jaxspec.config_io import to_dict
from jaxspec.models.checkpoint import save_hf
from jaxspec.models.config import ModelConfig
from jaxspec.models.sharding import shard_params
from jaxspec.models.transformer import init_params
from jaxspec.optim import make_optimizer
from jaxspec.placement import Placement, abstract
from jaxspec.pretrain.config import ModelShape, PretrainConfig
from jaxspec.pretrain.data import encode_examples, pack, prepare_problems, prepare_tokenizer
from jaxspec.pretrain.evaluate import cast_params, greedy_accuracy
from jaxspec.pretrain.train import make_train_step
from jaxspec.run import Batcher, Checkpointer, Progress, StopSignals, truncate_metrics
from jaxspec.run import check_run_dir as run_dir_guard
from jaxspec.tasks.tokenizer import ChatTokenizer


def model_config(shape: ModelShape, tok: ChatTokenizer) -> ModelConfig:
    """Qwen3 (or Qwen3-MoE) config of `shape` over the tokenizer's vocabulary and special-token ids."""
    moe = (
        {}
        if not shape.num_experts
        else dict(
            num_experts=shape.num_experts,
            num_experts_per_tok=shape.num_experts_per_tok,
            moe_intermediate_size=shape.moe_intermediate_size,
            decoder_sparse_step=shape.decoder_sparse_step,
            norm_topk_prob=shape.norm_topk_prob,
            router_aux_loss_coef=shape.router_aux_loss_coef,
        )
    )
    return ModelConfig(
        family="qwen3_moe" if shape.num_experts else "qwen3",
        vocab_size=tok.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta,
        qk_norm=True,
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
        **moe,
    )


def check_run_dir(cfg: PretrainConfig, run_dir: Path, resume: bool) -> None:
    """`jaxspec.run.check_run_dir`: a resumed run keeps its data and model sections."""
    run_dir_guard(
        run_dir,
        resume,
        cfg,
        lambda key: key.split(".")[0] in ("data", "model"),
        "resume with the same data and model settings",
    )


def _log(file, record: dict) -> None:
    file.write(json.dumps(record) + "\n")
    file.flush()


def pretrain(cfg: PretrainConfig, run_dir, resume: bool = False) -> dict:
    """Trains (or resumes) a run and exports the policy. Returns {"eval_accuracy", "export_dir",
    "preempted", ...}. SIGTERM or Ctrl-C checkpoints at the next step and returns with preempted
    True, without evaluating or exporting."""
    run_dir = Path(run_dir)
    check_run_dir(cfg, run_dir, resume)
    run_dir.mkdir(parents=True, exist_ok=True)
    t_cfg = cfg.train
    train_problems, eval_problems = prepare_problems(cfg.data, run_dir / "data", reuse=resume)
    tok = prepare_tokenizer(cfg.data, train_problems, run_dir / "tokenizer.json", reuse=resume)
    data = pack(encode_examples(train_problems, tok), cfg.data.max_len, tok.pad_id, cfg.data.seed)
    mcfg = model_config(cfg.model, tok)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    print(
        f"policy: {mcfg.num_params() / 1e6:.2f}M params, vocab {mcfg.vocab_size}; "
        f"{data.num_examples} training examples in {len(data)} packed rows ({data.dropped} over max_len dropped), "
        f"{len(eval_problems)} held out"
    )

    optimizer, schedule = make_optimizer(cfg.optim, t_cfg.steps)
    placement = Placement(cfg.mesh)
    if placement.sharding is not None:
        print(f"training on the mesh {dict(placement.sharding.mesh.shape)}")

    def initial_params(seed_key: jax.Array) -> tuple[dict, jax.Array]:
        key, init_key = jax.random.split(seed_key)
        return init_params(mcfg, init_key, jnp.float32), key

    # The policy by the sharding rules and its optimizer moments like it (optimizer.init keeps the
    # layout), everything else replicated; a checkpoint is restored onto the same layout.
    params, key = jax.jit(initial_params)(jax.random.PRNGKey(t_cfg.seed))
    if placement.sharding is not None:
        params = shard_params(placement.sharding, params)
    state = placement.state(
        {
            "params": params,
            "opt_state": optimizer.init(params),
            "step": jnp.int32(0),
            "position": jnp.int32(0),
            "key": key,
        }
    )
    layout = abstract((state["params"], state["opt_state"]))
    checkpointer = Checkpointer(run_dir / "checkpoints", t_cfg.keep_checkpoints)
    restored = checkpointer.resume(state) if resume else None
    if restored is not None:
        state = restored
        print(f"resumed from step {int(state['step'])} (data position {int(state['position'])})")
    params, opt_state, key = state["params"], state["opt_state"], state["key"]
    step, position = int(state["step"]), int(state["position"])

    compute_dtype = jnp.dtype(t_cfg.compute_dtype)
    train_step = make_train_step(
        mcfg, optimizer, compute_dtype, t_cfg.remat, t_cfg.attention, placement.sharding, t_cfg.moe
    )
    batcher = Batcher(len(data), t_cfg.batch_size, cfg.data.seed)
    result: dict = {"export_dir": None, "eval_accuracy": None}

    def evaluate(at_step: int) -> float:
        nonlocal key
        key, sub = jax.random.split(key)
        accuracy, _ = greedy_accuracy(
            mcfg,
            cast_params(params, compute_dtype),
            tok,
            eval_problems,
            t_cfg.eval_max_new_tokens,
            sub,
            t_cfg.eval_batch_size,
            placement.sharding,
        )
        _log(metrics, {"step": at_step, "eval_accuracy": accuracy, "eval_problems": len(eval_problems)})
        print(f"step {at_step}: greedy accuracy {accuracy:.3f} on {len(eval_problems)} held-out problems")
        return accuracy

    def save() -> None:
        checkpointer.save(
            {
                "params": params,
                "opt_state": opt_state,
                "step": jnp.int32(step),
                "position": jnp.int32(position),
                "key": key,
            }
        )

    start = time.perf_counter()
    truncate_metrics(run_dir / "metrics.jsonl", step)
    with (
        open(run_dir / "metrics.jsonl", "a") as metrics,
        StopSignals() as stop,
        Progress("pretrain", t_cfg.steps, step, t_cfg.progress) as bar,
    ):
        window_start, window_tokens = time.perf_counter(), 0
        while step < t_cfg.steps and not stop.requested:
            batch = data.take(batcher.indices(position))
            params, opt_state, out = train_step(params, opt_state, placement.rows(batch))
            params, opt_state = placement.pin((params, opt_state), layout)
            step += 1
            position += t_cfg.batch_size
            window_tokens += int((batch["segment_ids"][:, :-1] > 0).sum())
            loss = None
            if step % t_cfg.log_every == 0 or step == t_cfg.steps:
                loss = float(out["loss"])
                elapsed = time.perf_counter() - window_start
                record = {
                    "step": step,
                    "loss": loss,
                    "grad_norm": float(out["grad_norm"]),
                    "lr": float(schedule(step - 1)),
                    "tokens_per_s": window_tokens / elapsed,
                    "elapsed_s": time.perf_counter() - start,
                }
                if mcfg.sparse_layers:
                    record["router_aux_loss"] = float(out["router_aux_loss"])
                _log(metrics, record)
                window_start, window_tokens = time.perf_counter(), 0
                result["loss"] = loss
            bar.update(1, **({} if loss is None else {"loss": f"{loss:.4f}"}))
            if t_cfg.eval_every and step % t_cfg.eval_every == 0 and step < t_cfg.steps and eval_problems:
                evaluate(step)
                window_start, window_tokens = time.perf_counter(), 0
            # after the evaluation, so the saved key is the one the uninterrupted run goes on with
            if step % t_cfg.checkpoint_every == 0 or step == t_cfg.steps:
                save()
        if step < t_cfg.steps:
            if checkpointer.latest_step() != step:
                save()
        elif eval_problems:
            result["eval_accuracy"] = evaluate(step)
    checkpointer.close()
    seconds = time.perf_counter() - start
    result.update(
        step=step, position=position, train_seconds=seconds, num_params=mcfg.num_params(), preempted=step < t_cfg.steps
    )
    if result["preempted"]:
        print(f"{stop.name}: checkpointed step {step} in {run_dir / 'checkpoints'}; continue with --resume")
        return result

    export_dir = Path(t_cfg.export_dir) if t_cfg.export_dir else run_dir / "policy"
    save_hf(mcfg, params, export_dir, dtype=t_cfg.export_dtype, tokenizer_file=run_dir / "tokenizer.json")
    result["export_dir"] = str(export_dir)
    accuracy = "" if result["eval_accuracy"] is None else f", greedy accuracy {result['eval_accuracy']:.3f}"
    print(
        f"pretrain done: {step} steps in {seconds:.1f} s, final loss {result.get('loss', float('nan')):.4f}"
        f"{accuracy}; exported policy to {export_dir}"
    )
    return result
