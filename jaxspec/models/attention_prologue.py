"""A cached extension's attention input, cache write and attention with one kernel before the
attention kernel, where both run.

`extend` computes a layer's attention as the model reads (`jaxspec.models.blocks.qkv`: the
projections, biases, q/k norms and rope), writes the new keys and values into the cache and
attends; on a GPU, XLA runs everything between the projection and the attention kernel as
several small kernels per layer (the norms' reductions and scalings, rope, two KV scatters, the
query rows' transpose and pad). Where the layer's q, k and v are one weight (`qkv`, as every
rollout reads them: `jaxspec.rollout.weights`) and the attention kernel takes the call, that part
is one kernel (`jaxspec.kernels.attention_prologue_triton`) that writes the keys and values into
the cache in place and the attention kernel's query rows (`kernel_attention_rows`).

`prologue_impl` decides per call: "xla" (the model's pieces) or the attention kernel's own impl
("triton", "triton-interpret"). It applies to pools and dense caches, on a mesh too (each device
on its rows and KV heads, grouped pools as one pool of its pages, as the attention kernel runs
there). The
JAXSPEC_ATTENTION_PROLOGUE environment variable chooses: "triton" runs the kernel wherever the
attention kernel runs; "xla" keeps XLA's pieces; "auto" (the default) is "triton" off a mesh where
the Triton kernels run inside XLA's command buffers, else "xla" (on a mesh until the sharded kernel
has run in a multi-GPU check; `jaxspec.kernels.command_buffers.layer_kernel_default`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxspec.kernels import command_buffers
from jaxspec.kernels.dispatch import requested_impl
from jaxspec.models import attention as attention_module
from jaxspec.models import paged
from jaxspec.models.attention import (
    kernel_attention_rows,
    kernel_impl,
    query_rows_of,
    tree_mask_or_causal,
    triton_kernel,
)
from jaxspec.models.blocks import rms_norm
from jaxspec.models.config import ModelConfig
from jaxspec.models.paged import one_pool, page_of
from jaxspec.models.params import Params
from jaxspec.models.projection import project
from jaxspec.models.rope import apply_rope
from jaxspec.models.sharding import KV_CACHE_AXES, KV_PAGES_AXES, Sharding, on_devices

IMPLS = ("auto", "xla", "triton")
IMPL_ENV = "JAXSPEC_ATTENTION_PROLOGUE"


def prologue_impl(
    cfg: ModelConfig,
    layer: Params,
    x: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    paged_cache: bool,
    sharding: Sharding | None,
) -> str:
    """The impl of the prologue for this layer of a call: the attention kernel's ("triton",
    "triton-interpret") where JAXSPEC_ATTENTION_PROLOGUE picks the kernel (the module docstring), q,
    k and v are fused, the cache is a dense cache or pools (grouped ones on a mesh only), not split
    along its positions, and the attention kernel runs the call (`kernel_impl`); else "xla".
    x [B, T, H] is the layer's (normed) input; k_pool / v_pool the layer's pools or dense cache."""
    on_mesh = on_devices(sharding)
    impl = requested_impl("auto", IMPLS, IMPL_ENV, "attention prologue")
    if impl == "auto":
        impl = command_buffers.layer_kernel_default(on_mesh)
    if impl != "triton" or "qkv" not in layer:
        return "xla"
    if (not on_mesh and k_pool.ndim != 4) or (on_mesh and cache_spec(sharding, k_pool, paged_cache)[-3] is not None):
        return "xla"  # grouped pools off a mesh, or a mesh that splits the cache's positions
    b, t = x.shape[:2]
    q = jax.ShapeDtypeStruct((b, t, cfg.num_heads, cfg.head_dim), layer["qkv"].dtype)
    page = jax.ShapeDtypeStruct((1, *k_pool.shape[-3:]), k_pool.dtype)  # a page of the pools, for the checks
    env = paged.IMPL_ENV if paged_cache else attention_module.IMPL_ENV
    return kernel_impl("auto", env, "attention", q, page, page)


def cache_spec(sharding: Sharding, k_pool: jax.Array, paged_cache: bool) -> PartitionSpec:
    """The layout of a layer's cache on the mesh: pools [P, page_size, Nk, D] or grouped ones by
    `KV_PAGES_AXES`, a dense cache [B, S, Nk, D] by `KV_CACHE_AXES`."""
    return sharding.spec(KV_PAGES_AXES[5 - k_pool.ndim :] if paged_cache else KV_CACHE_AXES, k_pool.shape)


def layer_attention(
    cfg: ModelConfig,
    layer: Params,
    h: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    page_table: jax.Array | None,
    cache_len: jax.Array,
    tree_mask: jax.Array | None,
    active: jax.Array | None,
    *,
    impl: str,
    sharding: Sharding | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's attention of `extend` through the prologue kernel: h [B, T, H] the layer's normed
    input, cos / sin [B, T, D] its rope tables, k_pool / v_pool [P, page_size, Nk, D] and page_table
    int32 [B, M], or a dense cache [B, S, Nk, D] and page_table None (row b: page b); cache_len,
    tree_mask and active as `extend`'s; impl from `prologue_impl`. On a mesh each device runs the
    kernels on its rows and KV heads (`shard_map`, as the attention kernel runs there; grouped pools
    [G, P, ...] as one pool of its pages, `paged.one_pool`). Returns (attention [B, T, Nq, D], the new
    k pool, the new v pool), what `write_and_attend` returns."""
    b, t = h.shape[:2]
    group = layer["qkv"].shape[2] - 2
    proj = project("btc,cngd->btngd", h, layer["qkv"], impl="auto", sharding=sharding)  # [B, T, Nk, G + 2, D]
    if on_devices(sharding):  # every argument of the kernels' shard_map an array
        tree_mask = tree_mask_or_causal(b, t, tree_mask)
    active = jnp.ones((b,), bool) if active is None else active
    arrays = dict(proj=proj, cos=cos, sin=sin, cache_len=cache_len, k_pool=k_pool, v_pool=v_pool)
    arrays |= dict(tree_mask=tree_mask, active=active)
    weights = {"bias": layer.get("qkv_bias")} | (
        {"q_norm": layer["q_norm"], "k_norm": layer["k_norm"]} if cfg.qk_norm else {}
    )
    weights = {k: v for k, v in weights.items() if v is not None}
    settings = dict(
        rows=triton_kernel().query_rows(t * group), eps=cfg.rms_norm_eps, interpret=impl == "triton-interpret"
    )

    def attend(arrays, weights):
        k_pool, v_pool = arrays["k_pool"], arrays["v_pool"]
        if "page_table" in arrays:  # pools (grouped ones as one pool)
            k_pool, v_pool, table = one_pool(k_pool, v_pool, arrays["page_table"])
        else:  # a dense cache: row b is page b, its whole cache
            table = jnp.arange(k_pool.shape[0], dtype=jnp.int32)[:, None]
        q_rows, k_pool, v_pool = _prologue().attention_prologue(
            arrays["proj"],
            weights.get("bias"),
            weights.get("q_norm"),
            weights.get("k_norm"),
            arrays["cos"],
            arrays["sin"],
            arrays["cache_len"],
            table,
            k_pool,
            v_pool,
            **settings,
        )
        attn = kernel_attention_rows(
            q_rows,
            k_pool,
            v_pool,
            table,
            arrays["cache_len"],
            arrays["tree_mask"],
            arrays["active"],
            num_new=t,
            group=group,
            interpret=settings["interpret"],
        )
        shape = arrays["k_pool"].shape
        return attn, k_pool.reshape(shape), v_pool.reshape(shape)

    if page_table is not None:
        arrays["page_table"] = page_table
    if not on_devices(sharding):
        return attend(arrays, weights)
    pools = cache_spec(sharding, k_pool, page_table is not None)
    heads = pools[-2]
    # the rows split as the cache's leading axis (a dense cache's rows, grouped pools' groups); over
    # one pool every device writes every row's keys into its copy, so that the copies stay equal
    batch = pools[0] if page_table is None or k_pool.ndim == 5 else None
    P = PartitionSpec
    array_specs = dict(proj=P(batch, None, heads), cos=P(batch), sin=P(batch), cache_len=P(batch))
    array_specs |= dict(k_pool=pools, v_pool=pools, tree_mask=P(batch), active=P(batch))
    if page_table is not None:
        array_specs["page_table"] = P(batch)
    weight_specs = {k: P(heads) if k == "bias" else P() for k in weights}
    return jax.shard_map(
        attend,
        mesh=sharding.mesh,
        in_specs=(array_specs, weight_specs),
        out_specs=(P(batch, None, heads), pools, pools),
        check_vma=False,
    )(arrays, weights)


def _prologue():
    """`jaxspec.kernels.attention_prologue_triton`, imported on use (triton is an optional dependency)."""
    from jaxspec.kernels import attention_prologue_triton

    return attention_prologue_triton


def attention_prologue_reference(
    proj, bias, q_norm, k_norm, cos, sin, cache_len, page_table, k_pool, v_pool, *, rows: int, eps: float
):
    """`jaxspec.kernels.attention_prologue_triton.attention_prologue` in jnp, from the model's own
    pieces (`blocks.rms_norm`, `rope.apply_rope`, `paged.page_of`), the same arguments."""
    b, t, nk, width, d = proj.shape
    group = width - 2
    if bias is not None:
        proj = proj + bias
    q = proj[:, :, :, :group].reshape(b, t, nk * group, d)
    k, v = proj[:, :, :, group], proj[:, :, :, group + 1]
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    q_rows = query_rows_of(q, nk, rows)
    positions = cache_len[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    page, offset = page_of(page_table, positions, k_pool.shape[1])
    k_pool = k_pool.at[page, offset].set(k.astype(k_pool.dtype), mode="drop")
    v_pool = v_pool.at[page, offset].set(v.astype(v_pool.dtype), mode="drop")
    return q_rows, k_pool, v_pool
