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

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import yaml

from jaxspec.config_io import to_dict
from jaxspec.distributed import say
from jaxspec.models.checkpoint import save_hf
from jaxspec.models.config import ModelConfig
from jaxspec.models.params import init_params
from jaxspec.models.sharding import shard_params
from jaxspec.optim import make_optimizer
from jaxspec.pretrain.config import FIXED_ON_RESUME, ModelShape, PretrainConfig
from jaxspec.pretrain.data import encode_examples, pack, prepare_problems, prepare_tokenizer
from jaxspec.pretrain.evaluate import cast_params, greedy_accuracy
from jaxspec.pretrain.train import make_train_step
from jaxspec.run import Batcher, Checkpointer, RunLoop, check_run_dir
from jaxspec.run.placement import Placement, abstract
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


def pretrain(cfg: PretrainConfig, run_dir, resume: bool = False) -> dict:
    """Trains (or resumes) a run and exports the policy (`jaxspec.run.RunLoop`). Returns
    {"eval_accuracy", "export_dir", "preempted", ...}. SIGTERM, Ctrl-C or the job's time limit
    checkpoints at the next step and returns with preempted True, without evaluating or exporting."""
    run_dir = Path(run_dir)
    check_run_dir(run_dir, resume, cfg, FIXED_ON_RESUME)
    loop = RunLoop(run_dir, progress=cfg.train.progress, time_stamps=False)
    run_dir.mkdir(parents=True, exist_ok=True)
    run = PretrainRun(cfg, run_dir, resume)
    outcome = loop.run(run)
    run.result.update(
        step=run.step,
        position=run.position,
        train_seconds=outcome.seconds,
        num_params=run.mcfg.num_params(),
        preempted=not outcome.finished,
    )
    return run.result


