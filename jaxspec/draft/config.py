"""Shape of an EAGLE-3 draft head and its fit to a policy.

A head is one Llama decoder layer whose attention reads 2H features (the normed token embedding
next to the normed hidden input), fed by the policy's hidden states at three "aux" layers and
predicting a reduced vocabulary of `draft_vocab_size` policy tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.models.config import ModelConfig

MAX_DRAFT_VOCAB = 32000


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """0-based policy layers whose *outputs* feed the head: (1, L/2 - 1, L - 4), clamped into
    [0, L - 1] so that 2- to 4-layer test policies have valid ids."""
    ids = (1, num_layers // 2 - 1, num_layers - 4)
    return tuple(min(max(i, 0), num_layers - 1) for i in ids)  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """Static shape and numerics of an EAGLE-3 head (hashable: a `jax.jit` static argument).

    hidden_size: H, equal to the policy's (the head reads the policy's token embedding).
    vocab_size: the policy's vocabulary V; draft_vocab_size: Vd <= V tokens the head predicts.
    aux_layer_ids: 0-based policy layers whose outputs are concatenated low || mid || high; None
        for a head whose checkpoint names none (published heads mostly): the policy's default
        layers (`default_aux_layer_ids`), filled in by `for_layers_of` when the head first meets
        its policy (a `jaxspec.rollout.Spec`, `load_eagle3(..., policy=)`).
    rope_theta / rope_scaling / max_position_embeddings: copied from the policy; rope_scaling is
        HF rope parameters minus theta as sorted (key, value) pairs, as in `ModelConfig`.
    """

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, int, int] | None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = (("rope_type", "default"),)
    max_position_embeddings: int = 2048

    def __post_init__(self):
        if self.aux_layer_ids is not None:
            self._check_layer_ids()
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be in [1, vocab_size={self.vocab_size}]")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary embedding)")
        # Validates the rope parameters the same way a policy config does.
        self.layer_config  # noqa: B018

    def _check_layer_ids(self) -> None:
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"aux_layer_ids must name 3 policy layers, got {list(self.aux_layer_ids)}")
        if any(i < 0 for i in self.aux_layer_ids):
            raise ValueError(f"aux_layer_ids must be >= 0 (layer outputs), got {list(self.aux_layer_ids)}")

    def for_layers_of(self, cfg: ModelConfig) -> DraftConfig:
        """This head with its aux layers resolved for policy `cfg`: itself when it names them, else
        with the policy's default layers (1, L/2 - 1, L - 4), as published EAGLE-3 loaders do."""
        if self.aux_layer_ids is not None:
            return self
        return dataclasses.replace(self, aux_layer_ids=default_aux_layer_ids(cfg.num_layers))

    @property
    def layer_config(self) -> ModelConfig:
        """The head's decoder layer as a one-layer Llama `ModelConfig`: what the shared rope and
        MLP helpers of `jaxspec.models` read (eps, rope, shapes)."""
        return ModelConfig(
            family="llama",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=1,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            rms_norm_eps=self.rms_norm_eps,
        )

    @classmethod
    def for_policy(
        cls, cfg: ModelConfig, draft_vocab_size: int | None = None, aux_layer_ids: tuple[int, ...] | None = None
    ) -> DraftConfig:
        """A head with the policy's layer shapes, rope and norm eps.

        draft_vocab_size: default min(V, 32000). aux_layer_ids: default `default_aux_layer_ids`.
        """
        dcfg = cls(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            vocab_size=cfg.vocab_size,
            draft_vocab_size=min(cfg.vocab_size, MAX_DRAFT_VOCAB) if draft_vocab_size is None else draft_vocab_size,
            aux_layer_ids=default_aux_layer_ids(cfg.num_layers) if aux_layer_ids is None else tuple(aux_layer_ids),
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=cfg.rope_theta,
            rope_scaling=cfg.rope_scaling,
            max_position_embeddings=cfg.max_position_embeddings,
        )
        check_compatible(cfg, dcfg)
        return dcfg


def check_compatible(cfg: ModelConfig, dcfg: DraftConfig) -> None:
    """Raises ValueError naming the dimension when the head cannot serve policy `cfg`."""
    if dcfg.hidden_size != cfg.hidden_size:
        raise ValueError(f"hidden_size: the draft head has {dcfg.hidden_size}, the policy has {cfg.hidden_size}")
    if dcfg.vocab_size != cfg.vocab_size:
        raise ValueError(
            f"vocab_size: the draft head targets a vocabulary of {dcfg.vocab_size}, the policy has {cfg.vocab_size}"
        )
    bad = [i for i in dcfg.aux_layer_ids or () if not 0 <= i < cfg.num_layers]  # None: the defaults, in range
    if bad:
        raise ValueError(
            f"aux_layer_ids: {list(dcfg.aux_layer_ids)} name layers outside the policy's [0, {cfg.num_layers})"
        )
