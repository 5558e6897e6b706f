"""Hugging Face checkpoint folders <-> jaxspec params.

A folder holds `config.json`, one `model.safetensors` or several shards with
`model.safetensors.index.json`, and optionally `tokenizer.json`. Tensors are read one at a time
and each is placed straight into its target sharding, so no host ever holds a full copy of the
model nor one copy per device.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxspec.atomic import atomic_folder
from jaxspec.distributed import is_main, to_host
from jaxspec.models.config import ModelConfig
from jaxspec.models.params import PAIR_AXIS, PAIRED, Params
from jaxspec.models.sharding import Sharding, param_axes

_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _np_dtype(dtype) -> np.dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
        return np.dtype(_DTYPES[dtype])
    return np.dtype(jnp.dtype(dtype))


def _dtype_name(dtype) -> str:
    dtype = np.dtype(dtype)
    for name, np_type in _DTYPES.items():
        if np.dtype(np_type) == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")


class _Converter:
    """One HF tensor <-> one jaxspec leaf: expected HF shape and the two layout transforms."""

    def __init__(self, hf_shape: tuple[int, ...], to_ours: Callable, to_hf: Callable):
        self.hf_shape, self.to_ours, self.to_hf = hf_shape, to_ours, to_hf


def _converters(cfg: ModelConfig) -> dict[str, tuple[tuple, _Converter]]:
    """Maps HF tensor name -> (path into params, converter); a path ending in an int j names slice j
    of a leaf stacked from several tensors (`_stacking`)."""
    h, f, d, nq, nk, v = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.head_dim,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.vocab_size,
    )
    ident = _Converter

    def proj(n):  # [n*D, H] <-> [H, n, D]
        return _Converter((n * d, h), lambda w: w.T.reshape(h, n, d), lambda p: p.reshape(h, n * d).T)

    def bias(n):
        return _Converter((n * d,), lambda w: w.reshape(n, d), lambda p: p.reshape(n * d))

    def linear(out_dim, in_dim):  # HF [out, in] <-> ours [in, out]
        return _Converter((out_dim, in_dim), lambda w: w.T, lambda p: p.T)

    table = {
        "model.embed_tokens.weight": (("embed",), ident((v, h), lambda w: w, lambda p: p)),
        "model.norm.weight": (("final_norm",), ident((h,), lambda w: w, lambda p: p)),
    }
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = (("lm_head",), linear(v, h))
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        layer = {
            "input_layernorm.weight": ("attn_norm", ident((h,), lambda w: w, lambda p: p)),
            "post_attention_layernorm.weight": ("mlp_norm", ident((h,), lambda w: w, lambda p: p)),
            "self_attn.q_proj.weight": ("q", proj(nq)),
            "self_attn.k_proj.weight": (("kv", 0), proj(nk)),
            "self_attn.v_proj.weight": (("kv", 1), proj(nk)),
            "self_attn.o_proj.weight": (
                "o",
                _Converter((h, nq * d), lambda w: w.T.reshape(nq, d, h), lambda p: p.reshape(nq * d, h).T),
            ),
            "mlp.gate_proj.weight": (("gate_up", 0), linear(f, h)),
            "mlp.up_proj.weight": (("gate_up", 1), linear(f, h)),
            "mlp.down_proj.weight": ("down", linear(h, f)),
        }
        if cfg.attention_bias:
            layer |= {
                "self_attn.q_proj.bias": ("q_bias", bias(nq)),
                "self_attn.k_proj.bias": ("k_bias", bias(nk)),
                "self_attn.v_proj.bias": ("v_bias", bias(nk)),
            }
        if cfg.qk_norm:
            layer |= {
                "self_attn.q_norm.weight": ("q_norm", ident((d,), lambda w: w, lambda p: p)),
                "self_attn.k_norm.weight": ("k_norm", ident((d,), lambda w: w, lambda p: p)),
            }
        if cfg.is_sparse_layer(i):
            for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
                del layer[name]
            layer["mlp.gate.weight"] = ("router", linear(cfg.num_experts, h))
        for name, (leaf, conv) in layer.items():
            table[pre + name] = (("layers", i, *(leaf if isinstance(leaf, tuple) else (leaf,))), conv)
        if cfg.is_sparse_layer(i):
            table.update(_expert_converters(cfg, i))
    return table


def _expert_converters(cfg: ModelConfig, i: int) -> dict[str, tuple[tuple, _Converter]]:
    """Layer i's per-expert HF tensors `mlp.experts.{j}.{gate,up,down}_proj.weight` <-> slice j of
    the stacked "experts_gate"/"experts_up" [E, H, I] and "experts_down" [E, I, H]."""
    h, fe = cfg.hidden_size, cfg.moe_intermediate_size
    table = {}
    for j in range(cfg.num_experts):
        pre = f"model.layers.{i}.mlp.experts.{j}."
        for proj, leaf, shape in (
            ("gate_proj", "experts_gate", (fe, h)),
            ("up_proj", "experts_up", (fe, h)),
            ("down_proj", "experts_down", (h, fe)),
        ):
            table[pre + proj + ".weight"] = (("layers", i, leaf, j), _Converter(shape, lambda w: w.T, lambda p: p.T))
    return table


def _stacking(cfg: ModelConfig, leaf: str) -> tuple[int, int]:
    """(slices, axis) of a leaf made of several HF tensors, slice j at index j of that axis: a
    paired leaf (`PAIRED`: "gate_up" of gate_proj and up_proj, "kv" of k_proj and v_proj), a sparse
    layer's stacked experts (one per expert)."""
    return (2, PAIR_AXIS) if leaf in PAIRED else (cfg.num_experts, 0)


