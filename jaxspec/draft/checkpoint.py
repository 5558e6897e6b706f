"""EAGLE-3 heads in the public checkpoint layout (loadable by vLLM / SGLang, and from them).

A folder holds `config.json`:

    {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
     "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
     "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings",
     "vocab_size": V (the policy's), "draft_vocab_size": Vd,
     "eagle_config": {"eagle_aux_hidden_state_layer_ids": [...], "use_aux_hidden_state": true}}

and `model.safetensors` with `fc.weight` [H, 3H], `midlayer.{input_layernorm, hidden_norm,
post_attention_layernorm}.weight` [H], `midlayer.self_attn.{q,k,v}_proj.weight` [n*D, 2H],
`midlayer.self_attn.o_proj.weight` [H, Nq*D], `midlayer.mlp.{gate,up}_proj.weight` [F, H],
`midlayer.mlp.down_proj.weight` [H, F], `norm.weight` [H], `lm_head.weight` [Vd, H],
`d2t` int64 [Vd], `t2d` bool [V]. An `embed_tokens.weight` some public heads carry is ignored:
the policy's embedding is used.

Aux layer ids are written as 0-based layer *outputs* (jaxspec's and SGLang's reading of the
field). vLLM reads the same field as layer *inputs* (one higher); when the field is absent both
engines use (2, L/2, L-3) as inputs, which equals jaxspec's default (1, L/2-1, L-4) as outputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxspec.atomic import atomic_folder
from jaxspec.distributed import is_main, to_host
from jaxspec.draft.config import DraftConfig, check_compatible
from jaxspec.draft.model import DraftParams
from jaxspec.models.config import ModelConfig
from jaxspec.models.params import PAIR_AXIS

ARCHITECTURE = "LlamaForCausalLMEagle3"
_IGNORED = ("embed_tokens.weight", "model.embed_tokens.weight")


def _tensor_table(dcfg: DraftConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...], object, object]]:
    """HF tensor name -> (path into params, HF shape, HF -> ours, ours -> HF) for float tensors; a
    path ending in an int j is slice j of a paired leaf (gate_up, kv: `jaxspec.models.params.PAIRED`)."""
    h, f, d, nq, nk = dcfg.hidden_size, dcfg.intermediate_size, dcfg.head_dim, dcfg.num_heads, dcfg.num_kv_heads

    def same(w):
        return w

    def transpose(w):
        return w.T

    def proj(n):  # HF [n*D, 2H] <-> ours [2H, n, D]
        return (n * d, 2 * h), (lambda w: w.T.reshape(2 * h, n, d)), (lambda p: p.reshape(2 * h, n * d).T)

    table = {
        "fc.weight": (("fc",), (h, 3 * h), transpose, transpose),
        "norm.weight": (("norm",), (h,), same, same),
        "lm_head.weight": (("lm_head",), (dcfg.draft_vocab_size, h), transpose, transpose),
        "midlayer.input_layernorm.weight": (("midlayer", "input_norm"), (h,), same, same),
        "midlayer.hidden_norm.weight": (("midlayer", "hidden_norm"), (h,), same, same),
        "midlayer.post_attention_layernorm.weight": (("midlayer", "mlp_norm"), (h,), same, same),
        "midlayer.self_attn.o_proj.weight": (
            ("midlayer", "o"),
            (h, nq * d),
            lambda w: w.T.reshape(nq, d, h),
            lambda p: p.reshape(nq * d, h).T,
        ),
        "midlayer.mlp.gate_proj.weight": (("midlayer", "gate_up", 0), (f, h), transpose, transpose),
        "midlayer.mlp.up_proj.weight": (("midlayer", "gate_up", 1), (f, h), transpose, transpose),
        "midlayer.mlp.down_proj.weight": (("midlayer", "down"), (h, f), transpose, transpose),
    }
    for name, n, leaf in (("q", nq, ("q",)), ("k", nk, ("kv", 0)), ("v", nk, ("kv", 1))):
        shape, to_ours, to_hf = proj(n)
        table[f"midlayer.self_attn.{name}_proj.weight"] = (("midlayer", *leaf), shape, to_ours, to_hf)
    return table


def _hf_config(dcfg: DraftConfig, dtype_name: str) -> dict:
    rope = {k: list(v) if isinstance(v, tuple) else v for k, v in dcfg.rope_scaling}
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": dcfg.hidden_size,
        "target_hidden_size": dcfg.hidden_size,
        "intermediate_size": dcfg.intermediate_size,
        "num_attention_heads": dcfg.num_heads,
        "num_key_value_heads": dcfg.num_kv_heads,
        "head_dim": dcfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": dcfg.rms_norm_eps,
        "rope_theta": dcfg.rope_theta,
        "rope_scaling": None if rope.get("rope_type") == "default" else rope,
        "max_position_embeddings": dcfg.max_position_embeddings,
        "vocab_size": dcfg.vocab_size,
        "draft_vocab_size": dcfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype_name,
        # A head that names no layers keeps following its policy's defaults when reloaded.
        "eagle_config": {"use_aux_hidden_state": True}
        if dcfg.aux_layer_ids is None
        else {"eagle_aux_hidden_state_layer_ids": list(dcfg.aux_layer_ids), "use_aux_hidden_state": True},
    }


def _draft_config(hf: dict, source: str) -> DraftConfig:
    archs = hf.get("architectures") or []
    if ARCHITECTURE not in archs:
        raise ValueError(f"{source}: architectures {archs} is not an EAGLE-3 head (expected [{ARCHITECTURE!r}])")
    if hf.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{source}: num_hidden_layers={hf['num_hidden_layers']}; only 1-layer heads are supported")
    if hf.get("target_hidden_size") not in (None, hf.get("hidden_size")):
        raise ValueError(
            f"{source}: target_hidden_size={hf['target_hidden_size']} differs from hidden_size="
            f"{hf.get('hidden_size')}; heads whose fc maps another width are not supported"
        )
    # The layer itself is a Llama layer: reuse the policy config reader for defaults and rope.
    layer = ModelConfig.from_hf(
        {**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1}, source=source
    )
    eagle = hf.get("eagle_config") or {}
    aux = eagle.get("eagle_aux_hidden_state_layer_ids") or hf.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None:
        aux = tuple(aux)
    return DraftConfig(
        hidden_size=layer.hidden_size,
        intermediate_size=layer.intermediate_size,
        num_heads=layer.num_heads,
        num_kv_heads=layer.num_kv_heads,
        head_dim=layer.head_dim,
        vocab_size=layer.vocab_size,
        draft_vocab_size=int(hf.get("draft_vocab_size") or layer.vocab_size),
        aux_layer_ids=aux,
        rms_norm_eps=layer.rms_norm_eps,
        rope_theta=layer.rope_theta,
        rope_scaling=layer.rope_scaling,
        max_position_embeddings=layer.max_position_embeddings,
    )


def save_eagle3(dcfg: DraftConfig, dparams: DraftParams, path, dtype=None) -> None:
    """Writes the head to folder `path` in the public layout (see module doc).

    dtype: float dtype of the stored weights (default: the params'). The folder is written next
    to `path` and renamed into place, so a crash never leaves half a checkpoint.
    """
    path = Path(path)
    np_dtype = np.dtype(jnp.dtype(dparams["fc"].dtype if dtype is None else dtype))
    tensors = {}
    for name, (tree_path, _, _, to_hf) in _tensor_table(dcfg).items():
        leaf = dparams
        for key in tree_path:
            leaf = leaf[key] if isinstance(key, str) else jnp.take(leaf, key, axis=PAIR_AXIS)
        tensors[name] = np.ascontiguousarray(to_hf(to_host(leaf).astype(np_dtype)))
    tensors["d2t"] = to_host(dparams["d2t"]).astype(np.int64)
    tensors["t2d"] = to_host(dparams["t2d"]).astype(bool)
    _check_maps(dcfg, tensors["d2t"], tensors["t2d"], "params")
    if not is_main():  # multi-process: process 0 writes
        return
    with atomic_folder(path) as tmp:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(_hf_config(dcfg, jnp.dtype(np_dtype).name), indent=2))


def load_eagle3(path, dtype="float32", policy: ModelConfig | None = None) -> tuple[DraftConfig, DraftParams]:
    """Reads a public-layout EAGLE-3 folder. dtype: float dtype of the returned weights.

    policy: when given, the head is checked against it (`check_compatible`) and supplies the
    default aux layers (1, L/2 - 1, L - 4) for configs that name none. Without it such a head
    keeps `aux_layer_ids=None` and takes them from the policy it first drafts for (a
    `jaxspec.rollout.Spec`), as published EAGLE-3 loaders do. Raises FileNotFoundError for a
    missing folder or file, ValueError for a wrong architecture, a missing/unexpected tensor or a wrong shape
    (naming the tensor and both shapes), or inconsistent d2t/t2d maps.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"EAGLE-3 checkpoint folder not found: {path}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"config.json not found in {path}")
    dcfg = _draft_config(json.loads(config_file.read_text()), str(config_file))
    if policy is not None:
        check_compatible(policy, dcfg)
        dcfg = dcfg.for_layers_of(policy)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    host: dict[str, np.ndarray] = {}
    for file in files:
        with safe_open(file, "np") as f:
            host.update({name: f.get_tensor(name) for name in f.keys()})

    table = _tensor_table(dcfg)
    full_vocab = dcfg.draft_vocab_size == dcfg.vocab_size
    if full_vocab:  # heads over the whole vocabulary may omit the identity maps
        host.setdefault("d2t", np.zeros(dcfg.draft_vocab_size, np.int64))
        host.setdefault("t2d", np.ones(dcfg.vocab_size, bool))
    expected = set(table) | {"d2t", "t2d"}
    missing = sorted(expected - set(host))
    if missing:
        raise ValueError(f"{path}: missing tensors {missing}")
    unexpected = sorted(set(host) - expected - set(_IGNORED))
    if unexpected:
        raise ValueError(f"{path}: unexpected tensors {unexpected} for an EAGLE-3 head")
    shapes = {name: shape for name, (_, shape, _, _) in table.items()}
    shapes |= {"d2t": (dcfg.draft_vocab_size,), "t2d": (dcfg.vocab_size,)}
    for name, shape in shapes.items():
        if tuple(host[name].shape) != shape:
            raise ValueError(
                f"{path}: tensor {name} has shape {tuple(host[name].shape)}, expected {shape} from config.json"
            )
    _check_maps(dcfg, host["d2t"], host["t2d"], str(path))

    target = np.dtype(jnp.dtype(dtype))
    params: dict = {"midlayer": {}}
    pairs: dict[str, list] = {}  # paired midlayer leaf -> its two slices
    for name, (tree_path, _, to_ours, _) in table.items():
        leaf = np.ascontiguousarray(to_ours(host[name]).astype(target))
        if isinstance(tree_path[-1], int):
            pairs.setdefault(tree_path[-2], [None, None])[tree_path[-1]] = leaf
            continue
        node = params
        for key in tree_path[:-1]:
            node = node[key]
        node[tree_path[-1]] = jnp.asarray(leaf)
    for leaf, slices in pairs.items():
        params["midlayer"][leaf] = jnp.asarray(np.stack(slices, axis=PAIR_AXIS))
    params["d2t"] = jnp.asarray(host["d2t"].astype(np.int32))
    params["t2d"] = jnp.asarray(host["t2d"].astype(bool))
    return dcfg, params


def _check_maps(dcfg: DraftConfig, d2t: np.ndarray, t2d: np.ndarray, source: str) -> None:
    """d2t must map the draft ids onto distinct policy ids, exactly the ones t2d marks."""
    ids = np.arange(d2t.shape[0]) + d2t
    if ids.min(initial=0) < 0 or ids.max(initial=0) >= dcfg.vocab_size:
        raise ValueError(f"{source}: d2t maps draft ids outside the policy vocabulary [0, {dcfg.vocab_size})")
    marked = np.flatnonzero(t2d)
    if len(np.unique(ids)) != len(ids) or not np.array_equal(np.sort(ids), marked):
        raise ValueError(
            f"{source}: d2t and t2d disagree: d2t reaches {len(np.unique(ids))} distinct policy "
            f"ids, t2d marks {len(marked)}, and they must be the same set"
        )
