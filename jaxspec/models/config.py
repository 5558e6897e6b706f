"""Decoder configuration: one frozen dataclass for Qwen2/2.5, Qwen3 (dense and MoE) and Llama 3.x.

`ModelConfig.from_hf` reads a Hugging Face `config.json` dict (transformers 4.x `rope_scaling` /
`rope_theta` or 5.x `rope_parameters`), `to_hf` writes one back that `transformers` loads.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
_MODEL_TYPES = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static shape and numerics of a decoder-only policy.

    family: "qwen2" (q/k/v bias), "qwen3" (q/k RMSNorm over head_dim), "qwen3_moe" (qwen3 attention,
        mixture-of-experts MLPs) or "llama".
    rope_scaling: HF rope parameters minus theta, as sorted (key, value) pairs so the config stays
        hashable (jit static argument); `rope_type` is one of SUPPORTED_ROPE_TYPES.
    attention_bias, qk_norm: fixed by the family (None = the family's value): only qwen2 has
        q/k/v biases (llama/qwen3 with attention_bias would also bias o_proj, which jaxspec does
        not implement) and only qwen3 has q/k norms. A contradicting value raises ValueError, so
        every config maps to exactly one transformers architecture.
    num_experts .. router_aux_loss_coef: the Qwen3-MoE fields (family "qwen3_moe" only). Layer i is
        sparse (`is_sparse_layer`) when num_experts > 0, i is not in mlp_only_layers and
        (i + 1) % decoder_sparse_step == 0; a sparse layer routes each token to its
        num_experts_per_tok most probable experts (SwiGLU MLPs of width moe_intermediate_size),
        weighted by their softmax probabilities (renormalised to sum 1 when norm_topk_prob).
        router_aux_loss_coef: the weight HF gives the load-balancing loss (`moe.load_balancing_loss`).
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = (("rope_type", "default"),)
    rms_norm_eps: float = 1e-6
    attention_bias: bool | None = None
    qk_norm: bool | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.001

    def __post_init__(self):
        if self.family not in _MODEL_TYPES:
            raise ValueError(f"unsupported model family {self.family!r}; expected one of {sorted(_MODEL_TYPES)}")
        for name, value in (
            ("attention_bias", self.family == "qwen2"),
            ("qk_norm", self.family in ("qwen3", "qwen3_moe")),
        ):
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
            elif bool(getattr(self, name)) != value:
                raise ValueError(
                    f"{name}={getattr(self, name)} is not supported for family {self.family!r} "
                    f"(it is always {value} there)"
                )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        self._check_moe()
        rope_type = self.rope.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r}; expected one of {SUPPORTED_ROPE_TYPES}")

    def _check_moe(self) -> None:
        object.__setattr__(self, "mlp_only_layers", tuple(sorted(set(self.mlp_only_layers))))
        if self.family != "qwen3_moe":
            if self.num_experts:
                raise ValueError(f"num_experts={self.num_experts} needs family 'qwen3_moe', not {self.family!r}")
            return
        if self.num_experts < 0 or self.decoder_sparse_step < 1:
            raise ValueError(
                f"num_experts={self.num_experts} must be >= 0 and decoder_sparse_step={self.decoder_sparse_step} >= 1"
            )
        if self.num_experts and not (1 <= self.num_experts_per_tok <= self.num_experts):
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]"
            )
        if self.num_experts and self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size={self.moe_intermediate_size} must be >= 1")

    def is_sparse_layer(self, i: int) -> bool:
        """Whether layer i's MLP is a mixture of experts (HF Qwen3MoeDecoderLayer's rule)."""
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_sparse_layer(i))

    @property
    def rope(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def num_params(self, active: bool = False) -> int:
        """Parameter count; active=True counts only the num_experts_per_tok experts one token uses."""
        h, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        layer = attn + 2 * h
        if self.attention_bias:
            layer += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            layer += 2 * d
        experts = self.num_experts_per_tok if active else self.num_experts
        sparse = h * self.num_experts + experts * 3 * h * self.moe_intermediate_size
        mlps = sum(sparse if self.is_sparse_layer(i) else 3 * h * f for i in range(self.num_layers))
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + mlps + embed + h

    # ---------------------------------------------------------------- HF config.json

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type")
        family = None
        for arch in archs:
            if arch in SUPPORTED_ARCHITECTURES:
                family = SUPPORTED_ARCHITECTURES[arch]
        if family is None and model_type in _MODEL_TYPES and not archs:
            family = model_type
        if family is None:
            raise ValueError(
                f"{source}: unsupported architecture {archs or model_type!r}; "
                f"jaxspec supports {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in hf:
                raise ValueError(f"{source}: missing required key {key!r}")
        if hf.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window=true is not supported")
        if hf.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=true is not supported")
        if family != "qwen2" and hf.get("attention_bias"):
            raise ValueError(
                f"{source}: attention_bias=true is not supported for {family} (it adds biases to q/k/v and o_proj)"
            )
        num_heads = hf["num_attention_heads"]
        # Defaults of the transformers config classes for keys a config.json may omit.
        head_dim = hf.get("head_dim") or (128 if family in ("qwen3", "qwen3_moe") else hf["hidden_size"] // num_heads)
        default_max_positions = 2048 if family == "llama" else 32768
        rope = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling") or {}
        rope.update(legacy)
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope.pop("type", None)
        rope.setdefault("rope_type", "default")
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):
            eos = tuple(eos)
        return cls(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=hf.get("max_position_embeddings", default_max_positions),
            rope_theta=float(theta),
            rope_scaling=tuple(sorted((k, _freeze(v)) for k, v in rope.items())),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=hf.get("pad_token_id"),
            **(_moe_from_hf(hf, source) if family == "qwen3_moe" else {}),
        )

    def to_hf(self, torch_dtype: str = "float32") -> dict[str, Any]:
        rope = {k: _thaw(v) for k, v in self.rope_scaling}
        out: dict[str, Any] = {
            "architectures": [_MODEL_TYPES[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if rope.get("rope_type") == "default" else rope,
            "rope_parameters": {**rope, "rope_theta": self.rope_theta},
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": torch_dtype,
            "dtype": torch_dtype,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.family in ("llama", "qwen3"):
            out["attention_bias"] = False
        if self.family == "llama":
            out["mlp_bias"] = False
        if self.family == "qwen3_moe":
            out |= {
                "attention_bias": False,
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "decoder_sparse_step": self.decoder_sparse_step,
                "mlp_only_layers": list(self.mlp_only_layers),
                "norm_topk_prob": self.norm_topk_prob,
                "router_aux_loss_coef": self.router_aux_loss_coef,
                "output_router_logits": False,
            }
        if self.family in ("qwen2", "qwen3", "qwen3_moe"):
            out["use_sliding_window"] = False
            out["sliding_window"] = None
            out["max_window_layers"] = self.num_layers
        return out

    @classmethod
    def from_json(cls, path) -> ModelConfig:
        with open(path) as f:
            return cls.from_hf(json.load(f), source=str(path))


def _moe_from_hf(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """ModelConfig MoE fields of a Qwen3-MoE config.json (transformers 4.x writes num_experts, 5.x
    num_local_experts); defaults as in transformers' Qwen3MoeConfig."""
    num_experts = hf.get("num_experts", hf.get("num_local_experts", 128))
    if "num_experts" in hf and "num_local_experts" in hf and hf["num_experts"] != hf["num_local_experts"]:
        raise ValueError(
            f"{source}: num_experts={hf['num_experts']} contradicts num_local_experts={hf['num_local_experts']}"
        )
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=hf.get("num_experts_per_tok", 8),
        moe_intermediate_size=hf.get("moe_intermediate_size", 768),
        decoder_sparse_step=hf.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )


def _freeze(v):
    return tuple(v) if isinstance(v, list) else v


def _thaw(v):
    return list(v) if isinstance(v, tuple) else v
