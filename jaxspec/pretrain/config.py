"""Configuration of a pretraining run (one YAML file; see configs/pretrain_tiny.yaml)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from jaxspec.config_io import requirement
from jaxspec.optim import OptimConfig
from jaxspec.run.placement import MeshConfig
from jaxspec.run.run_dir import FixedKeys
from jaxspec.tasks.generator import DEFAULT_KINDS, problem_config_errors
from jaxspec.tasks.tally import TallyConfig
from jaxspec.tasks.tokenizer import BOS, EOS, PAD, PROMPT_TEMPLATE


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The generated corpus and its tokenizer.

    num_train / num_eval: problems in the training set / the held-out set (held-out questions never
    occur in the training set). levels: difficulty levels 1..7 (`jaxspec.tasks.MAX_LEVEL`; 6 and 7
    have responses of up to ~1600 tokens) of the built-in kinds. kinds: problem kinds drawn
    uniformly, any of "arithmetic", "word" (the built-in task) and "tally" (long, heavy-tailed
    worked solutions with controlled uncertainty; `tally` sets its length law and phrasing
    variation, `jaxspec.tasks.tally.TallyConfig`). max_len: width of a packed training row in tokens (the
    model's input length); examples (prompt + solution + eos) longer than that are dropped.
    seed: seeds the generated problems and the shuffling of the packed rows.
    kinds: problem kinds, a subset of `jaxspec.tasks.KINDS` ("arithmetic", "word", "tally").
    vocab_size: size of the byte-level BPE trained on the training corpus.
    tokenizer: an existing tokenizer.json to use instead of training that BPE.
    eos_token / pad_token / bos_token: the tokenizer's special-token strings (the defaults are those
    of the trained BPE; with `tokenizer`, name that file's).
    prompt_template: the chat layout, with a `{question}` slot; the solution follows it directly.
    """

    num_train: int
    num_eval: int = 256
    seed: int = 0
    levels: tuple[int, ...] = (1, 2)
    kinds: tuple[str, ...] = DEFAULT_KINDS
    tally: TallyConfig = TallyConfig()
    vocab_size: int = 512
    max_len: int = 128
    tokenizer: str | None = None
    eos_token: str = EOS
    pad_token: str = PAD
    bos_token: str | None = BOS
    prompt_template: str = PROMPT_TEMPLATE


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Qwen3-architecture decoder shape (the vocabulary size comes from the tokenizer); the fields
    are `jaxspec.models.ModelConfig`'s of the same names.

    hidden_size: width of the residual stream.
    intermediate_size: width of each dense layer's SwiGLU MLP.
    num_layers: decoder layers.
    num_heads / num_kv_heads: query heads and key/value heads (grouped-query attention: num_heads a
    multiple of num_kv_heads).
    head_dim: width of one attention head (even: rotary embedding).
    rope_theta: base of the rotary position embedding's frequencies.
    tie_word_embeddings: the output head reuses the embedding matrix.
    max_position_embeddings: longest sequence the model takes (at least data.max_len).
    num_experts: > 0 makes it a Qwen3-MoE policy: every decoder_sparse_step-th layer routes each
    token to num_experts_per_tok SwiGLU experts of width moe_intermediate_size, and the loss adds
    router_aux_loss_coef x the load-balancing loss. 0: a dense policy (the expert fields unused).
    num_experts_per_tok / moe_intermediate_size / decoder_sparse_step / router_aux_loss_coef: see
    num_experts.
    norm_topk_prob: renormalise the chosen experts' router probabilities to sum 1.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 2048
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001


@dataclasses.dataclass(frozen=True)
class PretrainTrainConfig:
    """Loop, precision, evaluation, checkpointing and export.

    steps: optimizer steps.
    batch_size: packed rows (of data.max_len tokens, several examples each) per optimizer step; on
        a mesh they are split over its data x fsdp devices (a multiple of that product).
    seed: seeds the initial weights.
    remat: recompute each layer's activations in the backward pass instead of keeping them (less
    memory, more compute).
    compute_dtype: dtype of the forward/backward (params stay float32 master copies).
    attention: "auto" (cuDNN flash attention on GPU, packed segments as a mask), "xla" or "cudnn".
    moe: a mixture-of-experts policy's grouped matmuls (`jaxspec.models.moe.grouped_matmul`):
        "auto" ("triton" on a GPU where jax-triton imports and the mesh keeps experts whole, else
        "ragged_dot"), "ragged_dot", or "triton" (the grouped-matmul kernels forward and backward,
        the Triton language through jax-triton on a GPU, per device on its rows with the experts
        whole: not with mesh.expert or mesh.tensor > 1); "triton-interpret" runs those kernels in
        Triton's interpreter (any backend, slow; needs torch).
    log_every: steps between training records (loss, gradient norm, learning rate, tokens per second).
    eval_every: steps between greedy-accuracy evaluations on the held-out set (0: only at the end).
    eval_max_new_tokens / eval_batch_size: the evaluation's longest response and the prompts it
    decodes per generate call.
    checkpoint_every: steps between checkpoints (the last step is always saved).
    keep_checkpoints: checkpoints kept (the newest ones).
    export_dir: where the HF folder goes (default: <run_dir>/policy); relative to the working dir.
    export_dtype: dtype of the exported weights.
    progress: show a progress bar (a plain line every JAXSPEC_PROGRESS_INTERVAL_S seconds when
    stdout is not a terminal).
    """

    steps: int
    batch_size: int
    seed: int = 0
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: bool = False
    attention: Literal["auto", "xla", "cudnn"] = "auto"
    moe: Literal["auto", "ragged_dot", "triton", "triton-interpret"] = "auto"
    log_every: int = 10
    eval_every: int = 0
    eval_max_new_tokens: int = 128
    eval_batch_size: int = 256
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    export_dir: str | None = None
    export_dtype: Literal["float32", "bfloat16"] = "float32"
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    """A pretraining run (`jaxspec pretrain --config FILE`).

    mesh: the devices of this process that train (`jaxspec.run.placement.MeshConfig`); e.g. data: 4
    splits every step's rows over 4 GPUs with the params replicated, fsdp: 4 shards them too. The
    same steps on any mesh (up to float summation order); a resumed run may change it."""

    data: DataConfig
    model: ModelShape
    optim: OptimConfig
    train: PretrainTrainConfig
    mesh: MeshConfig = MeshConfig()


