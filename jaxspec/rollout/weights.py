"""The weights as the rollout engines read them: each attention layer's q and kv as one leaf.

A decode or verification step multiplies a few tokens by every weight once, so the number of
GEMM kernels per layer shows in its time (a small policy's step is launch-bound). The trainer
keeps q [C, Nq, D] and kv [C, 2, Nk, D] apart (a tensor-parallel mesh may split the query heads
where it cannot split fewer KV heads, `jaxspec.models.params`); a rollout only reads them, so
`generate` fuses them, the policy's and its draft's (`rollout_spec`), once per call into qkv
[C, Nk, Nq / Nk + 2, D] (`fuse_qkv`, the biases into qkv_bias [Nk, Nq / Nk + 2, D]): one GEMM per
layer for q, k and v. The fused leaves are a copy of those weights for the call's duration (for
Qwen3-8B 1.8 GB in bfloat16 over all layers, a tenth of the policy).
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxspec.models.params import FUSED_QKV, Params, fuse_qkv
from jaxspec.rollout.speculative.spec import Spec


def rollout_weights(params: Params) -> Params:
    """`params` (a policy's, or an EAGLE-3 head's) with every attention layer's q and kv (and
    biases) fused (`fuse_qkv`), computed in one program, each fused leaf laid out on its q's
    devices (a mesh splits [C, Nk, G + 2, D] over the axes that split q's embedding and heads).
    Every other leaf is the same array. Returned as they are: params with nothing to fuse (already
    fused, abstract, or none of its dicts holds both q and kv of one attention) and params whose
    mesh splits a layer's q and kv unlike (the query heads over an axis that leaves the KV heads
    whole: fusing would replicate q)."""
    layers = [node for node in jax.tree.leaves(params, is_leaf=_is_attention) if _is_attention(node)]
    if not layers:
        return params
    shardings = tuple(_qkv_sharding(layer["q"], layer["kv"]) for layer in layers)
    if any(s is None for s in shardings):
        return params
    if not all(isinstance(s, NamedSharding) for s in shardings):
        # on one device the fused leaves follow their inputs (left uncommitted where those are, so
        # that a call on a mesh may still move them, as it moves the other leaves)
        shardings = None
    parts = [{k: layer[k] for k in FUSED_QKV if k in layer} for layer in layers]
    fused = iter(_fuser(shardings, tuple("q_bias" in part for part in parts))(parts))

    def replace(node):
        if not _is_attention(node):
            return node
        return {**{k: v for k, v in node.items() if k not in FUSED_QKV}, **next(fused)}

    return jax.tree.map(replace, params, is_leaf=_is_attention)


def rollout_spec(spec):
    """`spec` (a `jaxspec.rollout.Spec` or None) with its draft's weights, an EAGLE-3 head's or a
    draft model's, fused as `rollout_weights`; `spec` itself when it has none to fuse."""
    if not isinstance(spec, Spec) or not isinstance(spec.draft, tuple):
        return spec
    fused = rollout_weights(spec.draft[1])
    return spec if fused is spec.draft[1] else spec.with_draft((spec.draft[0], fused, *spec.draft[2:]))


def _is_attention(node) -> bool:
    """Whether `node` is an attention layer's dict whose q [C, Nq, D] and kv [C, 2, Nk, D] are device
    arrays of one attention (Nk divides Nq): a draft that does not fit is left for `generate`'s
    checks to name, and abstract params as they are."""
    if not (isinstance(node, dict) and "q" in node and "kv" in node):
        return False
    q, kv = node["q"], node["kv"]
    if not (isinstance(q, jax.Array) and isinstance(kv, jax.Array)) or (q.ndim, kv.ndim) != (3, 4):
        return False
    c, nq, d = q.shape
    return kv.shape[0] == c and kv.shape[1] == 2 and kv.shape[3] == d and nq % kv.shape[2] == 0


def _qkv_sharding(q: jax.Array, kv: jax.Array):
    """The layout of fused [C, Nk, G + 2, D] from q [C, Nq, D] and kv [C, 2, Nk, D]: q's own on one
    device; on a mesh q's spec (C, heads, D) as (C, heads, -, D) where kv is split alike, else None."""
    sharding = q.sharding
    if not isinstance(sharding, NamedSharding):
        return sharding
    embed, heads, dim = (*sharding.spec, None, None, None)[:3]
    if _normalized(kv.sharding.spec) != _normalized(PartitionSpec(embed, None, heads, dim)):
        return None
    return NamedSharding(sharding.mesh, PartitionSpec(embed, heads, None, dim))


def _normalized(spec: PartitionSpec) -> tuple:
    """A spec's entries with trailing None dropped and one-axis tuples as the axis name."""
    parts = [p[0] if isinstance(p, tuple) and len(p) == 1 else (p or None) for p in spec]
    while parts and parts[-1] is None:
        parts.pop()
    return tuple(parts)


@functools.cache
def _fuser(shardings: tuple | None, biased: tuple[bool, ...]):
    """One compiled program: a list of layers' {q, kv[, q_bias, k_bias, v_bias]} -> their fused
    {qkv[, qkv_bias]}, each qkv on shardings[i] and its bias on the same mesh axes (None: where XLA
    places them)."""
    out_shardings = None
    if shardings is not None:
        out_shardings = [
            {"qkv": s, **({"qkv_bias": NamedSharding(s.mesh, PartitionSpec(*s.spec[1:]))} if bias else {})}
            for s, bias in zip(shardings, biased, strict=True)
        ]
    return jax.jit(lambda parts: [fuse_qkv(part) for part in parts], out_shardings=out_shardings)