# transformers 5.x models hold each sparse layer's experts fused: gate_up_proj [E, 2I, H] (gate rows
# first) and down_proj [E, H, I]. Folders that store them so are read as the per-expert tensors.
_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def _fused_sources(names, cfg: ModelConfig) -> dict[str, tuple[str, tuple]]:
    """Per-expert HF name -> (fused tensor name, index of its slice) for the fused expert tensors
    among `names`."""
    fe, out = cfg.moe_intermediate_size, {}
    for name in names:
        match = _FUSED.match(name)
        if match is None:
            continue
        layer, kind = match.groups()
        pre = f"model.layers.{layer}.mlp.experts."
        for j in range(cfg.num_experts):
            if kind == "down_proj":
                out[f"{pre}{j}.down_proj.weight"] = (name, (j,))
            else:
                out[f"{pre}{j}.gate_proj.weight"] = (name, (j, slice(0, fe)))
                out[f"{pre}{j}.up_proj.weight"] = (name, (j, slice(fe, 2 * fe)))
    return out


def _tensor_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: missing 'weight_map'")
        files = {name: path / fname for name, fname in weight_map.items()}
        for file in set(files.values()):
            if not file.exists():
                raise FileNotFoundError(f"{index} names {file.name}, which does not exist in {path}")
        return files
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    files = {}
    for shard in shards:
        with safe_open(shard, "np") as f:
            files.update({name: shard for name in f.keys()})
    return files


