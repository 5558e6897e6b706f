"""GPU kernels with pure-jnp references.

`tree_verify` is the exact (lossless) verification of a draft token tree against the policy's
processed distribution; it dispatches to the Triton kernels (called through jax-triton) or to the
jnp reference ("auto": the kernels on a GPU where jax-triton imports; override with `impl=` or the
JAXSPEC_TREE_VERIFY_IMPL environment variable); stochastic drafts run their own kernel
(`jaxspec.kernels.tree_stochastic_triton`) the same way. The kernel modules import triton, an
optional dependency, so they are imported on use.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kernels.dispatch import requested_impl
from jaxspec.kernels.tree_verify_reference import VerifyResult, key_layout, verify_reference

IMPLS = ("auto", "triton", "triton-interpret", "reference")
IMPL_ENV = "JAXSPEC_TREE_VERIFY_IMPL"
INSTALL = "pip install 'jaxspec[triton]'"
log = logging.getLogger(__name__)


def tree_verify(
    logits, parents, draft_tokens, num_nodes, key, *, temperature: float, draft_probs=None, impl: str = "auto"
) -> VerifyResult:
    """Accepts a prefix path of a draft tree and emits the next token, exactly as the policy samples.

    logits: float [B, N, V]: policy logits at every node; node 0 is the root (the last committed
        token), nodes 1..N-1 are draft tokens. Callers that filter (top-k/top-p) pass
        `jaxspec.rollout.processed_logprobs(logits, sampling)` with temperature 1.0; -inf entries
        have p = 0 and are never accepted or sampled.
    parents: int [B, N]: parent of each node, parents[:, 0] = -1, parents[b, n] < n. Siblings are
        verified in increasing node index (draft order).
    draft_tokens: int [B, N]: the token node n proposes after its parent's path (column 0 unused).
    num_nodes: int [B]: valid nodes per row; nodes >= num_nodes[b] are padding, never accepted.
    key: PRNG key, or one key per row (typed keys [B], raw keys [B, 2]: row b then draws what it
        would draw verified alone under its key, as the slot engine's per-row keys need), or one
        key per node (typed [B, N], raw [B, N, 2]; deterministic drafts only): coupled draws, where
        the token emitted at a node is the one a lone root under that node's key draws, whatever
        the tree (`jaxspec.kernels.tree_verify_reference`); all randomness comes from it.
    temperature: static float >= 0; p = softmax(logits / temperature); 0 = greedy (accept a child
        iff it is the argmax; log-probs reported from log_softmax(logits)).
    draft_probs: None for deterministic drafts (children fixed before any coin, distinct; q is a
        point mass), or float [B, N, V]: q at each node, the distribution its children were drawn
        from without replacement in node order.
    impl: "auto" (on a GPU the Triton kernels where jax-triton imports, else the reference with a
        one-time warning; the reference on other backends), "triton" (the kernels through jax-triton,
        GPU), "triton-interpret" (the kernels in Triton's interpreter on the host, any backend,
        slow; needs triton and torch) or "reference". With "auto" the JAXSPEC_TREE_VERIFY_IMPL
        environment variable, when set, picks one of the others.

    Returns a `VerifyResult` (path int32 [B, N], num_accepted int32 [B], next_token int32 [B],
    logprobs float32 [B, N]: log p at the parent of each emitted token, 0 after). Stochastic drafts
    (draft_probs given, temperature > 0) run their own kernel (`jaxspec.kernels.tree_stochastic_triton`)
    where the deterministic ones run `jaxspec.kernels.tree_verify_triton`. Every implementation draws the
    same samples from the same key (up to float rounding at decision boundaries). Value checks on
    the tree run only on concrete inputs (under `jax.jit` the shapes are still checked).
    """
    impl = resolved_impl(impl)
    temperature = _check_temperature(temperature)
    logits, parents, draft_tokens, num_nodes = _check_inputs(logits, parents, draft_tokens, num_nodes, draft_probs)
    if key_layout(key) == "node" and draft_probs is not None and temperature > 0:
        raise ValueError(
            "tree_verify with one key per node (coupled draws) needs deterministic drafts: "
            "draft_probs must be None (a sampled draft's tokens depend on its own noise)"
        )
    if impl == "reference":
        return verify_reference(
            logits, parents, draft_tokens, num_nodes, key, temperature=temperature, draft_probs=draft_probs
        )
    interpret = impl == "triton-interpret"
    if draft_probs is not None and temperature > 0:
        return _import_kernel("tree_stochastic_triton", impl).verify_stochastic_triton(
            logits, draft_probs, parents, draft_tokens, num_nodes, key, temperature=temperature, interpret=interpret
        )
    return _import_kernel("tree_verify_triton", impl).verify_triton(
        logits, parents, draft_tokens, num_nodes, key, temperature=temperature, interpret=interpret
    )


def resolved_impl(impl: str = "auto") -> str:
    """The implementation `tree_verify(..., impl=impl)` runs on this backend: "triton",
    "triton-interpret" or "reference" (for "auto": JAXSPEC_TREE_VERIFY_IMPL when set, else by backend)."""
    impl = requested_impl(impl, IMPLS, IMPL_ENV, "tree_verify")
    if impl != "auto":
        return impl
    if jax.default_backend() != "gpu":
        return "reference"
    if _jax_triton_imports():
        return "triton"
    _warn_no_jax_triton()
    return "reference"


@functools.cache
def _jax_triton_imports() -> bool:
    try:
        import jax_triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _warn_no_jax_triton() -> None:
    log.warning(
        "tree_verify: jax-triton does not import, so verification on this GPU runs the jnp reference "
        "instead of the Triton kernels (%s)",
        INSTALL,
    )


def _import_kernel(module: str, impl: str):
    """`jaxspec.kernels.<module>`, imported on first use (triton is an optional dependency)."""
    try:
        return importlib.import_module(f"jaxspec.kernels.{module}")
    except ImportError as e:
        raise ImportError(f"tree_verify impl {impl!r} needs the triton package ({e}; {INSTALL})") from e


def _check_temperature(temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.floating, np.integer)):
        raise ValueError(f"tree_verify temperature must be a Python number (static), got {temperature!r}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"tree_verify temperature must be finite and >= 0, got {temperature!r}")
    return float(temperature)


def _check_inputs(logits, parents, draft_tokens, num_nodes, draft_probs):
    if jnp.ndim(logits) != 3 or not jnp.issubdtype(jnp.result_type(logits), jnp.floating):
        raise ValueError(
            f"tree_verify logits must be a float array [B, N, V], got {jnp.result_type(logits)} {jnp.shape(logits)}"
        )
    batch, n, vocab = jnp.shape(logits)
    if n < 1 or vocab < 1:
        raise ValueError(f"tree_verify logits [B, N, V] needs N >= 1 and V >= 1, got {jnp.shape(logits)}")
    for name, value, shape in (
        ("parents", parents, (batch, n)),
        ("draft_tokens", draft_tokens, (batch, n)),
        ("num_nodes", num_nodes, (batch,)),
    ):
        if tuple(jnp.shape(value)) != shape:
            raise ValueError(
                f"tree_verify {name} must have shape {shape} (from logits [B, N, V] = "
                f"{tuple(jnp.shape(logits))}), got {tuple(jnp.shape(value))}"
            )
        if not jnp.issubdtype(jnp.result_type(value), jnp.integer):
            raise ValueError(f"tree_verify {name} must be an integer array, got {jnp.result_type(value)}")
    if draft_probs is not None and tuple(jnp.shape(draft_probs)) != tuple(jnp.shape(logits)):
        raise ValueError(
            f"tree_verify draft_probs must have the shape of logits {tuple(jnp.shape(logits))}, "
            f"got {tuple(jnp.shape(draft_probs))}"
        )
    parents, draft_tokens, num_nodes = (jnp.asarray(x, jnp.int32) for x in (parents, draft_tokens, num_nodes))
    _check_tree_values(parents, draft_tokens, num_nodes, vocab)
    return logits, parents, draft_tokens, num_nodes


def _check_tree_values(parents, draft_tokens, num_nodes, vocab: int) -> None:
    try:
        parents, draft_tokens, num_nodes = (np.asarray(x) for x in (parents, draft_tokens, num_nodes))
    except jax.errors.TracerArrayConversionError:
        return  # traced under jit: values unknown here
    n = parents.shape[1]
    bad = np.flatnonzero((num_nodes < 1) | (num_nodes > n))
    if bad.size:
        raise ValueError(f"tree_verify num_nodes must be in [1, {n}], row {bad[0]} has {num_nodes[bad[0]]}")
    bad = np.flatnonzero(parents[:, 0] != -1)
    if bad.size:
        raise ValueError(
            f"tree_verify parents[:, 0] must be -1 (node 0 is the root), row {bad[0]} has {parents[bad[0], 0]}"
        )
    idx = np.arange(n)
    child = (idx[None, :] > 0) & (idx[None, :] < num_nodes[:, None])
    rows, nodes = np.nonzero(child & ((parents < 0) | (parents >= idx[None, :])))
    if rows.size:
        raise ValueError(
            f"tree_verify parents is not a valid tree: parents[{rows[0]}, {nodes[0]}] = "
            f"{parents[rows[0], nodes[0]]} must be in [0, {nodes[0]})"
        )
    rows, nodes = np.nonzero(child & ((draft_tokens < 0) | (draft_tokens >= vocab)))
    if rows.size:
        raise ValueError(
            f"tree_verify draft_tokens[{rows[0]}, {nodes[0]}] = {draft_tokens[rows[0], nodes[0]]} "
            f"is outside the vocabulary [0, {vocab})"
        )


__all__ = ["IMPLS", "VerifyResult", "resolved_impl", "tree_verify"]
