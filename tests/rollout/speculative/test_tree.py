"""Draft trees: EAGLE-2 selection against a brute-force reference (raw and processed draft
distributions: temperature and top-p), sampled children's law, masks, n-gram lookup."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.rollout import Sampling, processed_logprobs
from jaxspec.rollout.speculative.drafter import Verified
from jaxspec.rollout.speculative.ngram import History, NgramDrafter
from jaxspec.rollout.speculative.tree import ancestor_mask, dynamic_tree, shifted_gumbel
from tests.kernels.trees import chi_square_pvalue

VOCAB = 7
TABLE = np.random.default_rng(0).normal(size=(VOCAB, VOCAB, VOCAB)).astype(np.float32)
TABLE[:, :, 4] = TABLE[:, :, 3]  # tied draft probabilities: the lower token id comes first
TABLE[2, 5, 6] = -np.inf  # a token the draft excludes


NUCLEUS = Sampling(temperature=0.7, top_p=0.8)  # rescales the scores and excludes tokens from drafting


def fake_logq(path, sampling: Sampling | None = None) -> np.ndarray:
    """Draft log-probs after a node path (root first): depends on the path's sum and last token;
    the log-softmax of TABLE's raw logits, or with `sampling` their processed log-probs."""
    if sampling is not None:
        return np.asarray(processed_logprobs(jnp.asarray(TABLE[sum(path) % VOCAB, path[-1]]), sampling), np.float64)
    x = TABLE[sum(path) % VOCAB, path[-1]].astype(np.float64)
    finite = np.isfinite(x)
    out = np.full(VOCAB, -np.inf)
    out[finite] = x[finite] - np.log(np.exp(x[finite]).sum())
    return out


def fake_pass(calls, tokens, parents, depth, mask, frontier):
    """The same function's raw logits in jnp, reading each node's path through the tree mask."""
    path_sum = jnp.sum(jnp.where(mask, tokens[:, None, :], 0), axis=-1) % VOCAB
    return calls + 1, jnp.asarray(TABLE)[path_sum, tokens][:, frontier]


def log_softmax(logits):
    return jax.nn.log_softmax(logits, axis=-1)


def unused(logits):
    raise AssertionError("a deterministic chain needs no processed log-probabilities")


def reference_tree(root: int, depth: int, width: int, budget: int, sampling: Sampling | None = None):
    """Brute-force EAGLE-2 greedy tree as lists (tokens, parents, depth) in level order, scored by
    `fake_logq` (processed by `sampling` when given)."""
    nodes = [((root,), 0.0, -1, 0)]  # (path, score, parent, depth)
    frontier = [0]
    for d in range(1, depth + 1):
        candidates = []
        for f in frontier:
            logq = fake_logq(nodes[f][0], sampling)
            for token in sorted(range(VOCAB), key=lambda v: (-logq[v], v))[:width]:
                candidates.append((nodes[f][1] + logq[token], f, token))
        order = sorted(range(len(candidates)), key=lambda c: (-candidates[c][0], c))[:width]
        frontier = []
        for c in order:
            score, f, token = candidates[c]
            frontier.append(len(nodes))
            nodes.append((nodes[f][0] + (token,), score, f, d))
    ranked = sorted(range(1, len(nodes)), key=lambda n: (-nodes[n][1], n))
    full = budget == depth * width  # nothing pruned: tokens the draft excludes (score -inf) stay too
    kept = [0] + sorted(n for n in ranked[:budget] if full or np.isfinite(nodes[n][1]))
    index = {n: i for i, n in enumerate(kept)}
    return ([nodes[n][0][-1] for n in kept], [index.get(nodes[n][2], -1) for n in kept], [nodes[n][3] for n in kept])


def processed(sampling: Sampling | None):
    """dynamic_tree's `process`: the rollout's processed log-probs, or a plain log-softmax."""
    return log_softmax if sampling is None else (lambda logits: processed_logprobs(logits, sampling))


