"""Policy models: config, functional decoder, HF checkpoint I/O and sharding."""

from jaxspec.models.checkpoint import load_hf, load_tokenizer, save_hf
from jaxspec.models.config import ModelConfig
from jaxspec.models.kv_cache import KVCache, cache_bytes, init_cache
from jaxspec.models.moe import load_balancing_loss
from jaxspec.models.paged import PagedKVCache, init_paged_cache
from jaxspec.models.params import Params, init_params
from jaxspec.models.sharding import Sharding, make_mesh, param_shardings, shard_params
from jaxspec.models.transformer import extend, forward, forward_hidden, forward_router

__all__ = [
    "KVCache",
    "ModelConfig",
    "PagedKVCache",
    "Params",
    "Sharding",
    "cache_bytes",
    "extend",
    "forward",
    "forward_hidden",
    "forward_router",
    "init_cache",
    "init_paged_cache",
    "init_params",
    "load_balancing_loss",
    "load_hf",
    "load_tokenizer",
    "make_mesh",
    "param_shardings",
    "save_hf",
    "shard_params",
]
