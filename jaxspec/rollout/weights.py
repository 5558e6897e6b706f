"""The weights as the rollout engines read them: each attention layer's q and kv as one leaf.

A decode or verification step multiplies a few tokens by every weight once, so the number of
GEMM kernels per layer shows in its time (a small policy's step is launch-bound). The trainer
keeps q [C, Nq, D] and kv [C, 2, Nk, D] apart (a tensor-parallel mesh may split the query heads
where it cannot split fewer KV heads, `jaxspec.models.params`); a rollout only reads them, so
`generate` fuses them, the policy's and its draft's (`rollout_spec`), once per call into qkv
[C, Nk, Nq / Nk + 2, D] (`fuse_qkv`): one GEMM per layer for q, k and v. The fused leaves are a
copy of those weights for the call's duration (for Qwen3-8B 1.8 GB in bfloat16 over all layers,
a tenth of the policy).
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxspec.models.params import Params, fuse_qkv
from jaxspec.rollout.speculative.spec import Spec


def rollout_weights(params: Params) -> Params:
    """`params` (a policy's, or an EAGLE-3 head's) with every attention layer's q and kv fused
    (`fuse_qkv`), computed in one program, each fused leaf laid out on its q's devices (a mesh
    splits [C, Nk, G + 2, D] over the axes that split q's embedding and heads). Every other leaf
    is the same array. Returned as they are: params with nothing to fuse (already fused, or none
    of its dicts holds both q and kv) and params whose mesh splits a layer's q and kv unlike (the
    query heads over an axis that leaves the KV heads whole: fusing would replicate q)."""
    attention = _attention_only(params)
    leaves, treedef = jax.tree.flatten(attention)
    if not leaves:
        return params
    shardings = _fused_shardings(attention)
    if shardings is None:
        return params
    targets = tuple(jax.tree.leaves(shardings))
    if not all(isinstance(t, NamedSharding) for t in targets):
        # on one device the fused leaves follow their inputs (left uncommitted where those are, so
        # that a call on a mesh may still move them, as it moves the other leaves)
        out_treedef, targets = None, None
    else:
        out_treedef = jax.tree.structure(shardings)
    fused = _fuser(treedef, out_treedef, targets)(leaves)
    return _merge(params, fused)


def rollout_spec(spec):
    """`spec` (a `jaxspec.rollout.Spec` or None) with its draft's weights, an EAGLE-3 head's or a
    draft model's, fused as `rollout_weights`; `spec` itself when it has none to fuse."""
    if not isinstance(spec, Spec) or not isinstance(spec.draft, tuple):
        return spec
    fused = rollout_weights(spec.draft[1])
    return spec if fused is spec.draft[1] else spec.with_draft((spec.draft[0], fused, *spec.draft[2:]))


def _attention_only(node):
    """`node`'s structure with only the q and kv leaves of its attention layers (None elsewhere):
    device arrays of matching shapes (a draft that does not fit is left for `generate`'s checks to
    name, and abstract params as they are)."""
    if isinstance(node, dict):
        if "q" in node and "kv" in node:
            return {"q": node["q"], "kv": node["kv"]} if _fusable(node["q"], node["kv"]) else None
        return {k: _attention_only(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_attention_only(v) for v in node)
    return None


def _fusable(q, kv) -> bool:
    """Whether q [C, Nq, D] and kv [C, 2, Nk, D] are arrays of one attention (Nk divides Nq)."""
    if not (isinstance(q, jax.Array) and isinstance(kv, jax.Array)) or (q.ndim, kv.ndim) != (3, 4):
        return False
    c, nq, d = q.shape
    return kv.shape[0] == c and kv.shape[1] == 2 and kv.shape[3] == d and nq % kv.shape[2] == 0


def _fused_shardings(attention):
    """The sharding of each fused leaf, in `fuse_qkv(attention)`'s structure; None when some
    layer's q and kv are split unlike."""
    if isinstance(attention, dict):
        if "q" in attention:
            sharding = _qkv_sharding(attention["q"], attention["kv"])
            return None if sharding is None else {"qkv": sharding}
        out = {k: _fused_shardings(v) for k, v in attention.items()}
        if any(v is None and attention[k] is not None for k, v in out.items()):
            return None
        return out
    if isinstance(attention, (list, tuple)):
        out = [_fused_shardings(v) for v in attention]
        if any(o is None and a is not None for o, a in zip(out, attention)):
            return None
        return type(attention)(out)
    return None


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
def _fuser(treedef, out_treedef, shardings: tuple):
    """One compiled program: the q/kv leaves (`treedef`'s order) -> the fused ones on `shardings`
    (None: where XLA places them)."""
    out_shardings = None if shardings is None else out_treedef.unflatten(shardings)
    return jax.jit(lambda leaves: fuse_qkv(treedef.unflatten(leaves)), out_shardings=out_shardings)


def _merge(params, fused):
    """`params` with the fused leaves of `fuse_qkv(_attention_only(params))` in place of q and kv."""
    if isinstance(params, dict):
        if "q" in params and "kv" in params:
            return {**{k: v for k, v in params.items() if k not in ("q", "kv")}, "qkv": fused["qkv"]}
        return {k: _merge(v, fused[k]) if fused[k] is not None else v for k, v in params.items()}
    if isinstance(params, (list, tuple)):
        return type(params)(_merge(p, f) if f is not None else p for p, f in zip(params, fused))
    return params