@pytest.mark.parametrize("sampling", [None, NUCLEUS], ids=["log_softmax", "t0.7_top_p0.8"])
@pytest.mark.parametrize("depth, width, budget", [(3, 1, 3), (4, 1, 2), (3, 3, 5), (2, 4, 8)])
def test_greedy_dynamic_tree_matches_brute_force(depth, width, budget, sampling):
    """Under temperature and top-p the scores (cumulative processed log-probs) rank the nodes, and
    tokens top-p excludes are never drafted."""
    roots = jnp.arange(VOCAB, dtype=jnp.int32)
    process = unused if width == 1 else processed(sampling)  # a chain takes each level's argmax of the raw logits
    calls, tree = jax.jit(
        lambda r: dynamic_tree(
            fake_pass,
            0,
            r,
            jax.random.key(0),
            depth=depth,
            width=width,
            num_nodes=budget,
            stochastic=False,
            process=process,
        )
    )(roots)
    assert int(calls) == depth and tree.draft_probs is None
    assert tree.tokens.shape == (VOCAB, 1 + budget)
    for r in range(VOCAB):
        tokens, parents, depths = reference_tree(r, depth, width, budget, sampling)
        n = int(tree.num_nodes[r])
        assert n == len(tokens)
        assert np.asarray(tree.tokens[r, :n]).tolist() == tokens
        assert np.asarray(tree.parents[r, :n]).tolist() == parents
        assert np.asarray(tree.depth[r, :n]).tolist() == depths


@pytest.mark.parametrize("sampling", [None, NUCLEUS], ids=["log_softmax", "t0.7_top_p0.8"])
@pytest.mark.parametrize("depth, width, budget", [(3, 3, 6), (2, 3, 6)], ids=["pruned", "full"])
def test_stochastic_tree_is_a_valid_tree_with_draft_distributions(depth, width, budget, sampling):
    """q at every node with children is the processed draft distribution, and every drawn child
    has q > 0: under top-p never a token the nucleus excludes, also in a full tree (nothing
    pruned) whose nodes have fewer tokens with q > 0 than children to draw (the row keeps fewer)."""
    roots = jnp.tile(jnp.arange(VOCAB, dtype=jnp.int32), 6)
    _, tree = jax.jit(
        lambda r, k: dynamic_tree(
            fake_pass, 0, r, k, depth=depth, width=width, num_nodes=budget, stochastic=True, process=processed(sampling)
        )
    )(roots, jax.random.key(1))
    tokens, parents, depths, num, q = (
        np.asarray(x) for x in (tree.tokens, tree.parents, tree.depth, tree.num_nodes, tree.draft_probs)
    )
    assert np.all(num <= 1 + budget) and (sampling is not None or np.all(num == 1 + budget))
    distinct_shapes = set()
    for b in range(len(roots)):
        path = {0: (int(roots[b]),)}
        for n in range(1, num[b]):
            assert 0 <= parents[b, n] < n and depths[b, n] == depths[b, parents[b, n]] + 1
            path[n] = path[parents[b, n]] + (int(tokens[b, n]),)
            np.testing.assert_allclose(
                q[b, parents[b, n]], np.exp(fake_logq(path[parents[b, n]], sampling)), rtol=1e-5, atol=1e-7
            )
            assert q[b, parents[b, n], tokens[b, n]] > 0, "a drawn child must have draft probability > 0"
        valid = np.arange(len(parents[b])) < num[b]
        children = [tuple(tokens[b, valid & (parents[b] == n)]) for n in range(num[b])]
        assert all(len(set(c)) == len(c) for c in children), "siblings are drawn without replacement"
        distinct_shapes.add(tuple(parents[b]))
    assert budget == depth * width or len(distinct_shapes) > 1, "stochastic scores should give differently shaped trees"
    if sampling is not None:
        assert np.mean(q[:, 0] == 0) > 0.2, "top-p should exclude some of the root's tokens"
        assert budget < depth * width or np.any(num < 1 + budget), "some node should have fewer than 3 tokens"


@pytest.mark.parametrize("width", [1, 3], ids=["chain", "tree"])
def test_stochastic_first_draw_follows_the_processed_draft(width):
    """The root's first child (node 1, always kept) of ROWS trees with one root is drawn from the
    processed draft distribution at the root, chains included: chi-square against it."""
    rows, root = 20000, 2
    _, tree = jax.jit(
        lambda r, k: dynamic_tree(
            fake_pass, 0, r, k, depth=2, width=width, num_nodes=2 * width, stochastic=True, process=processed(NUCLEUS)
        )
    )(jnp.full((rows,), root, jnp.int32), jax.random.key(2))
    q = np.exp(fake_logq((root,), NUCLEUS))
    assert 2 <= np.count_nonzero(q) < VOCAB
    first = [(int(t),) for t in np.asarray(tree.tokens[:, 1])]
    assert chi_square_pvalue(first, {(y,): float(m) for y, m in enumerate(q) if m > 0}) > 1e-3


