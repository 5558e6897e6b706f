"""Configuration of a GRPO run (one YAML file; see configs/grpo_tiny.yaml).

Paths in the file are relative to the working directory. `policy.path: null` means the tiny
policy embedded in the package (`jaxspec/assets/tiny-policy`).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxspec.rollout import SpecConfig
from jaxspec.run.placement import MeshConfig
from jaxspec.run.run_dir import FixedKeys
from jaxspec.tasks.generator import DEFAULT_KINDS
from jaxspec.tasks.tally import TallyConfig
from jaxspec.tasks.tokenizer import BOS, EOS, PAD, PROMPT_TEMPLATE


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """The policy to train: an HF folder and the chat convention of its tokenizer.

    path: HF folder (config.json + safetensors); null = the embedded tiny policy.
    tokenizer: tokenizer.json file or folder holding one; null = the policy folder.
    eos_token / pad_token / bos_token: special-token strings of that tokenizer.
    prompt_template: chat template with a `{question}` slot; the response follows it directly.
    """

    path: str | None = None
    tokenizer: str | None = None
    eos_token: str = EOS
    pad_token: str = PAD
    bos_token: str | None = BOS
    prompt_template: str = PROMPT_TEMPLATE


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Training and held-out prompts.

    train / eval: .jsonl/.json/.parquet files read with `jaxspec.tasks.load_prompts`. When null,
    problems of the built-in math task are written to <run-dir>/data/ once and read back from
    there; held-out questions never occur in the training set.
    prompt_field / answer_field: the columns of those files holding the question and the answer.
    num_train / num_eval: problems generated when train / eval is null (num_eval 0: no held-out
    set).
    levels / kinds: difficulty levels (1..7) and problem kinds ("arithmetic", "word", "tally")
        generated.
    tally: the length law and phrasing variation of kind "tally", the long-answer workload
        (`jaxspec.tasks.tally.TallyConfig`).
    seed: seeds the generated problems and the epoch-wise shuffling of the training prompts.
    """

    train: str | None = None
    eval: str | None = None
    prompt_field: str = "question"
    answer_field: str = "answer"
    num_train: int = 2000
    num_eval: int = 64
    levels: tuple[int, ...] = (1,)
    kinds: tuple[str, ...] = DEFAULT_KINDS
    tally: TallyConfig = TallyConfig()
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Sampling of the rollouts: prompts_per_step groups of samples_per_prompt responses each.

    prompts_per_step: prompts (groups) per RL step.
    samples_per_prompt: responses sampled per prompt (the group whose rewards set the advantages).
    max_new_tokens: the longest response in tokens; longer ones are cut (truncated).
    temperature / top_p / top_k: the sampling (top_p 1 and top_k 0: off); the rollouts' log-probs
    are those of this processed distribution.
    dtype: dtype of the params copy the rollout reads ("sync" casts the float32 master params of
    the policy and the draft to it each step; with float32 it is the master params themselves,
    no copy).
    mode: "colocated" = every device of the trainer mesh generates, then trains (no weight copy);
        "async" = the last mesh.rollout_devices devices generate on their own copy of the policy
        (and draft) while the others train, with a device-to-device weight sync after each update
        (`jaxspec.rl.async_rollouts`).
    max_staleness (async): how many updates older than the trained policy the rollouts of a step
        may be (>= 0): 1 = one-step off-policy (step t trains on rollouts of the weights before step
        t-1's update while step t+1's are generated); k = step t trains on the weights before step
        t-k's update while the batches of up to k later steps are generated ahead (k weights
        copies on the rollout mesh; steps 1..k+1 use the initial weights, so are less stale);
        0 = each step's rollouts wait for the previous step's sync (the colocated run's numbers,
        on the rollout mesh). Stale rollouts are corrected by the decoupled objective (see
        `GRPOLossConfig`: loss.recompute_logprobs anchors the clip at the weights the step starts
        from and weighs each token by pi_prox / pi_behaviour, capped at loss.tis_cap; without it the
        ratio is taken against the rollout's own log-probs); logprob_mismatch_* measures the
        staleness. loss.tis_cap 0 with loss.recompute_logprobs would drop the behaviour policy and
        is refused in this mode.
    sub_batch: rollouts generated per `generate` call (null = the whole step's in one call). The
        KV cache is sized for one call, so this bounds the rollout's memory (e.g. 64 rows of a
        256-rollout step on 80 GB cards, `configs/grpo_qwen3_8b.yaml`); a multiple of
        samples_per_prompt (groups stay in one call) that divides the step's rollouts. Each call
        samples with its own key (fold_in of the step's key); the acceptance statistics combine
        the calls' counts exactly. rollout.mode async over P processes: each process generates
        an equal share of the calls on its own rollout devices, so their number must be a
        multiple of P (e.g. half the step's rollouts on 2 hosts).
    gather_weights: on a mesh with fsdp (or data) > 1, "sync" makes the rollout's copy of the
        policy (in rollout.dtype) whole on every device (still split over mesh.tensor and
        mesh.expert): one all-gather of the weights per step, where the fsdp-sharded copy makes
        every decode step all-gather them (an 8B policy on fsdp=2 H200s: 41 ms per decode step
        of 32 rows per GPU, against 8 ms for 64 rows on one GPU). The rows stay split over data x
        fsdp. It costs the rest of the policy per device during generation (bf16 8B on fsdp=2:
        8.2 GB more per GPU; freed before the update, and checked against the free memory at
        sync), so it is off by default: turn it on when the whole policy / tensor fits next to
        the resident state and the KV cache. Validation reads the same copy. No effect on one
        device; in rollout.mode async it applies to validation alone (the rollout mesh holds its
        own replicated copy).
    slots: null generates each call's rows on the staged engine (a dense KV cache of prompt +
        max_new_tokens for every row, the batch halved as rows finish); an integer S streams them
        through S decode slots over a paged KV cache (`jaxspec.rollout.slots`): a finished row's
        pages and slot go to the next pending row at once, so long-tailed rollouts keep S rows
        running, the memory follows the live tokens (the pool holds S rows' longest sequences)
        and a group's rows share their prompt's pages. The same key gives the same rollouts for
        any S and any mesh (on a mesh the rows, slots and pages split over data x fsdp, the KV
        heads over tensor; colocated or async, with or without gather_weights); a
        mixture-of-experts policy's routing is recorded as on the staged engine. auto picks S
        from the free memory of the rollout's devices: the most slots (at most the call's rows)
        whose longest sequences and step buffers fit in 90% of it, so no row is ever preempted;
        the choice is logged once
        ("jaxspec.rollout" logger; on the CPU, which reports no free memory, 2 GiB per device
        are assumed; `jaxspec.rollout.slot_memory`). null stays the default until GPU
        measurements show the slot engine faster everywhere.
    coupled: draw every rollout token by a race keyed by (call key, row, position) alone, so that
        speculative rollouts with deterministic drafts are the autoregressive rollouts of the same
        key, token for token (float32; bfloat16 until a near-tie breaks, which a thousands-token answer
        nearly always meets): AR and speculative runs train on the same answers, step times compare
        like for like (`jaxspec.rollout.Sampling.coupled`). Same law and acceptance as the default
        draws; refused with spec.draft_sampling stochastic.
    """

    prompts_per_step: int = 8
    samples_per_prompt: int = 8
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"
    mode: Literal["colocated", "async"] = "colocated"
    max_staleness: int = 1
    sub_batch: int | None = None
    gather_weights: bool = False
    slots: int | str | None = None
    coupled: bool = False


AGGREGATIONS = ("token", "sequence", "seq-mean-token-sum-norm")


@dataclasses.dataclass(frozen=True)
class GRPOLossConfig:
    """GRPO / DAPO / Dr.GRPO objective (see README "Algorithms").

    advantage: "std" = (r - mean) / (std + advantage_eps) within each group (unbiased std; GRPO),
        "mean" = r - mean (no scaling; Dr.GRPO).
    advantage_eps: added to the group's reward standard deviation (advantage "std").
    eps_low / eps_high: ratio clip range [1 - eps_low, 1 + eps_high] (DAPO clip-higher when
        eps_high > eps_low).
    clip_ratio_c: dual-clip PPO: for a negative advantage the token loss is at most
        clip_ratio_c * |A|, so a huge ratio cannot blow up the loss (> 1; null = off).
    aggregation: "token" = sum of token losses / number of tokens (DAPO; verl's token-mean);
        "sequence" = mean over sequences of each sequence's token mean (original GRPO; verl's
        seq-mean-token-mean); "seq-mean-token-sum-norm" = mean over sequences of each sequence's
        token sum / rollout.max_new_tokens (Dr.GRPO's constant normaliser: no length bias).
        The count divided by is the whole RL step's (tokens or sequences / minibatches), so with
        minibatches > 1 every token weighs the same whichever minibatch it falls in.
    kl_beta: coefficient of the k3 KL estimate to the frozen initial policy (0 = no reference).
        The KL compares the policy's and the reference's temperature-only distributions (no
        top-k/top-p, as verl does), which give every sampled token a finite log-prob.
    filter_groups: drop groups whose rewards are all equal (zero advantage) from the loss (DAPO).
    filter_groups_max_rounds: DAPO dynamic sampling: with filter_groups, generate groups for up to
        this many batches of rollout.prompts_per_step prompts per step (consuming the prompts)
        until prompts_per_step informative groups are found; the batch keeps its size, filled up
        with filtered groups (out of the loss) when the rounds run out. 1 = no over-sampling.
    mask_truncated: rollouts cut at rollout.max_new_tokens without an eos add no tokens to the
        loss (DAPO's overlong filtering: a cut answer is not a wrong one); they still count in
        their group's advantages.
    overlong_buffer / overlong_penalty: DAPO's soft overlong punishment: a response of L tokens
        with L > max_new_tokens - overlong_buffer gets reward - overlong_penalty * (L - (max_new_tokens
        - overlong_buffer)) / overlong_buffer (up to -overlong_penalty at max_new_tokens), before
        the advantages (0 = off). Accuracy metrics use the unshaped reward.
    ppo_epochs / minibatches: optimizer updates per rollout batch = ppo_epochs * minibatches.
    recompute_logprobs: the decoupled PPO objective (Hilton et al. 2021; AReaL): the trainer's
        forward before the first update gives the proximal log-probs (of the weights the update
        starts from), which anchor the ratio's clip, and each token's loss is weighted by the
        behaviour weight pi_prox / pi_behaviour from the rollout's own log-probs (exact under
        speculation), truncated at tis_cap. In expectation this is the on-policy gradient for
        rollouts of any staleness (rollout.mode async) and corrects the rollout/trainer numerical
        mismatch in colocated runs (TIS, Yao et al. 2025, as verl's tis_imp_ratio_cap). Logs the
        mismatch (logprob_mismatch_*) and the weight (behaviour_weight_mean / _max / _capped_frac).
        false: the ratio is taken against the rollout's log-probs directly (no weight needed).
    tis_cap: the behaviour weight's cap (>= 1); null = uncapped; 0 = no behaviour weight: the
        recomputed log-probs replace the rollout's and the behaviour policy is dropped, which only
        a colocated run may do (verl's default without TIS: the mismatch is numerical there, the
        staleness of async rollouts is not). No effect without recompute_logprobs.
    router_aux_coef: weight of the router's load-balancing loss (`jaxspec.models.moe.load_balancing_loss`,
        over each minibatch's non-padding tokens) added to the loss of a mixture-of-experts policy;
        null = the policy's router_aux_loss_coef (config.json), 0 = off. A dense policy takes only
        null or 0.
    routing_replay: routing replay (R3) for a mixture-of-experts policy: the rollout records the
        experts its router chose for every token (prompt and response, the accepted path of
        speculative steps), and the trainer's log-prob pass (recompute_logprobs) and every update
        run each token on those experts, their gate weights from the trainer's own router
        (`jaxspec.rl.routing`); the reference policy (kl_beta) routes by itself. A dense policy
        takes only false. With recompute_logprobs, a mixture-of-experts policy's steps log
        expert_disagreement whether replay is on or off.
    Tokens with a non-finite old, rollout, reference or current log-prob (outside the trainer's
    top-k/top-p nucleus) are dropped from the loss and counted in the metric nonfinite_tokens.
    """

    advantage: Literal["std", "mean"] = "std"
    advantage_eps: float = 1e-6
    eps_low: float = 0.2
    eps_high: float = 0.28
    clip_ratio_c: float | None = 3.0
    aggregation: Literal["token", "sequence", "seq-mean-token-sum-norm"] = "token"
    kl_beta: float = 0.0
    filter_groups: bool = False
    filter_groups_max_rounds: int = 1
    mask_truncated: bool = False
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    ppo_epochs: int = 1
    minibatches: int = 1
    recompute_logprobs: bool = False
    tis_cap: float | None = 2.0
    router_aux_coef: float | None = None
    routing_replay: bool = False

    @property
    def weighs_behaviour(self) -> bool:
        """Whether the loss takes the rollout's log-probs as the behaviour policy's beside
        recomputed proximal ones (the decoupled objective's weight)."""
        return self.recompute_logprobs and self.tis_cap != 0


@dataclasses.dataclass(frozen=True)
class PolicyOptimConfig:
    """AdamW with global-norm gradient clipping; the learning rate warms up linearly over the
    first `warmup_steps` optimizer updates (ppo_epochs * minibatches per RL step), then stays.

    learning_rate: the learning rate after the warmup.
    warmup_steps: optimizer updates over which it rises linearly from learning_rate / warmup_steps.
    weight_decay: AdamW's decoupled weight decay, applied to matrices only (not to norm weights or
    biases).
    b1 / b2: AdamW's decay rates of the first and second moment estimates.
    grad_clip: the global gradient norm that gradients are clipped to before AdamW.
    state_dtype: dtype of AdamW's first moment (optax `mu_dtype`); bfloat16 halves it (an 8B
    policy: 16 GB instead of 33). The second moment stays float32 (optax has no dtype for it).
    """

    learning_rate: float = 1e-6
    warmup_steps: int = 0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    grad_clip: float = 1.0
    state_dtype: Literal["float32", "bfloat16"] = "float32"


RANDOM_DRAFT = "random"  # spec.draft: a freshly initialised EAGLE-3 head


@dataclasses.dataclass(frozen=True)
class OnlineDraftConfig:
    """Online adaptation of the EAGLE-3 draft during RL (spec.method eagle3 only).

    online: false keeps the draft frozen.
    loss_weight: λ in L = L_policy + λ·L_draft; L_draft (`jaxspec.draft.eagle3_loss`) uses the
    policy's detached hidden states and logits of the training forward and has its own AdamW
    optimizer and gradient clipping (grad_clip). λ multiplies the head's step after the clipping
    and AdamW (which would cancel a weight on the loss): the head learns at λ·learning_rate, and
    λ = 0 freezes it while the rollouts still use it.
    train_every: the head trains on every n-th minibatch update of a step (the first, the (n+1)-th,
    ...); the others update the policy alone and skip the draft loss's unrolled steps. 1 trains it
    on every minibatch.
    ttt_steps: unrolled drafting steps of the training-time-test loss.
    step_decay: weight of the i-th unrolled step's loss: step_decay**i.
    learning_rate / b1 / b2 / weight_decay / grad_clip: the head's AdamW (constant learning rate)
    and its global gradient-norm clip.
    """

    online: bool = False
    loss_weight: float = 1.0
    train_every: int = 1
    ttt_steps: int = 7
    step_decay: float = 0.8
    learning_rate: float = 1e-4
    b1: float = 0.9
    b2: float = 0.95
    weight_decay: float = 0.0
    grad_clip: float = 0.5


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Validation accuracy on the held-out prompts: before training and every `every` steps.

    every: 0 disables validation.
    temperature: 0 is greedy decoding.
    max_new_tokens: null = the rollout's.
    batch_size: prompts decoded per generate call.
    """

    every: int = 0
    temperature: float = 0.0
    max_new_tokens: int | None = None
    batch_size: int = 64


@dataclasses.dataclass(frozen=True)
class GRPOTrainConfig:
    """Loop, numerics, checkpoints and logging.

    steps: RL steps (each: rollouts, rewards, ppo_epochs * minibatches updates).
    seed: seeds the run's random keys (sampling, a "random" draft head) and the minibatch shuffling.
    compute_dtype: dtype of the training forward/backward (master params stay float32).
    remat: recompute each layer's activations in the backward pass instead of keeping them (less
    memory, more compute).
    checkpoint_every: steps between checkpoints (the last step is always saved).
    keep_checkpoints: checkpoints kept (the newest ones).
    progress: show a progress bar (a plain line every JAXSPEC_PROGRESS_INTERVAL_S seconds when
    stdout is not a terminal).
    tensorboard: also write TensorBoard scalars to <run-dir>/tensorboard (needs tensorboardX).
    precompile: compile the trainer for every packed row count the run can produce in background
        threads from start-up, while the first rollouts run (`jaxspec.rl.compilation`); step 1
        waits for the rest (time_precompile_s) and compiles again, in the foreground, any that
        failed (logged in one line each), and no later step compiles the trainer. null = on
        with accelerators, off on the CPU (no device to overlap with, and it compiles row counts
        the run may never reach).
    precompile_threads: programs compiled at once (each compilation is single-threaded for the
        most part; the host's other cores idle while the rollouts run on the device).
    compilation_cache: JAX's persistent compilation cache: true = <run-dir>/xla_cache, a path = that
        directory (e.g. shared by runs of one config), false = off, null = <run-dir>/xla_cache with
        accelerators and off on the CPU (XLA's CPU executables do not serialize reliably: writing
        a multi-device CPU program crashed the process now and then, and CPU programs compile in
        seconds). A resumed or repeated run reads the programs back instead of compiling them.
        Only trusted users may write to it.
    compilation_cache_min_compile_s: programs that compiled faster than this are not written (0:
        every program, so a resumed run compiles nothing it compiled before).
    """

    steps: int
    seed: int = 0
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: bool = False
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    progress: bool = True
    tensorboard: bool = False
    precompile: bool | None = None
    precompile_threads: int = 4
    compilation_cache: bool | str | None = None
    compilation_cache_min_compile_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """A run. reward: a name of `jaxspec.rewards.registered_rewards()`: "math" (math-verify, for
    external math data: GSM8K / MATH / DAPO-style answers, LaTeX; timed per response) or
    "arithmetic" (exact rationals, for the built-in task's integer and fraction answers: faster)."""

    train: GRPOTrainConfig
    policy: PolicyConfig = PolicyConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: str = "math"
    loss: GRPOLossConfig = GRPOLossConfig()
    optim: PolicyOptimConfig = PolicyOptimConfig()
    spec: SpecConfig = SpecConfig()
    draft: OnlineDraftConfig = OnlineDraftConfig()
    eval: EvalConfig = EvalConfig()
    mesh: MeshConfig = MeshConfig()


# Keys a resumed run may change: they steer the loop's length and bookkeeping, not the training.
RESUMABLE_KEYS = frozenset(
    {
        "train.steps",
        "train.progress",
        "train.checkpoint_every",
        "train.keep_checkpoints",
        "train.tensorboard",
        "train.precompile",
        "train.precompile_threads",
        "train.compilation_cache",
        "train.compilation_cache_min_compile_s",
        "mesh.data",
        "mesh.fsdp",
        "mesh.tensor",
        "mesh.expert",
    }
)
# What a resumed run keeps from its saved config.yaml (`jaxspec.run.check_run_dir`).
FIXED_ON_RESUME = FixedKeys(all_but=RESUMABLE_KEYS)
