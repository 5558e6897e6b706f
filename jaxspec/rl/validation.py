"""Range checks of a GRPO config that the type-checked loader cannot express."""

from __future__ import annotations

from jaxspec.config_io import requirement
from jaxspec.rl.config import GRPOConfig
from jaxspec.tasks.generator import problem_config_errors


def validate(cfg: GRPOConfig, source: str) -> None:
    """Range checks the type-checked loader cannot express (ValueError naming the key)."""

    need = requirement(source)

    def positive(section, name: str, prefix: str, allow_zero: bool = False) -> None:
        value = getattr(section, name)
        ok = value >= 0 if allow_zero else value > 0
        need(ok, f"{prefix}.{name}", f"must be {'>=' if allow_zero else '>'} 0, got {value}")

    d, r, lo, o, s, dr, e, t = cfg.data, cfg.rollout, cfg.loss, cfg.optim, cfg.spec, cfg.draft, cfg.eval, cfg.train
    if d.train is None:
        positive(d, "num_train", "data")
    positive(d, "num_eval", "data", allow_zero=True)
    for key, message in problem_config_errors(d.levels, d.kinds, d.tally):
        need(False, f"data.{key}", message)
    positive(r, "prompts_per_step", "rollout")
    need(
        r.samples_per_prompt >= 2,
        "rollout.samples_per_prompt",
        f"must be >= 2 (advantages are normalised within each group), got {r.samples_per_prompt}",
    )
    positive(r, "max_new_tokens", "rollout")
    if r.sub_batch is not None:
        rollouts = r.prompts_per_step * r.samples_per_prompt
        need(
            r.sub_batch > 0 and r.sub_batch % r.samples_per_prompt == 0 and rollouts % r.sub_batch == 0,
            "rollout.sub_batch",
            f"must be a multiple of rollout.samples_per_prompt ({r.samples_per_prompt}) "
            f"that divides the step's {rollouts} rollouts, got {r.sub_batch}",
        )
    if r.slots is not None:
        need(
            r.slots == "auto" or (isinstance(r.slots, int) and not isinstance(r.slots, bool) and r.slots >= 1),
            "rollout.slots",
            f"must be null, auto (from the devices' free memory) or an integer >= 1 (decode slots), got {r.slots!r}",
        )
    need(
        r.temperature > 0,
        "rollout.temperature",
        f"must be > 0 (the policy gradient needs a sampling distribution), got {r.temperature}",
    )
    need(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    need(
        not (r.coupled and cfg.spec.method != "none" and cfg.spec.stochastic),
        "rollout.coupled",
        "needs deterministic drafts: spec.draft_sampling stochastic draws its draft tokens from its own noise, "
        "so its rollouts cannot follow the autoregressive draws (set spec.draft_sampling: greedy)",
    )
    positive(r, "top_k", "rollout", allow_zero=True)
    need(lo.advantage_eps > 0, "loss.advantage_eps", f"must be > 0, got {lo.advantage_eps}")
    positive(lo, "eps_low", "loss", allow_zero=True)
    positive(lo, "eps_high", "loss", allow_zero=True)
    need(lo.eps_low < 1, "loss.eps_low", f"must be < 1, got {lo.eps_low}")
    positive(lo, "kl_beta", "loss", allow_zero=True)
    need(
        lo.clip_ratio_c is None or lo.clip_ratio_c > 1,
        "loss.clip_ratio_c",
        f"must be > 1 or null, got {lo.clip_ratio_c}",
    )
    positive(lo, "filter_groups_max_rounds", "loss")
    need(
        lo.filter_groups_max_rounds == 1 or lo.filter_groups,
        "loss.filter_groups_max_rounds",
        "over-sampling refills groups that filter_groups drops; set loss.filter_groups: true",
    )
    positive(lo, "overlong_buffer", "loss", allow_zero=True)
    need(
        lo.overlong_buffer <= r.max_new_tokens,
        "loss.overlong_buffer",
        f"must be <= rollout.max_new_tokens={r.max_new_tokens}, got {lo.overlong_buffer}",
    )
    positive(lo, "overlong_penalty", "loss", allow_zero=True)
    need(
        lo.tis_cap is None or lo.tis_cap == 0 or lo.tis_cap >= 1,
        "loss.tis_cap",
        f"the behaviour weight's cap must be >= 1, null (uncapped) or 0 (no weight), got {lo.tis_cap}",
    )
    need(
        not (r.mode == "async" and lo.recompute_logprobs and lo.tis_cap == 0),
        "loss.tis_cap",
        "0 with loss.recompute_logprobs: true drops the behaviour policy, and rollout.mode async trains on "
        "stale rollouts: the update would treat them as on-policy. Set loss.tis_cap to a cap >= 1 (e.g. 2) "
        "or null, or loss.recompute_logprobs: false",
    )
    need(
        lo.router_aux_coef is None or lo.router_aux_coef >= 0,
        "loss.router_aux_coef",
        f"must be >= 0 or null, got {lo.router_aux_coef}",
    )
    positive(lo, "ppo_epochs", "loss")
    positive(lo, "minibatches", "loss")
    rows = r.prompts_per_step * r.samples_per_prompt
    need(
        rows % lo.minibatches == 0,
        "loss.minibatches",
        f"{lo.minibatches} does not divide the {rows} rollouts per step "
        f"(rollout.prompts_per_step * rollout.samples_per_prompt)",
    )
    need(o.learning_rate > 0, "optim.learning_rate", f"must be > 0, got {o.learning_rate}")
    positive(o, "warmup_steps", "optim", allow_zero=True)
    positive(o, "weight_decay", "optim", allow_zero=True)
    positive(o, "grad_clip", "optim")
    for key, message in s.errors():
        need(False, key, message)
    need(
        s.method != "draft_model" or s.draft is not None,
        "spec.draft",
        "method draft_model needs the HF folder of the draft model",
    )
    need(
        not dr.online or s.method == "eagle3",
        "draft.online",
        f"online draft adaptation trains an EAGLE-3 head; spec.method is {s.method!r}",
    )
    positive(dr, "loss_weight", "draft", allow_zero=True)
    positive(dr, "ttt_steps", "draft")
    positive(dr, "train_every", "draft")
    need(0 < dr.step_decay <= 1, "draft.step_decay", f"must be in (0, 1], got {dr.step_decay}")
    need(dr.learning_rate > 0, "draft.learning_rate", f"must be > 0, got {dr.learning_rate}")
    positive(dr, "grad_clip", "draft")
    positive(e, "every", "eval", allow_zero=True)
    positive(e, "temperature", "eval", allow_zero=True)
    need(
        e.max_new_tokens is None or e.max_new_tokens > 0,
        "eval.max_new_tokens",
        f"must be > 0 or null, got {e.max_new_tokens}",
    )
    positive(e, "batch_size", "eval")
    need(
        e.every == 0 or d.eval is not None or d.num_eval > 0,
        "eval.every",
        "validation needs held-out prompts: set data.eval or data.num_eval > 0",
    )
    for axis in ("data", "fsdp", "tensor"):
        positive(cfg.mesh, axis, "mesh")
    positive(cfg.mesh, "rollout_devices", "mesh", allow_zero=True)
    need(
        r.mode == "async" or cfg.mesh.rollout_devices == 0,
        "mesh.rollout_devices",
        f"a rollout mesh is for rollout.mode async; rollout.mode is {r.mode!r}",
    )
    need(
        r.mode == "colocated" or cfg.mesh.rollout_devices > 0,
        "mesh.rollout_devices",
        "rollout.mode async generates on the last mesh.rollout_devices devices; set it to >= 1",
    )
    need(
        cfg.mesh.rollout_devices == 0 or rows % cfg.mesh.rollout_devices == 0,
        "mesh.rollout_devices",
        f"{cfg.mesh.rollout_devices} devices do not split the {rows} rollouts per step "
        f"(rollout.prompts_per_step * rollout.samples_per_prompt)",
    )
    positive(r, "max_staleness", "rollout", allow_zero=True)
    need(
        r.mode == "colocated" or lo.filter_groups_max_rounds == 1,
        "loss.filter_groups_max_rounds",
        "rollout.mode async generates one batch of prompts per step ahead of its rewards; set it to 1",
    )
    positive(t, "steps", "train")
    positive(t, "precompile_threads", "train")
    positive(t, "checkpoint_every", "train")
    positive(t, "keep_checkpoints", "train")
    positive(t, "compilation_cache_min_compile_s", "train", allow_zero=True)