def load_hf(path, dtype="float32", sharding: Sharding | None = None) -> tuple[ModelConfig, Params]:
    """Loads an HF folder. dtype: "float32" | "bfloat16" | "float16" (or a numpy/jax dtype).

    With `sharding`, each param is built directly in its NamedSharding from the host copy of that
    one tensor (jax.make_array_from_callback); otherwise it lands on the default device.
    Mixture-of-experts layers: per-expert tensors (`mlp.experts.{j}.gate_proj.weight`, ..., as
    `save_hf` and transformers' save_pretrained write them) or the fused `mlp.experts.gate_up_proj` /
    `mlp.experts.down_proj` of transformers 5.x modules; a layer's experts, like the two tensors of a
    paired leaf (gate_proj and up_proj, k_proj and v_proj), are stacked on the host and placed once
    all of them are read.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {path}")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"config.json not found in {path}")
    cfg = ModelConfig.from_json(path / "config.json")
    target = _np_dtype(dtype)
    table = _converters(cfg)
    files = _tensor_files(path)
    fused = _fused_sources(files, cfg)
    available = (set(files) - {source for source, _ in fused.values()}) | set(fused)
    missing = sorted(set(table) - available)
    if missing:
        raise ValueError(f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    unexpected = sorted(
        n
        for n in available - set(table)
        if not _IGNORED.match(n) and not (cfg.tie_word_embeddings and n == "lm_head.weight")
    )
    if unexpected:
        raise ValueError(
            f"{path}: unexpected tensors {unexpected[:5]} for a {cfg.family} model with {cfg.num_layers} layers"
        )

    params: dict = {"layers": [{} for _ in range(cfg.num_layers)]}
    stacks: dict[tuple, list] = {}  # stacked leaf (`_stacking`) -> its host slices read so far
    by_file: dict[Path, list[str]] = {}
    for name in table:
        by_file.setdefault(files[fused[name][0] if name in fused else name], []).append(name)
    for file, names in by_file.items():
        with safe_open(file, "np") as f:
            for name in names:
                tree_path, conv = table[name]
                stored, expected = name, conv.hf_shape
                if name in fused:  # one expert's slice of a fused tensor
                    stored, index = fused[name]
                    out_dim = expected[0] * (2 if stored.endswith("gate_up_proj") else 1)
                    expected = (cfg.num_experts, out_dim, expected[1])
                shape = tuple(f.get_slice(stored).get_shape())
                if shape != expected:
                    raise ValueError(f"{file.name}: tensor {stored} has shape {shape}, expected {expected}")
                tensor = f.get_slice(stored)[index] if name in fused else f.get_tensor(name)
                host = np.ascontiguousarray(conv.to_ours(tensor).astype(target))
                if isinstance(tree_path[-1], int):  # slice j of a stacked leaf
                    count, axis = _stacking(cfg, tree_path[-2])
                    stack = stacks.setdefault(tree_path[:-1], [None] * count)
                    stack[tree_path[-1]] = host
                    if all(x is not None for x in stack):  # the leaf's slices are complete
                        _set(params, tree_path[:-1], _place(np.stack(stack, axis), tree_path[:-1], sharding))
                        del stacks[tree_path[:-1]]
                else:
                    _set(params, tree_path, _place(host, tree_path, sharding))
    return cfg, params


def _place(host: np.ndarray, tree_path: tuple, sharding: Sharding | None) -> jax.Array:
    if sharding is None:
        return jax.device_put(host)
    keys = tuple(jax.tree_util.SequenceKey(p) if isinstance(p, int) else jax.tree_util.DictKey(p) for p in tree_path)
    named = sharding.named(param_axes(keys), host.shape)
    return jax.make_array_from_callback(host.shape, named, lambda idx: host[idx])


def _set(tree: dict, path: tuple, value) -> None:
    node = tree
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _get(tree, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def save_hf(
    cfg: ModelConfig, params: Params, path, dtype=None, tokenizer_file=None, max_shard_bytes: int = 4 << 30
) -> None:
    """Writes an HF folder that `transformers.AutoModelForCausalLM.from_pretrained` loads.

    dtype defaults to the params' dtype. Shards above `max_shard_bytes` get an index json. The
    folder is written next to `path` and renamed into place, so a crash never leaves half a folder.
    In a multi-process job every process must call it (params are gathered); process 0 writes.
    """
    path = Path(path)
    np_dtype = _np_dtype(dtype) if dtype is not None else np.dtype(params["embed"].dtype)
    dtype_name = _dtype_name(np_dtype)
    hosts: dict[tuple, np.ndarray] = {}  # stacked leaves (`_stacking`), copied to the host once

    def host(tree_path):
        if isinstance(tree_path[-1], int):
            if tree_path[:-1] not in hosts:
                hosts[tree_path[:-1]] = to_host(_get(params, tree_path[:-1]))
            return np.take(hosts[tree_path[:-1]], tree_path[-1], axis=_stacking(cfg, tree_path[-2])[1])
        return to_host(_get(params, tree_path))

    tensors = {
        name: np.ascontiguousarray(conv.to_hf(host(tree_path).astype(np_dtype)))
        for name, (tree_path, conv) in _converters(cfg).items()
    }
    if not is_main():
        return
    with atomic_folder(path) as tmp:
        shards: list[dict[str, np.ndarray]] = [{}]
        size = 0
        for name, hf in tensors.items():
            if size + hf.nbytes > max_shard_bytes and shards[-1]:
                shards.append({})
                size = 0
            shards[-1][name] = hf
            size += hf.nbytes
        if len(shards) == 1:
            save_file(shards[0], tmp / "model.safetensors", metadata={"format": "pt"})
        else:
            weight_map, total = {}, 0
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, tmp / fname, metadata={"format": "pt"})
                weight_map.update({n: fname for n in shard})
                total += sum(a.nbytes for a in shard.values())
            with open(tmp / "model.safetensors.index.json", "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        with open(tmp / "config.json", "w") as f:
            json.dump(cfg.to_hf(dtype_name), f, indent=2)
        if tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")


def load_tokenizer(path):
    """HF `tokenizers.Tokenizer` from a folder's tokenizer.json (or the file itself)."""
    from tokenizers import Tokenizer

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.exists():
        raise FileNotFoundError(f"tokenizer.json not found: {file}")
    return Tokenizer.from_file(str(file))
