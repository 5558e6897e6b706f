"""Test policies defined on token prefixes, draft trees built from them, and the exact distributions
a lossless verifier must reproduce (float64 enumeration, independent of the kernels package)."""

from __future__ import annotations

import zlib

import jax.numpy as jnp
import numpy as np
from scipy import stats

from jaxspec.rollout import Sampling, processed_logprobs

CHAIN3 = (-1, 0, 1, 2)  # root -> 1 -> 2 -> 3
WIDE2_DEEP2 = (-1, 0, 0, 1, 1, 2, 2)  # root -> {1, 2}; 1 -> {3, 4}; 2 -> {5, 6}
SINGLE = (-1,)  # no drafts: plain sampling
IRREGULAR = (-1, 0, 1, 0, 1, 3, 2)  # root -> {1, 3}; 1 -> {2, 4}; 3 -> {5}; 2 -> {6}
WIDTH = 7  # every test tree is padded to this many nodes (one compiled shape)


class PrefixPolicy:
    """Deterministic logits float32 [V] for every token prefix (a pseudo-random function of it).

    top_p < 1 masks tokens with -inf through `processed_logprobs` (temperature 1), so callers pass
    temperature 1.0 to the verifier, as the rollout does with filtered distributions.
    """

    def __init__(self, vocab: int, seed: int, scale: float = 1.5, top_p: float = 1.0):
        self.vocab, self.seed, self.scale, self.top_p = vocab, seed, scale, top_p
        self._cache: dict[tuple[int, ...], np.ndarray] = {}

    def logits(self, prefix: tuple[int, ...]) -> np.ndarray:
        if prefix not in self._cache:
            rng = np.random.default_rng([self.seed, zlib.crc32(repr(prefix).encode())])
            raw = (self.scale * rng.standard_normal(self.vocab)).astype(np.float32)
            if self.top_p < 1:
                raw = np.asarray(processed_logprobs(jnp.asarray(raw), Sampling(top_p=self.top_p)))
            self._cache[prefix] = raw
        return self._cache[prefix]

    def probs(self, prefix: tuple[int, ...], temperature: float) -> np.ndarray:
        """float64 p at a prefix: softmax(logits / temperature); greedy reports temperature 1."""
        x = self.logits(prefix).astype(np.float64) / (temperature or 1.0)
        e = np.exp(x - x.max())
        return e / e.sum()


def children(parents) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {n: [] for n in range(len(parents))}
    for n, parent in enumerate(parents):
        if n:
            out[parent].append(n)
    return out


def prefixes(parents, tokens) -> list[tuple[int, ...]]:
    """Token path from the root to each node (the root's prefix is empty)."""
    out = [()]
    for n in range(1, len(parents)):
        out.append(out[parents[n]] + (int(tokens[n]),))
    return out


def padded(policy: PrefixPolicy, logits, parents, tokens, q, width: int):
    """Pads per-row node arrays [B, n, ...] to `width` nodes with decoys: each padding node claims the
    root as parent and proposes the root's most likely token, so accepting one would show."""
    batch, n = tokens.shape
    extra = width - n
    decoy_logits = np.stack([policy.logits((-1, i)) for i in range(extra)]) if extra else np.zeros((0, policy.vocab))

    def pad(x, fill):
        return np.concatenate([x, np.broadcast_to(fill, (batch, extra) + x.shape[2:])], axis=1)

    best = np.argmax(logits[:, 0], axis=-1)[:, None]
    arrays = (
        pad(logits, decoy_logits.astype(np.float32)),
        pad(parents, np.int32(0)),
        np.concatenate([tokens, np.broadcast_to(best, (batch, extra)).astype(np.int32)], axis=1),
        np.full((batch,), n, np.int32),
        None if q is None else pad(q, np.float32(1.0 / policy.vocab)),
    )
    return tuple(None if x is None else jnp.asarray(x) for x in arrays)


def tree_arrays(
    policy: PrefixPolicy, parents, tokens, batch: int, draft: PrefixPolicy | None = None, width: int = WIDTH
):
    """(logits [B, W, V], parents [B, W], tokens [B, W], num_nodes [B], q [B, W, V] or None) for
    `batch` copies of one tree padded to `width` nodes; q is the draft's softmax at each node."""
    paths = prefixes(parents, tokens)

    def tile(x):
        return np.broadcast_to(x, (batch,) + np.shape(x))

    logits = tile(np.stack([policy.logits(p) for p in paths]))
    q = None if draft is None else tile(np.stack([draft.probs(p, 1.0) for p in paths]).astype(np.float32))
    return padded(policy, logits, tile(np.asarray(parents, np.int32)), tile(np.asarray(tokens, np.int32)), q, width)


