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
("triton", "triton-interpret"). It applies on one device (a mesh splits the cache, which the
kernel's in-place write does not follow) to ungrouped pools and dense caches. The
JAXSPEC_ATTENTION_PROLOGUE environment variable chooses: "triton" runs the kernel wherever the
attention kernel runs; "auto" (the default) and "xla" keep XLA's pieces. "auto" becomes "triton"
once the kernel has passed its GPU check (`tests/gpu/check_attention_prologue.py`, rollouts through
`tests/gpu/check_spec.py`) and the decode and verification steps are timed both ways on a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.kernels.dispatch import requested_impl
from jaxspec.models import attention as attention_module
from jaxspec.models import paged
from jaxspec.models.attention import kernel_attention_rows, kernel_impl, triton_kernel
from jaxspec.models.blocks import rms_norm
from jaxspec.models.config import ModelConfig
from jaxspec.models.paged import page_of
from jaxspec.models.params import Params
from jaxspec.models.rope import apply_rope
from jaxspec.models.sharding import Sharding

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
    "triton-interpret") where JAXSPEC_ATTENTION_PROLOGUE is "triton", q, k and v are fused, on one
    device, with an ungrouped pool (or a dense cache), and the attention kernel runs the call
    (`kernel_impl`); else "xla". x [B, T, H] is the layer's (normed) input; k_pool / v_pool the layer's
    pools or dense cache."""
    if requested_impl("auto", IMPLS, IMPL_ENV, "attention prologue") != "triton" or "qkv" not in layer:
        return "xla"
    if (sharding is not None and sharding.mesh.size > 1) or k_pool.ndim != 4:
        return "xla"
    b, t = x.shape[:2]
    q = jax.ShapeDtypeStruct((b, t, cfg.num_heads, cfg.head_dim), layer["qkv"].dtype)
    env = paged.IMPL_ENV if paged_cache else attention_module.IMPL_ENV
    return kernel_impl("auto", env, "attention", q, k_pool, v_pool)


def layer_attention(
    cfg: ModelConfig,
    layer: Params,
    h: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    page_table: jax.Array,
    cache_len: jax.Array,
    tree_mask: jax.Array | None,
    active: jax.Array | None,
    *,
    impl: str,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's attention of `extend` through the prologue kernel: h [B, T, H] the layer's normed input,
    cos / sin [B, T, D] its rope tables, k_pool / v_pool [P, page_size, Nk, D] (a dense cache
    [B, S, Nk, D] with page_table [[0], [1], ...]) and page_table int32 [B, M], cache_len, tree_mask
    and active as `extend`'s; impl from `prologue_impl`. Returns (attention [B, T, Nq, D], the new
    k pool, the new v pool), what `write_and_attend` returns."""
    t = h.shape[1]
    group = layer["qkv"].shape[2] - 2
    proj = jnp.einsum("btc,cngd->btngd", h, layer["qkv"])  # [B, T, Nk, G + 2, D]
    norms = (layer["q_norm"], layer["k_norm"]) if cfg.qk_norm else (None, None)
    rows = triton_kernel().query_rows(t * group)
    interpret = impl == "triton-interpret"
    q_rows, k_pool, v_pool = _prologue().attention_prologue(
        proj,
        layer.get("qkv_bias"),
        *norms,
        cos,
        sin,
        cache_len,
        page_table,
        k_pool,
        v_pool,
        rows=rows,
        eps=cfg.rms_norm_eps,
        interpret=interpret,
    )
    attn = kernel_attention_rows(
        q_rows, k_pool, v_pool, page_table, cache_len, tree_mask, active, num_new=t, group=group, interpret=interpret
    )
    return attn, k_pool, v_pool


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
    q_rows = q.reshape(b, t, nk, group, d).transpose(0, 2, 1, 3, 4).reshape(b, nk, t * group, d)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - t * group), (0, 0)))
    positions = cache_len[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    page, offset = page_of(page_table, positions, k_pool.shape[1])
    k_pool = k_pool.at[page, offset].set(k.astype(k_pool.dtype), mode="drop")
    v_pool = v_pool.at[page, offset].set(v.astype(v_pool.dtype), mode="drop")
    return q_rows, k_pool, v_pool