def test_shifted_gumbel_keeps_order_and_caps_at_parent():
    parent = jnp.array([0.0, -1.5, -jnp.inf])
    children = jnp.array([[2.0, 1.0, -0.5], [0.3, 0.2, -jnp.inf], [1.0, 0.0, -1.0]])
    out = np.asarray(shifted_gumbel(parent, children))
    np.testing.assert_allclose(out[:2, 0], [0.0, -1.5], atol=1e-6)
    assert np.all(np.diff(out[0]) < 0) and out[1, 2] == -np.inf and np.all(out[2] == -np.inf)
    # Definition: -log(exp(-parent) - exp(-max) + exp(-child)).
    want = -np.log(np.exp(-0.0) - np.exp(-2.0) + np.exp(-np.array([1.0, -0.5])))
    np.testing.assert_allclose(out[0, 1:], want, rtol=1e-5)


def test_ancestor_mask_matches_parent_walk():
    parents = np.array([[-1, 0, 0, 1, 3, 2], [-1, 0, 1, 2, 0, 4]])
    mask = np.asarray(ancestor_mask(jnp.asarray(parents), max_depth=4))
    for b, i, j in itertools.product(range(2), range(6), range(6)):
        node, chain = i, {i}
        while parents[b, node] >= 0:
            node = parents[b, node]
            chain.add(node)
        assert mask[b, i, j] == (j in chain)


def reference_ngram(history, sizes, depth, width, budget):
    """Python n-gram lookup: best (longest n, most recent) matches with distinct first tokens."""
    length = len(history)
    matches = []
    for n in sizes:
        for j in range(length - 2, n - 2, -1):
            if history[j - n + 1 : j + 1] == history[length - n :]:
                matches.append(j)
    branches, firsts = [], set()
    for j in matches:
        if history[j + 1] not in firsts and len(branches) < width:
            firsts.add(history[j + 1])
            branches.append(history[j + 1 : j + 1 + depth])
    tokens, parents = [history[-1]], [-1]
    for chain in branches:
        for d, token in enumerate(chain):
            if len(tokens) > budget:
                break
            parents.append(0 if d == 0 else len(tokens) - 1)
            tokens.append(token)
    return tokens, parents


@pytest.mark.parametrize("sizes, depth, width, budget", [((3, 2, 1), 3, 1, 3), ((2, 1), 2, 3, 5)])
def test_ngram_proposals_match_python_lookup(sizes, depth, width, budget):
    rng = np.random.default_rng(5)
    histories = [list(rng.integers(0, 4, size=n)) for n in (1, 2, 5, 9, 14, 20)]
    histories.append([1, 2, 3, 1, 2, 3, 1, 2])
    slots = 24
    tokens = np.zeros((len(histories), slots), np.int32)
    for b, h in enumerate(histories):
        tokens[b, : len(h)] = h
    lengths = jnp.asarray([len(h) for h in histories], jnp.int32)
    drafter = NgramDrafter(sizes=sizes, depth=depth, width=width, num_nodes=budget)
    roots = jnp.asarray([h[-1] for h in histories], jnp.int32)
    propose = jax.jit(lambda h, r: drafter.propose(None, h, r, r, r >= 0, None)[1])
    tree = propose(History(jnp.asarray(tokens), lengths), roots)
    for b, h in enumerate(histories):
        want_tokens, want_parents = reference_ngram([int(t) for t in h], sizes, depth, width, budget)
        n = int(tree.num_nodes[b])
        assert np.asarray(tree.tokens[b, :n]).tolist() == want_tokens
        assert np.asarray(tree.parents[b, :n]).tolist() == want_parents
    assert tree.tokens.shape == (len(histories), 1 + budget)


def test_ngram_history_appends_accepted_tokens_and_next_root():
    drafter = NgramDrafter(sizes=(1,), depth=2, width=1, num_nodes=2)
    history = History(jnp.asarray([[4, 5, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]], jnp.int32), jnp.asarray([2, 1]))
    verified = Verified(
        committed=jnp.asarray([[5, 2, 3], [1, 9, 9]], jnp.int32),
        next_root=jnp.asarray([6, 7]),
        num_accepted=jnp.asarray([2, 0]),
        cache_len=jnp.asarray([1, 0]),
        hidden=jnp.zeros((0, 2, 3, 4)),
        active=jnp.asarray([True, True]),
    )
    out = drafter.update(None, history, verified)
    assert np.asarray(out.tokens).tolist() == [[4, 5, 2, 3, 6, 0], [1, 7, 0, 0, 0, 0]]
    assert np.asarray(out.length).tolist() == [5, 2]
    frozen = drafter.update(None, history, verified._replace(active=jnp.asarray([False, False])))
    assert np.array_equal(frozen.tokens, history.tokens) and np.array_equal(frozen.length, history.length)