def emitted_sequences(result, tokens) -> list[tuple[int, ...]]:
    """Per row of a VerifyResult: accepted draft tokens, then next_token."""
    path, count, nxt = (np.asarray(x) for x in (result.path, result.num_accepted, result.next_token))
    tokens = np.asarray(tokens)
    return [
        tuple(int(tokens[b, path[b, i]]) for i in range(1, count[b] + 1)) + (int(nxt[b]),) for b in range(path.shape[0])
    ]


def tree_walk_distribution(
    policy: PrefixPolicy, parents, tokens, temperature: float, accept_scale: float = 1.0
) -> dict[tuple, float]:
    """Exact law of the emitted sequence for a fixed (deterministic) draft tree: the policy samples
    token by token from the root and stops after the first token that is not a child of the node it
    is at. Float64, from the definition.

    accept_scale != 1 gives instead the law of a biased verifier whose acceptance threshold is
    scaled by accept_scale: the k-th distinct child token of a node is taken with probability
    min(1, s * S_k) - min(1, s * S_{k-1}) (S_k: p mass of the first k), the residual tokens share
    what is left in proportion to p (used for power computations).
    """
    kids = children(parents)
    paths = prefixes(parents, tokens)
    out: dict[tuple, float] = {}

    def visit(node: int, mass: float):
        p = policy.probs(paths[node], temperature)
        by_token = {int(tokens[c]): c for c in reversed(kids[node])}  # a repeated token maps to its first child
        cumulative, taken = 0.0, 0.0  # p mass of the children so far; probability they are taken
        for y, child in sorted(by_token.items(), key=lambda item: item[1]):  # siblings in node order
            cumulative += p[y]
            running = cumulative if accept_scale == 1 else min(1.0, accept_scale * cumulative)
            if running > taken:
                visit(child, mass * (running - taken))
            taken = running
        residual = 1.0 - sum(p[y] for y in by_token)
        for y in range(policy.vocab):
            if p[y] > 0 and y not in by_token:
                out[paths[node] + (y,)] = mass * p[y] * (1.0 - taken) / residual

    visit(0, 1.0)
    return out


def sequence_distribution(policy: PrefixPolicy, length: int, temperature: float) -> dict[tuple, float]:
    """Exact law of `length` tokens sampled autoregressively from the policy."""
    out = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for prefix, mass in out.items():
            p = policy.probs(prefix, temperature)
            for y in np.flatnonzero(p):
                nxt[prefix + (int(y),)] = mass * p[y]
        out = nxt
    return out


def complete(policy: PrefixPolicy, seqs, length: int, temperature: float, rng: np.random.Generator):
    """Extends each sequence to `length` tokens by sampling the policy (numpy, grouped by prefix)."""
    seqs = list(seqs)
    for _ in range(length):
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(seqs):
            if len(s) < length:
                groups.setdefault(s, []).append(i)
        for prefix, rows in groups.items():
            draws = rng.choice(policy.vocab, size=len(rows), p=policy.probs(prefix, temperature))
            for i, y in zip(rows, draws):
                seqs[i] = prefix + (int(y),)
    return seqs


def top_tokens_tree(draft: PrefixPolicy, parents) -> np.ndarray:
    """Deterministic drafts: each node's children are the draft's most likely tokens, in order."""
    kids = children(parents)
    tokens = np.zeros(len(parents), np.int32)
    paths = [()]
    for n in range(len(parents)):
        if n:
            paths.append(paths[parents[n]] + (int(tokens[n]),))
        order = np.argsort(-draft.probs(paths[n], 1.0), kind="stable")
        for c, y in zip(kids[n], order):
            tokens[c] = y
    return tokens


def _path_nodes(parents) -> list[list[int]]:
    """Draft nodes on the way from the root to each node (the root's list is empty)."""
    out = [[]]
    for n in range(1, len(parents)):
        out.append(out[parents[n]] + [n])
    return out


