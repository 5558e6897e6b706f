"""The kernel part of tests/gpu/check_spec.py: `verify_triton` and `verify_stochastic_triton`
compiled against `verify_reference` on the same random trees and key (the tolerances and cases
are described there)."""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

MAX_FLIPPED = 0.002  # fraction of kernel-check rows whose decisions may differ through float rounding
LOGPROB_TOL = 2e-3


def random_tree(rng: np.random.Generator, nodes: int, chain: bool) -> np.ndarray:
    """parents int [nodes]: -1 at the root; a chain, or each node under a random earlier node."""
    if chain:
        return np.arange(-1, nodes - 1)
    return np.concatenate([[-1], [rng.integers(0, n) for n in range(1, nodes)]])


def kernel_case(
    nodes: int,
    chain: bool,
    vocab: int,
    temperature: float,
    batch: int,
    seed: int,
    interpret: bool = False,
    stochastic: bool = False,
    coupled: bool = False,
) -> dict:
    from jaxspec.kernels.tree_stochastic_triton import verify_stochastic_triton
    from jaxspec.kernels.tree_verify_reference import verify_reference
    from jaxspec.kernels.tree_verify_triton import verify_triton

    rng = np.random.default_rng(seed)
    logits = (5.0 * rng.standard_normal((batch, nodes, vocab))).astype(np.float32)
    parents = np.stack([random_tree(rng, nodes, chain) for _ in range(batch)]).astype(np.int32)
    # Drafts that are often right: each node's token is its parent's argmax for 60% of the nodes.
    tokens = rng.integers(0, vocab, (batch, nodes)).astype(np.int32)
    argmax_at_parent = np.argmax(np.take_along_axis(logits, np.maximum(parents, 0)[..., None], axis=1), axis=-1)
    tokens = np.where(rng.random((batch, nodes)) < 0.6, argmax_at_parent, tokens).astype(np.int32)
    num_nodes = rng.integers(max(1, nodes // 2), nodes + 1, batch).astype(np.int32)
    num_nodes[0] = nodes
    args = tuple(jnp.asarray(x) for x in (logits, parents, tokens, num_nodes))
    key = jax.random.split(jax.random.key(seed), (batch, nodes)) if coupled else jax.random.key(seed)
    if stochastic:  # q: a draft near the policy, whose argmax most drafted tokens are
        q = jax.nn.softmax(args[0] + 2.0 * jax.random.normal(jax.random.key(seed + 1), args[0].shape), axis=-1)
        ref = jax.device_get(verify_reference(*args, key, temperature=temperature, draft_probs=q))
        got = jax.device_get(
            verify_stochastic_triton(args[0], q, *args[1:], key, temperature=temperature, interpret=interpret)
        )
    else:
        ref = jax.device_get(verify_reference(*args, key, temperature=temperature))
        got = jax.device_get(verify_triton(*args, key, temperature=temperature, interpret=interpret))
    same = (ref.path == got.path).all(1) & (ref.num_accepted == got.num_accepted) & (ref.next_token == got.next_token)
    consistent = bool((got.num_accepted == (got.path[:, 1:] >= 0).sum(1)).all())
    logprob_err = float(np.abs(np.where(same[:, None], ref.logprobs - got.logprobs, 0.0)).max())
    flipped = float(1.0 - same.mean())
    tree = tree_label(chain, stochastic, coupled)
    return {
        "check": "kernel",
        "nodes": nodes,
        "tree": tree,
        "vocab": vocab,
        "temperature": temperature,
        "batch": batch,
        "flipped_rows": flipped,
        "consistent": consistent,
        "logprob_err": logprob_err,
        "mean_accepted_reference": float(ref.num_accepted.mean()),
        "mean_accepted_kernel": float(got.num_accepted.mean()),
        "ok": consistent and flipped <= MAX_FLIPPED and logprob_err <= LOGPROB_TOL,
    }


def tree_label(chain: bool, stochastic: bool = False, coupled: bool = False) -> str:
    """A kernel case's tree column: "chain" or "random", "/q" for stochastic drafts, "/c" for coupled draws."""
    return ("chain" if chain else "random") + ("/q" if stochastic else "/c" if coupled else "")


def kernel_cases(only: str = "") -> list[dict]:
    """The keyword arguments of every `kernel_case` the check runs, in order; only: those whose
    `tree_label` contains this (e.g. "/c": the coupled cases)."""
    cases = []
    for vocab in (512, 32768):
        for temperature in (0.0, 1.0):
            for nodes in range(2, 17):
                cases.append(dict(nodes=nodes, chain=True, vocab=vocab, temperature=temperature, seed=nodes))
            for nodes in (3, 5, 8, 16):
                cases.append(dict(nodes=nodes, chain=False, vocab=vocab, temperature=temperature, seed=100 + nodes))
    for vocab in (512, 151936):  # stochastic drafts (draft_probs), their own kernel
        for nodes in (2, 4, 16):
            cases.append(dict(nodes=nodes, chain=True, vocab=vocab, temperature=1.0, seed=200 + nodes, stochastic=True))
        for nodes in (5, 16):
            cases.append(
                dict(nodes=nodes, chain=False, vocab=vocab, temperature=0.7, seed=300 + nodes, stochastic=True)
            )
    for vocab in (512, 151936):  # coupled draws (one key per node): every node raced over all of p
        for nodes in (2, 4, 16):
            cases.append(dict(nodes=nodes, chain=True, vocab=vocab, temperature=1.0, seed=400 + nodes, coupled=True))
        for nodes in (5, 16):
            cases.append(dict(nodes=nodes, chain=False, vocab=vocab, temperature=1.0, seed=500 + nodes, coupled=True))
    return [c for c in cases if only in tree_label(c["chain"], c.get("stochastic", False), c.get("coupled", False))]


def kernel_checks(
    emit: Callable[[dict], None] = lambda row: None, end: float | None = None, only: str = ""
) -> list[dict]:
    """The row of every case of `kernel_cases(only)` (256 rows of trees each), each passed to `emit`
    as it finishes (a check cut short still shows what ran); end: a `time.monotonic()` after which
    no further case starts (None: run them all)."""
    rows = []
    for case in kernel_cases(only):
        if end is not None and time.monotonic() >= end:
            break
        rows.append(kernel_case(batch=256, **case))
        emit(rows[-1])
    return rows
