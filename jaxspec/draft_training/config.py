"""Configuration of an offline EAGLE-3 training run (one YAML file; see configs/head_tiny.yaml)."""

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

# The policy used when a config names none (present once the embedded tiny policy is trained).
EMBEDDED_POLICY = Path(__file__).resolve().parent.parent / "assets" / "tiny-policy"


@dataclasses.dataclass(frozen=True)
class PromptData:
    """Where training prompts come from: generated math problems, or a prompt file.

    num_prompts / seed / levels / kinds: the size, seed, difficulty levels (1..7) and problem kinds of
    the generated pool (`jaxspec.tasks.generate_problems`).
    tally: the length law and phrasing variation of kind "tally", the long, heavy-tailed answers
        (`jaxspec.tasks.tally.TallyConfig`).
    prompts_file: a .jsonl/.json/.parquet file read with `jaxspec.tasks.load_prompts` instead.
    prompt_field / answer_field: the columns of prompts_file holding the question and the answer.
    max_prompt_len: the longest prompt in tokens (chat-formatted with the policy's tokenizer);
        longer prompts are dropped.
    """

    num_prompts: int = 4096
    seed: int = 0
    levels: tuple[int, ...] = (1,)
    kinds: tuple[str, ...] = DEFAULT_KINDS
    tally: TallyConfig = TallyConfig()
    prompts_file: str | None = None
    prompt_field: str = "question"
    answer_field: str = "answer"
    max_prompt_len: int = 64


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """How the frozen policy samples the responses the head learns from.

    temperature / top_p / top_k: the sampling (temperature > 0; top_p 1 and top_k 0: off).
    max_new_tokens: the longest response in tokens.
    batches_per_call: one generate call samples this many training batches at once (its rows serve
    that many steps): decoding a small batch leaves a GPU mostly idle, so fewer, larger calls cost
    less.
    slots: null samples each call on the staged engine (a dense KV cache of prompt + max_new_tokens
    for every row of the call, the batch halved as rows finish: a call lasts as long as its longest
    response); an integer S streams the call's rows through S decode slots over a paged KV cache
    (`jaxspec.rollout.slots`), a finished row's slot taking the next row at once, so a call of many
    more rows than S costs about its responses' tokens / S steps at the memory of S rows; "auto"
    picks S from the devices' free memory. The same key gives the same tokens either way (in
    float32; `jaxspec.rollout.generate`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    batches_per_call: int = 1
    slots: int | str | None = None


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """The EAGLE-3 head to train.

    draft_vocab_size: the head's vocabulary, the most frequent policy tokens of the first
    vocab_count_batches generated batches; default min(V, 32000).
    vocab_count_batches: generated batches whose tokens are counted to choose that vocabulary
    (they then serve as the first training batches).
    aux_layer_ids: the three policy layers whose hidden states the head reads; default
    (1, L/2-1, L-4), clamped.
    init: an EAGLE-3 folder to start from instead of a random head (its maps are kept)."""

    draft_vocab_size: int | None = None
    aux_layer_ids: tuple[int, int, int] | None = None
    vocab_count_batches: int = 8
    init: str | None = None


@dataclasses.dataclass(frozen=True)
class HeadLossConfig:
    """The training-time-test loss (`jaxspec.draft.eagle3_loss`).

    num_steps: unrolled drafting steps per position, each predicting one more token ahead.
    step_decay: weight of the i-th unrolled step's loss: step_decay**i.
    """

    num_steps: int = 7
    step_decay: float = 0.8


@dataclasses.dataclass(frozen=True)
class HeadOptimConfig(OptimConfig):
    """`jaxspec.optim.OptimConfig` with the head's defaults (public EAGLE-3 recipes: lr ~1e-4, no
    weight decay, clip 0.5)."""

    learning_rate: float = 1e-4
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5


@dataclasses.dataclass(frozen=True)
class HeadTrainConfig:
    """Loop, checkpoints and export.

    steps: optimizer steps.
    batch_size: rollouts per step (one response per prompt).
    seed: seeds the head's initial weights, the prompts drawn for each batch and their sampling.
    policy_dtype: dtype of the frozen policy for generation and the feature forward (the head
    trains in float32).
    log_every: steps between training records (loss, top-1 agreement per unrolled step).
    checkpoint_every: steps between checkpoints (the last step is always saved).
    keep_checkpoints: checkpoints kept (the newest ones).
    export_dir: where the public-layout head goes (default <run_dir>/draft).
    export_dtype: dtype of the exported head.
    progress: show a progress bar (a plain line every JAXSPEC_PROGRESS_INTERVAL_S seconds when
    stdout is not a terminal).
    """

    steps: int
    batch_size: int = 32
    seed: int = 0
    policy_dtype: Literal["float32", "bfloat16"] = "float32"
    log_every: int = 10
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    export_dir: str | None = None
    export_dtype: Literal["float32", "bfloat16"] = "float32"
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Top-1 agreement per unrolled position on fresh generated batches after training.

    batches: generated batches evaluated (0: no evaluation).
    data: the evaluation prompts (default: the training prompt section with another seed). A head
    trained out of domain is compared with an in-domain one by evaluating both on the same data.
    """

    batches: int = 2
    data: PromptData | None = None