def _grouped_prefixes(tokens: np.ndarray, nodes: list[int]):
    """Rows grouped by their token prefix tokens[:, nodes]: yields (prefix tuple, row indices)."""
    unique, inverse = np.unique(tokens[:, nodes].reshape(len(tokens), len(nodes)), axis=0, return_inverse=True)
    inverse = np.ravel(inverse)
    for i, prefix in enumerate(unique):
        yield tuple(int(t) for t in prefix), np.flatnonzero(inverse == i)


def sampled_trees(draft: PrefixPolicy, parents, batch: int, rng: np.random.Generator) -> np.ndarray:
    """Stochastic drafts: int32 [B, N]; each node's children drawn from the draft's softmax at its
    prefix without replacement (Gumbel-top-k), assigned to the children in node order."""
    kids = children(parents)
    tokens = np.zeros((batch, len(parents)), np.int32)
    for n, nodes in enumerate(_path_nodes(parents)):
        if not kids[n]:
            continue
        for prefix, rows in _grouped_prefixes(tokens, nodes):
            with np.errstate(divide="ignore"):
                keys = np.log(draft.probs(prefix, 1.0)) + rng.gumbel(size=(len(rows), draft.vocab))
            tokens[rows[:, None], np.asarray(kids[n])[None, :]] = np.argsort(-keys, axis=1)[:, : len(kids[n])]
    return tokens


def per_row_arrays(policy: PrefixPolicy, draft: PrefixPolicy, parents, tokens: np.ndarray, width: int = WIDTH):
    """(logits [B, W, V], parents [B, W], tokens [B, W], num_nodes [B], q [B, W, V]) for per-row
    token trees of one shape padded to `width`; q is the draft's softmax at each node (what its
    children were drawn from)."""
    batch, n = tokens.shape
    logits = np.empty((batch, n, policy.vocab), np.float32)
    q = np.empty((batch, n, policy.vocab), np.float32)
    for node, nodes in enumerate(_path_nodes(parents)):
        for prefix, rows in _grouped_prefixes(tokens, nodes):
            logits[rows, node] = policy.logits(prefix)
            q[rows, node] = draft.probs(prefix, 1.0)
    parents = np.broadcast_to(np.asarray(parents, np.int32), (batch, n))
    return padded(policy, logits, parents, tokens, q, width)


def chi_square_pvalue(seqs, probs: dict[tuple, float]) -> float:
    """Goodness of fit of sampled sequences to an exact law; bins expected below 5 are pooled.

    A sampled sequence outside the support fails immediately (p-value 0).
    """
    counts: dict[tuple, int] = {}
    for s in seqs:
        counts[s] = counts.get(s, 0) + 1
    if any(probs.get(s, 0.0) == 0 for s in counts):
        return 0.0
    support = sorted(probs)
    expected = np.array([probs[s] for s in support])
    expected = expected / expected.sum() * len(seqs)
    observed = np.array([counts.get(s, 0) for s in support], np.float64)
    small = expected < 5
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    return float(stats.chisquare(observed, expected).pvalue)


def chi_square_power(probs: dict[tuple, float], alternative: dict[tuple, float], samples: int, alpha: float) -> float:
    """Probability that `chi_square_pvalue` of `samples` draws from `alternative` is below alpha
    when testing against `probs` (same pooling of bins expected below 5): the noncentral
    chi-square approximation, noncentrality samples * sum((alt - p)^2 / p) over the bins, for the
    draws inside the support of `probs` (any draw outside it fails the test outright)."""
    outside = sum(m for s, m in alternative.items() if probs.get(s, 0.0) == 0)
    support = sorted(s for s, m in probs.items() if m > 0)
    expected = np.array([probs[s] for s in support])
    actual = np.array([alternative.get(s, 0.0) for s in support]) / (1.0 - outside)
    small = expected * samples < 5
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        actual = np.append(actual[~small], actual[small].sum())
    df = len(expected) - 1
    noncentrality = samples * np.sum((actual - expected) ** 2 / expected)
    inside = float(stats.ncx2.sf(stats.chi2.isf(alpha, df), df, noncentrality))
    return 1.0 - (1.0 - outside) ** samples * (1.0 - inside)


def random_parents_and_tokens(rng: np.random.Generator, batch: int, nodes: int, vocab: int):
    """(parents int32 [B, N], tokens int32 [B, N]): random trees, each node's parent drawn below it."""
    parents = np.full((batch, nodes), -1, np.int32)
    for n in range(1, nodes):
        parents[:, n] = rng.integers(0, n, size=batch)
    return parents, rng.integers(0, vocab, size=(batch, nodes)).astype(np.int32)