class PretrainRun:
    """One pretraining run's part of `jaxspec.run.RunLoop`: the data, the tokenizer and the model,
    the training state (restored when resuming), its steps, evaluations and export.

    The training state: params, opt_state, key (the run's PRNG key, split by each evaluation),
    step, position (packed rows consumed). result: what `pretrain` returns (eval_accuracy,
    export_dir, loss: the last logged loss).
    """

    name = "pretrain"

    def __init__(self, cfg: PretrainConfig, run_dir: Path, resume: bool):
        self.cfg, self.run_dir, t_cfg = cfg, run_dir, cfg.train
        self.steps = t_cfg.steps
        train_problems, self.eval_problems = prepare_problems(cfg.data, run_dir / "data", reuse=resume)
        self.tok = prepare_tokenizer(cfg.data, train_problems, run_dir / "tokenizer.json", reuse=resume)
        self.data = pack(encode_examples(train_problems, self.tok), cfg.data.max_len, self.tok.pad_id, cfg.data.seed)
        self.mcfg = model_config(cfg.model, self.tok)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        say(
            f"policy: {self.mcfg.num_params() / 1e6:.2f}M params, vocab {self.mcfg.vocab_size}; "
            f"{self.data.num_examples} training examples in {len(self.data)} packed rows ({self.data.dropped} over "
            f"max_len dropped), {len(self.eval_problems)} held out"
        )

        optimizer, self.schedule = make_optimizer(cfg.optim, t_cfg.steps)
        self.placement = Placement(cfg.mesh)
        if self.placement.sharding is not None:
            say(f"training on the mesh {dict(self.placement.sharding.mesh.shape)}")

        def initial_params(seed_key: jax.Array) -> tuple[dict, jax.Array]:
            key, init_key = jax.random.split(seed_key)
            return init_params(self.mcfg, init_key, jnp.float32), key

        # The policy by the sharding rules and its optimizer moments like it (optimizer.init keeps the
        # layout), everything else replicated; a checkpoint is restored onto the same layout.
        params, key = jax.jit(initial_params)(jax.random.PRNGKey(t_cfg.seed))
        if self.placement.sharding is not None:
            params = shard_params(self.placement.sharding, params)
        state = self.placement.state(
            {
                "params": params,
                "opt_state": optimizer.init(params),
                "step": jnp.int32(0),
                "position": jnp.int32(0),
                "key": key,
            }
        )
        self.layout = abstract((state["params"], state["opt_state"]))
        self.checkpointer = Checkpointer(run_dir / "checkpoints", t_cfg.keep_checkpoints)
        restored = self.checkpointer.resume(state) if resume else None
        self.resumed = restored is not None
        if restored is not None:
            state = restored
            say(f"resumed from step {int(state['step'])} (data position {int(state['position'])})")
        self.params, self.opt_state, self.key = state["params"], state["opt_state"], state["key"]
        self.step, self.position = int(state["step"]), int(state["position"])

        self.compute_dtype = jnp.dtype(t_cfg.compute_dtype)
        self.train_step = make_train_step(
            self.mcfg, optimizer, self.compute_dtype, t_cfg.remat, t_cfg.attention, self.placement.sharding, t_cfg.moe
        )
        self.batcher = Batcher(len(self.data), t_cfg.batch_size, cfg.data.seed)
        self.result: dict = {"export_dir": None, "eval_accuracy": None}
        self._start = time.perf_counter()
        self._window_start, self._window_tokens = self._start, 0  # tokens_per_s of the steps since the last record

    def run_step(self) -> tuple[list[dict], dict[str, str]]:
        """One optimizer step; a record every train.log_every steps, an evaluation every
        train.eval_every before the last, a checkpoint every train.checkpoint_every."""
        t_cfg = self.cfg.train
        batch = self.data.take(self.batcher.indices(self.position))
        self.params, self.opt_state, out = self.train_step(self.params, self.opt_state, self.placement.rows(batch))
        self.params, self.opt_state = self.placement.pin((self.params, self.opt_state), self.layout)
        self.step += 1
        self.position += t_cfg.batch_size
        self._window_tokens += int((batch["segment_ids"][:, :-1] > 0).sum())
        records, fields = [], {}
        if self.step % t_cfg.log_every == 0 or self.step == t_cfg.steps:
            loss = float(out["loss"])
            elapsed = time.perf_counter() - self._window_start
            record = {
                "step": self.step,
                "loss": loss,
                "grad_norm": float(out["grad_norm"]),
                "lr": float(self.schedule(self.step - 1)),
                "tokens_per_s": self._window_tokens / elapsed,
                "elapsed_s": time.perf_counter() - self._start,
            }
            if self.mcfg.sparse_layers:
                record["router_aux_loss"] = float(out["router_aux_loss"])
            records.append(record)
            self._window_start, self._window_tokens = time.perf_counter(), 0
            self.result["loss"] = loss
            fields["loss"] = f"{loss:.4f}"
        if t_cfg.eval_every and self.step % t_cfg.eval_every == 0 and self.step < t_cfg.steps and self.eval_problems:
            records.append(self._evaluate())
            self._window_start, self._window_tokens = time.perf_counter(), 0
        # after the evaluation, so the saved key is the one the uninterrupted run goes on with
        if self.step % t_cfg.checkpoint_every == 0 or self.step == t_cfg.steps:
            self.save()
        return records, fields

    def save(self) -> None:
        self.checkpointer.save(
            {
                "params": self.params,
                "opt_state": self.opt_state,
                "step": jnp.int32(self.step),
                "position": jnp.int32(self.position),
                "key": self.key,
            }
        )

    def evaluate(self, final: bool) -> dict | None:
        """The greedy accuracy after the last step (none before the first)."""
        if not final or not self.eval_problems:
            return None
        record = self._evaluate()
        self.result["eval_accuracy"] = record["eval_accuracy"]
        return record

    def _evaluate(self) -> dict:
        t_cfg = self.cfg.train
        self.key, sub = jax.random.split(self.key)
        accuracy, _ = greedy_accuracy(
            self.mcfg,
            cast_params(self.params, self.compute_dtype),
            self.tok,
            self.eval_problems,
            t_cfg.eval_max_new_tokens,
            sub,
            t_cfg.eval_batch_size,
            self.placement.sharding,
        )
        say(f"step {self.step}: greedy accuracy {accuracy:.3f} on {len(self.eval_problems)} held-out problems")
        return {"step": self.step, "eval_accuracy": accuracy, "eval_problems": len(self.eval_problems)}

    def export(self, seconds: float) -> None:
        t_cfg = self.cfg.train
        export_dir = Path(t_cfg.export_dir) if t_cfg.export_dir else self.run_dir / "policy"
        save_hf(
            self.mcfg, self.params, export_dir, dtype=t_cfg.export_dtype, tokenizer_file=self.run_dir / "tokenizer.json"
        )
        result = self.result
        result["export_dir"] = str(export_dir)
        accuracy = "" if result["eval_accuracy"] is None else f", greedy accuracy {result['eval_accuracy']:.3f}"
        say(
            f"pretrain done: {self.step} steps in {seconds:.1f} s, final loss {result.get('loss', float('nan')):.4f}"
            f"{accuracy}; exported policy to {export_dir}"
        )

    def close(self) -> None:
        """Nothing beyond the checkpointer."""