@dataclasses.dataclass(frozen=True)
class DraftTrainConfig:
    """An offline EAGLE-3 head training run (`jaxspec draft train --config FILE`).

    policy: HF folder of the frozen policy, with its tokenizer.json (default: the embedded
    tiny policy).

    mesh: the devices of this process that train (`jaxspec.run.placement.MeshConfig`): the frozen
    policy is sharded by the model's rules (fsdp, tensor), the head and its optimizer state are
    replicated, and each step's rows (and the rollouts that make them) are split over data x fsdp
    devices (train.batch_size a multiple of that product). The same steps on any mesh (up to float
    summation order); a resumed run may change it.
    """

    train: HeadTrainConfig
    policy: str | None = None
    data: PromptData = PromptData()
    generation: GenerationConfig = GenerationConfig()
    head: HeadConfig = HeadConfig()
    loss: HeadLossConfig = HeadLossConfig()
    optim: HeadOptimConfig = HeadOptimConfig()
    eval: EvalConfig = EvalConfig()
    mesh: MeshConfig = MeshConfig()

    def policy_path(self) -> Path:
        """The policy folder; FileNotFoundError when it does not exist."""
        path = Path(self.policy) if self.policy else EMBEDDED_POLICY
        if not path.is_dir():
            hint = "" if self.policy else " (no `policy` given and the embedded tiny policy is not built)"
            raise FileNotFoundError(f"policy folder not found: {path}{hint}")
        return path


# What a resumed run keeps from its saved config.yaml (`jaxspec.run.check_run_dir`).
FIXED_ON_RESUME = FixedKeys(sections=("policy", "data", "generation", "head"))


def validate(cfg: DraftTrainConfig, source: str) -> None:
    """Range checks the type-checked loader cannot express (ValueError naming the key)."""

    need = requirement(source)

    for prefix, d in (("data", cfg.data), ("eval.data", cfg.eval.data)):
        if d is None:
            continue
        need(d.num_prompts > 0, f"{prefix}.num_prompts", f"must be > 0, got {d.num_prompts}")
        for key, message in problem_config_errors(d.levels, d.kinds, d.tally):
            need(False, f"{prefix}.{key}", message)
        need(d.max_prompt_len > 0, f"{prefix}.max_prompt_len", f"must be > 0, got {d.max_prompt_len}")
    g, h, lo, o, t = cfg.generation, cfg.head, cfg.loss, cfg.optim, cfg.train
    need(g.temperature > 0, "generation.temperature", f"must be > 0 (sampled training data), got {g.temperature}")
    need(0 < g.top_p <= 1, "generation.top_p", f"must be in (0, 1], got {g.top_p}")
    need(g.top_k >= 0, "generation.top_k", f"must be >= 0, got {g.top_k}")
    need(g.max_new_tokens > 0, "generation.max_new_tokens", f"must be > 0, got {g.max_new_tokens}")
    need(g.batches_per_call > 0, "generation.batches_per_call", f"must be > 0, got {g.batches_per_call}")
    need(
        g.slots is None
        or g.slots == "auto"
        or (isinstance(g.slots, int) and not isinstance(g.slots, bool) and g.slots >= 1),
        "generation.slots",
        f"must be null, auto (from the devices' free memory) or an integer >= 1 (decode slots), got {g.slots!r}",
    )
    need(
        h.draft_vocab_size is None or h.draft_vocab_size > 0,
        "head.draft_vocab_size",
        f"must be > 0, got {h.draft_vocab_size}",
    )
    need(h.vocab_count_batches > 0, "head.vocab_count_batches", f"must be > 0, got {h.vocab_count_batches}")
    need(lo.num_steps > 0, "loss.num_steps", f"must be > 0, got {lo.num_steps}")
    need(0 < lo.step_decay <= 1, "loss.step_decay", f"must be in (0, 1], got {lo.step_decay}")
    need(o.learning_rate > 0, "optim.learning_rate", f"must be > 0, got {o.learning_rate}")
    need(
        0 <= o.warmup_steps < t.steps,
        "optim.warmup_steps",
        f"must be in [0, train.steps={t.steps}), got {o.warmup_steps}",
    )
    need(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    need(o.grad_clip > 0, "optim.grad_clip", f"must be > 0, got {o.grad_clip}")
    need(t.steps > 0, "train.steps", f"must be > 0, got {t.steps}")
    need(t.batch_size > 0, "train.batch_size", f"must be > 0, got {t.batch_size}")
    need(t.log_every > 0, "train.log_every", f"must be > 0, got {t.log_every}")
    need(t.checkpoint_every > 0, "train.checkpoint_every", f"must be > 0, got {t.checkpoint_every}")
    need(t.keep_checkpoints > 0, "train.keep_checkpoints", f"must be > 0, got {t.keep_checkpoints}")
    need(cfg.eval.batches >= 0, "eval.batches", f"must be >= 0, got {cfg.eval.batches}")
    for axis in ("data", "fsdp", "tensor"):
        need(getattr(cfg.mesh, axis) > 0, f"mesh.{axis}", f"must be > 0, got {getattr(cfg.mesh, axis)}")
    row_shards = cfg.mesh.data * cfg.mesh.fsdp
    need(
        t.batch_size % row_shards == 0,
        "train.batch_size",
        f"{t.batch_size} rows do not split over mesh.data x mesh.fsdp = {row_shards} devices",
    )
