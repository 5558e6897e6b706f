"""Tree verification from its definition in plain numpy (float64, one row at a time), sharing no
code with the kernels package: the deterministic quantities (normaliser, residual mass, greedy
outcome, log-probs) and the exact law of the emitted tokens for temperature > 0."""

from __future__ import annotations

import numpy as np


def node_children(parents, num_nodes: int) -> dict[int, list[int]]:
    """Valid children of every node of one row, in node (draft) order."""
    out: dict[int, list[int]] = {n: [] for n in range(num_nodes)}
    for n in range(1, num_nodes):
        out[int(parents[n])].append(n)
    return out


def log_softmax(x, temperature: float) -> np.ndarray:
    """float64 log p of one logit vector; temperature 0 reports the unscaled log-softmax."""
    x = np.asarray(x, np.float64) / (temperature or 1.0)
    top = np.max(x)
    with np.errstate(divide="ignore"):
        return x - top - np.log(np.sum(np.exp(x - top)))


def lse_and_residual(logits, parents, tokens, num_nodes, temperature: float):
    """(lse float64 [B, N]: logsumexp of logits / temperature (logits for greedy), residual float64
    [B, N]: p mass of the tokens that are not a valid child's token) for every node, padding too
    (padding nodes have no children)."""
    batch, n, _ = logits.shape
    lse, residual = np.zeros((batch, n)), np.ones((batch, n))
    for b in range(batch):
        kids = node_children(parents[b], num_nodes[b])
        for node in range(n):
            x = np.asarray(logits[b, node], np.float64) / (temperature or 1.0)
            top = np.max(x)
            lse[b, node] = top + np.log(np.sum(np.exp(x - top)))
            p = np.exp(x - lse[b, node])
            residual[b, node] = 1.0 - sum(p[t] for t in {int(tokens[b, c]) for c in kids.get(node, [])})
    return lse, residual


def greedy_verify(logits, parents, tokens, num_nodes):
    """(path [B, N], num_accepted [B], next_token [B], logprobs [B, N]) of greedy verification: from
    the root, move to the first child whose token is the node's argmax (first on ties); emit the
    argmax where no child has it. log-probs: log_softmax of the logits at each emitted token's parent."""
    batch, n, _ = logits.shape
    path, logprobs = np.full((batch, n), -1), np.zeros((batch, n))
    accepted, nxt = np.zeros(batch, int), np.zeros(batch, int)
    for b in range(batch):
        kids = node_children(parents[b], num_nodes[b])
        node, depth = 0, 0
        path[b, 0] = 0
        while True:
            best = int(np.argmax(logits[b, node]))
            logprobs[b, depth] = log_softmax(logits[b, node], 0.0)[best]
            child = next((c for c in kids[node] if tokens[b, c] == best), None)
            if child is None:
                break
            node, depth = child, depth + 1
            path[b, depth] = node
        accepted[b], nxt[b] = depth, best
    return path, accepted, nxt, logprobs


def emitted_law(logits, parents, tokens, num_nodes: int, temperature: float) -> dict[tuple[int, ...], float]:
    """Exact law of the emitted tokens (accepted drafts, then the next token) of one row with
    deterministic drafts: the policy samples from the root; a token that is a child's token moves
    to that child (the first one with it), any other token is emitted last."""
    kids = node_children(parents, num_nodes)
    out: dict[tuple[int, ...], float] = {}

    def visit(node: int, prefix: tuple[int, ...], mass: float):
        p = np.exp(log_softmax(logits[node], temperature))
        first = {}
        for c in kids[node]:
            first.setdefault(int(tokens[c]), c)
        for y in np.flatnonzero(p > 0):
            y = int(y)
            if y in first:
                visit(first[y], prefix + (y,), mass * p[y])
            else:
                out[prefix + (y,)] = mass * p[y]

    visit(0, (), 1.0)
    return out
