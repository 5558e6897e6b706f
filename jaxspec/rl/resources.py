"""What a GRPO run reads from disk, checked before any compute, and the speculative-decoding setup.

`check_inputs` resolves and checks every configured path and the fit of draft to policy from the
config files alone (no weights are read), so a bad config fails in well under a second with one
message naming the problem.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import jax

from jaxspec.assets import TINY_EAGLE3, TINY_POLICY
from jaxspec.models.config import ModelConfig
from jaxspec.rewards.registry import get_reward
from jaxspec.rl.config import RANDOM_DRAFT, GRPOConfig
from jaxspec.rl.loss import router_aux_weight
from jaxspec.rl.routing import replays_routing
from jaxspec.rollout import Spec, SpecConfig
from jaxspec.run.placement import check_devices
from jaxspec.tasks.tokenizer import ChatTokenizer


@dataclasses.dataclass(frozen=True)
class RunInputs:
    """Resolved inputs of a run: the policy folder and config, tokenizer, draft folder (or None)."""

    policy_dir: Path
    model: ModelConfig
    tokenizer: ChatTokenizer
    tokenizer_file: Path
    draft_dir: Path | None


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{what}: {path} not found")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: {path} is not valid JSON ({e})") from None


def _check_file(path: str | None, key: str) -> None:
    if path is not None and not Path(path).is_file():
        raise FileNotFoundError(f"{key}: file not found: {path}")


def check_inputs(cfg: GRPOConfig) -> RunInputs:
    """Resolves paths and checks them, the reward, the tokenizer, the draft/policy fit and the
    loss's fit to the policy (loss.router_aux_coef, loss.routing_replay) and the slot engine's to
    the drafter (rollout.slots).

    Raises FileNotFoundError naming a missing file, ValueError for anything that does not fit,
    RewardError when the reward fails its self-test (`jaxspec.rewards.Reward.check`).
    """
    policy_dir = Path(cfg.policy.path) if cfg.policy.path is not None else TINY_POLICY
    if not policy_dir.is_dir():
        what = "policy.path" if cfg.policy.path is not None else "policy.path (null: the embedded tiny policy)"
        raise FileNotFoundError(f"{what}: policy folder not found: {policy_dir}")
    model = ModelConfig.from_hf(
        _read_json(policy_dir / "config.json", "policy.path"), source=str(policy_dir / "config.json")
    )
    tokenizer_file = Path(cfg.policy.tokenizer) if cfg.policy.tokenizer is not None else policy_dir
    tokenizer_file = tokenizer_file / "tokenizer.json" if tokenizer_file.is_dir() else tokenizer_file
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"policy.tokenizer: tokenizer file not found: {tokenizer_file}")
    tok = ChatTokenizer.from_file(
        tokenizer_file, cfg.policy.eos_token, cfg.policy.pad_token, cfg.policy.bos_token, cfg.policy.prompt_template
    )
    if tok.vocab_size > model.vocab_size:
        raise ValueError(
            f"policy.tokenizer: {tokenizer_file} has {tok.vocab_size} tokens, more than the policy's "
            f"vocab_size={model.vocab_size}"
        )
    _check_file(cfg.data.train, "data.train")
    _check_file(cfg.data.eval, "data.eval")
    reward = get_reward(cfg.reward)
    if cfg.train.tensorboard and importlib.util.find_spec("tensorboardX") is None:
        raise ValueError("train.tensorboard: the tensorboardX package is not installed; set train.tensorboard: false")
    router_aux_weight(cfg.loss, model)
    replays_routing(cfg.loss, model)
    draft_dir = check_spec(cfg.spec, model)
    check_devices(cfg.mesh)
    r = cfg.rollout
    rows, processes = r.prompts_per_step * r.samples_per_prompt, jax.process_count()
    calls = rows // (r.sub_batch or rows)
    if r.mode == "async" and processes > 1 and calls % processes:
        raise ValueError(
            f"rollout.sub_batch: rollout.mode async over {processes} processes generates the step's "
            f"{rows} rollouts as calls of rollout.sub_batch rows, an equal share of them on every "
            f"process; the {calls} call(s) of {r.sub_batch or rows} rows do not split over the "
            f"processes (e.g. rollout.sub_batch={rows // processes})"
        )
    reward.check()  # last: it may start the reward's worker process
    return RunInputs(
        policy_dir=policy_dir, model=model, tokenizer=tok, tokenizer_file=tokenizer_file, draft_dir=draft_dir
    )


def check_spec(spec: SpecConfig, model: ModelConfig) -> Path | None:
    """Checks that the draft exists and fits the policy (from its config.json); the draft folder."""
    if spec.method == "none":
        return None
    if spec.method in ("ngram", "suffix"):
        if spec.draft is not None:
            raise ValueError(f"spec.draft: method {spec.method} drafts from the token history and takes no draft")
        return None
    if spec.draft == RANDOM_DRAFT:
        if spec.method != "eagle3":
            raise ValueError(f"spec.draft: {RANDOM_DRAFT!r} initialises an EAGLE-3 head; method is {spec.method!r}")
        return None
    if spec.draft is None and spec.method == "eagle3":
        draft_dir = TINY_EAGLE3
        if not draft_dir.is_dir():
            raise FileNotFoundError(
                f"spec.draft (null: the embedded tiny EAGLE-3 head): draft folder not found: "
                f"{draft_dir}; name a head folder or use spec.draft: {RANDOM_DRAFT}"
            )
    else:
        draft_dir = Path(spec.draft)
        if not draft_dir.is_dir():
            raise FileNotFoundError(f"spec.draft: draft folder not found: {draft_dir}")
    draft = _read_json(draft_dir / "config.json", "spec.draft")
    if spec.method == "eagle3":
        for key, want in (("hidden_size", model.hidden_size), ("vocab_size", model.vocab_size)):
            if draft.get(key) != want:
                raise ValueError(
                    f"spec.draft: {draft_dir} does not fit the policy: {key} is {draft.get(key)} "
                    f"in the draft, {want} in the policy"
                )
        aux = (draft.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []
        if any(not 0 <= i < model.num_layers for i in aux):
            raise ValueError(
                f"spec.draft: {draft_dir} reads policy layers {aux}, but the policy has {model.num_layers} layers"
            )
    else:
        draft_model = ModelConfig.from_hf(draft, source=str(draft_dir / "config.json"))
        if draft_model.vocab_size != model.vocab_size:
            raise ValueError(
                f"spec.draft: {draft_dir} does not fit the policy: vocab_size is "
                f"{draft_model.vocab_size} in the draft model, {model.vocab_size} in the policy"
            )
    return draft_dir


def load_draft(spec: SpecConfig, draft_dir: Path | None, model: ModelConfig, key: jax.Array):
    """(config, params) of the draft, or None (no speculation, ngram or suffix). draft_dir: from
    `check_spec` (None with method eagle3: a head initialised from `key`)."""
    if spec.method in ("none", "ngram", "suffix"):
        return None
    if spec.method == "draft_model":
        from jaxspec.models.checkpoint import load_hf

        return load_hf(draft_dir, "float32")
    from jaxspec.draft import init_eagle3, load_eagle3

    if draft_dir is None:
        return init_eagle3(model, key)
    try:
        return load_eagle3(draft_dir, "float32", policy=model)
    except ValueError as e:
        raise ValueError(f"spec.draft: {e}") from None


def make_spec(spec: SpecConfig, draft) -> Spec | None:
    """The `jaxspec.rollout.Spec` of this step (the draft's current params), or None."""
    return None if spec.method == "none" else Spec.from_config(spec, draft)