# What a resumed run keeps from its saved config.yaml (`jaxspec.run.check_run_dir`).
FIXED_ON_RESUME = FixedKeys(sections=("data", "model"))


def validate(cfg: PretrainConfig, source: str) -> None:
    """Range checks that the type-checked loader cannot express (ValueError naming the key)."""

    need = requirement(source)

    d, m, o, t = cfg.data, cfg.model, cfg.optim, cfg.train
    need(d.num_train > 0, "data.num_train", f"must be > 0, got {d.num_train}")
    need(d.num_eval >= 0, "data.num_eval", f"must be >= 0, got {d.num_eval}")
    for key, message in problem_config_errors(d.levels, d.kinds, d.tally):
        need(False, f"data.{key}", message)
    if d.tokenizer is not None and not Path(d.tokenizer).is_file():
        raise FileNotFoundError(f"{source}: data.tokenizer: file not found: {d.tokenizer}")
    need("{question}" in d.prompt_template, "data.prompt_template", "must contain '{question}'")
    need(d.max_len >= 16, "data.max_len", f"must be >= 16, got {d.max_len}")
    need(
        d.max_len <= m.max_position_embeddings,
        "data.max_len",
        f"{d.max_len} exceeds model.max_position_embeddings={m.max_position_embeddings}",
    )
    for key in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
        need(getattr(m, key) > 0, f"model.{key}", f"must be > 0, got {getattr(m, key)}")
    need(
        m.num_heads % m.num_kv_heads == 0,
        "model.num_heads",
        f"{m.num_heads} is not a multiple of model.num_kv_heads={m.num_kv_heads}",
    )
    need(m.head_dim % 2 == 0, "model.head_dim", f"must be even (rotary embedding), got {m.head_dim}")
    need(m.num_experts >= 0, "model.num_experts", f"must be >= 0, got {m.num_experts}")
    if m.num_experts:
        need(
            1 <= m.num_experts_per_tok <= m.num_experts,
            "model.num_experts_per_tok",
            f"must be in [1, model.num_experts={m.num_experts}], got {m.num_experts_per_tok}",
        )
        need(m.moe_intermediate_size > 0, "model.moe_intermediate_size", f"must be > 0, got {m.moe_intermediate_size}")
        need(m.decoder_sparse_step > 0, "model.decoder_sparse_step", f"must be > 0, got {m.decoder_sparse_step}")
        need(m.router_aux_loss_coef >= 0, "model.router_aux_loss_coef", f"must be >= 0, got {m.router_aux_loss_coef}")
    need(o.learning_rate > 0, "optim.learning_rate", f"must be > 0, got {o.learning_rate}")
    need(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    need(
        0 <= o.warmup_steps < t.steps,
        "optim.warmup_steps",
        f"must be in [0, train.steps={t.steps}), got {o.warmup_steps}",
    )
    need(o.grad_clip > 0, "optim.grad_clip", f"must be > 0, got {o.grad_clip}")
    need(t.steps > 0, "train.steps", f"must be > 0, got {t.steps}")
    need(t.batch_size > 0, "train.batch_size", f"must be > 0, got {t.batch_size}")
    need(t.log_every > 0, "train.log_every", f"must be > 0, got {t.log_every}")
    need(t.eval_every >= 0, "train.eval_every", f"must be >= 0, got {t.eval_every}")
    need(t.eval_max_new_tokens > 0, "train.eval_max_new_tokens", f"must be > 0, got {t.eval_max_new_tokens}")
    need(t.eval_batch_size > 0, "train.eval_batch_size", f"must be > 0, got {t.eval_batch_size}")
    need(t.checkpoint_every > 0, "train.checkpoint_every", f"must be > 0, got {t.checkpoint_every}")
    need(t.keep_checkpoints > 0, "train.keep_checkpoints", f"must be > 0, got {t.keep_checkpoints}")
    for axis in ("data", "fsdp", "tensor"):
        need(getattr(cfg.mesh, axis) > 0, f"mesh.{axis}", f"must be > 0, got {getattr(cfg.mesh, axis)}")
    need(cfg.mesh.rollout_devices == 0, "mesh.rollout_devices", "a rollout mesh is for GRPO's rollout.mode async")
    need(
        t.moe in ("auto", "ragged_dot") or cfg.mesh.expert == cfg.mesh.tensor == 1,
        "train.moe",
        f"{t.moe!r} runs on whole experts: it needs mesh.expert = mesh.tensor = 1, got expert={cfg.mesh.expert}, "
        f"tensor={cfg.mesh.tensor}",
    )
    row_shards = cfg.mesh.data * cfg.mesh.fsdp
    need(
        t.batch_size % row_shards == 0,
        "train.batch_size",
        f"{t.batch_size} rows do not split over mesh.data x mesh.fsdp = {row_shards} devices",
    )
