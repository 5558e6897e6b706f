"""Hybrid trees (`spec.suffix_branches`): the merged tree is exactly the deduplicated union of both
sources' kept nodes (a brute-force reference on random trees); greedy hybrid rollouts equal
autoregressive decoding (chains and trees, several budgets, staged and adaptive loops); with the
tiny asset policy and its trained EAGLE-3 head, suffix branches raise acceptance where the prompt's
earlier answers hold the answer and cost nothing measurable where they do not. (Sampling
exactness: the hybrid cases of test_lossless.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.assets import tiny_eagle3_path, tiny_policy_path
from jaxspec.draft import load_eagle3
from jaxspec.models.checkpoint import load_hf
from jaxspec.rollout import Sampling, Spec, generate, stages
from jaxspec.rollout.speculative.drafter import new_tokens
from jaxspec.rollout.speculative.hybrid import HEAD, HybridDrafter, accepted_depth, merge_trees
from jaxspec.rollout.speculative.suffix import SuffixHistory
from jaxspec.rollout.speculative.tree import DraftTree
from jaxspec.tasks import generate_problems
from jaxspec.tasks.tokenizer import ChatTokenizer

pytestmark = pytest.mark.slow

SIZE = 9  # nodes per random source tree, root included
DEPTH = 4


def random_tree(rng, root, vocab, num_nodes):
    """A DraftTree row as lists: nodes in level order, distinct sibling tokens, scores that never
    grow from parent to child (ties included), padded to SIZE like a packed tree."""
    tokens, parents, depth, scores = [root], [-1], [0], [0.0]
    while len(tokens) < num_nodes:
        parent = int(rng.integers(len(tokens)))
        used = {t for t, p in zip(tokens, parents) if p == parent}
        free = [t for t in range(vocab) if t not in used]
        if depth[parent] == DEPTH or not free:
            continue
        tokens.append(int(rng.choice(free)))
        parents.append(parent)
        depth.append(depth[parent] + 1)
        scores.append(scores[parent] - float(rng.choice([0.0, 0.5, 1.0])))
    order = sorted(range(len(tokens)), key=lambda n: depth[n])  # level order, parents first
    index = {n: i for i, n in enumerate(order)}
    pad = SIZE - len(tokens)
    return (
        [tokens[n] for n in order] + [0] * pad,
        [-1] + [index[parents[n]] for n in order[1:]] + [0] * pad,
        [depth[n] for n in order] + [0] * pad,
        [scores[n] for n in order] + [-np.inf] * pad,
        len(tokens),
    )


def stack(rows) -> DraftTree:
    tokens, parents, depth, scores, num = zip(*rows)
    return DraftTree(
        tokens=jnp.asarray(tokens, jnp.int32),
        parents=jnp.asarray(parents, jnp.int32),
        depth=jnp.asarray(depth, jnp.int32),
        num_nodes=jnp.asarray(num, jnp.int32),
        draft_probs=None,
        scores=jnp.asarray(scores, jnp.float32),
    )


def paths_in_order(row):
    """The token paths of a source tree's nodes, in the order the source keeps them (score
    descending, ties to the lower index), the root left out."""
    tokens, parents, _, scores, num = row
    path = {0: ()}
    for n in range(1, num):
        path[n] = path[parents[n]] + (tokens[n],)
    return [path[n] for n in sorted(range(1, num), key=lambda n: (-scores[n], n))]


def reference_union(suffix_row, head_row, share, budget):
    """The merged tree's path set by brute force: the suffix tree's first `share` nodes, then
    head nodes in order while fewer than `budget` distinct paths are kept."""
    kept = set(paths_in_order(suffix_row)[:share])
    for path in paths_in_order(head_row):
        if path not in kept and len(kept) < budget:
            kept.add(path)
    return kept


def merged_paths(tree, b):
    """The merged tree's node paths as a list (duplicates kept, to be caught)."""
    tokens, parents, num = (np.asarray(x)[b] for x in (tree.tokens, tree.parents, tree.num_nodes))
    path = {0: ()}
    for n in range(1, int(num)):
        assert 0 <= parents[n] < n
        path[n] = path[int(parents[n])] + (int(tokens[n]),)
    return list(path.values())[1:]


@pytest.mark.parametrize("budget", [3, 6, 12])
def test_merged_tree_is_the_deduplicated_union_of_both_sources(budget):
    """Random source trees over 3 tokens (so their paths overlap often) and every suffix share: the
    merged tree holds exactly the brute-force union, each path once; and the measured acceptance
    of each tree (`accepted_depth`) is the longest prefix of the emitted tokens that is its path."""
    rng = np.random.default_rng(budget)
    rows = 64
    suffix_rows, head_rows = [], []
    for _ in range(rows):
        root = int(rng.integers(3))
        suffix_rows.append(random_tree(rng, root, 3, int(rng.integers(1, SIZE + 1))))
        head_rows.append(random_tree(rng, root, 3, int(rng.integers(1, SIZE + 1))))
    share = rng.integers(0, budget + 1, rows)
    merge = jax.jit(merge_trees, static_argnums=3)
    tree = merge(stack(suffix_rows), stack(head_rows), jnp.asarray(share, jnp.int32), budget)
    overlaps = 0
    for b in range(rows):
        got = merged_paths(tree, b)
        want = reference_union(suffix_rows[b], head_rows[b], int(share[b]), budget)
        assert len(got) == len(set(got)), f"row {b}: a token path appears twice"
        assert set(got) == want, b
        assert int(tree.tokens[b, 0]) == suffix_rows[b][0][0]
        overlaps += len(set(paths_in_order(suffix_rows[b])[: share[b]]) & set(paths_in_order(head_rows[b])))
    assert overlaps >= rows // 4, "the sources' paths overlap: deduplication is exercised"

    emitted = rng.integers(0, 3, (rows, DEPTH + 1))
    length = rng.integers(1, DEPTH + 2, rows)
    source = stack(head_rows)
    got = accepted_depth(
        source.tokens, source.parents, source.num_nodes, jnp.asarray(emitted), jnp.asarray(length), DEPTH
    )
    for b in range(rows):
        paths = set(paths_in_order(head_rows[b]))
        want = max([d for d in range(1, int(length[b]) + 1) if tuple(emitted[b, :d]) in paths], default=0)
        assert int(got[b]) == want, b


MAX_NEW = 32


@pytest.fixture(scope="module")
def asset_run():
    """The tiny asset policy and its trained EAGLE-3 head over 4 arithmetic prompts, 2 rows each
    (a GRPO group per prompt); the greedy autoregressive rollout; run(spec_kwargs, history) -> a
    greedy hybrid rollout (or EAGLE-3 alone with suffix_branches False)."""
    path = tiny_policy_path()
    cfg, params = load_hf(path)
    head = load_eagle3(tiny_eagle3_path(), policy=cfg)
    tok = ChatTokenizer.from_file(path)
    prompts = [tok.encode_prompt(p["question"]) for p in generate_problems(4, seed=0, levels=[1]) for _ in range(2)]
    sampling = Sampling(temperature=0.0, max_new_tokens=MAX_NEW, eos_id=tok.eos_id)
    ar = generate(cfg, params, prompts, jax.random.key(0), sampling)

    def run(history=None, **settings):
        settings = {"num_draft_tokens": 3, "suffix_group_rows": 2, **settings}
        draft = (*head, history) if settings.get("suffix_branches") else head
        return generate(cfg, params, prompts, jax.random.key(1), sampling, spec=Spec("eagle3", draft, **settings))

    return ar, run


def answers(ar, order):
    """SuffixHistory holding, for group g, the greedy answer of group order[g] (H = 1)."""
    rows = 2 * np.asarray(order)
    return SuffixHistory(np.asarray(ar.tokens)[rows, None, :], np.asarray(ar.lengths)[rows, None])


GREEDY_CASES = {
    "chains": dict(tree_width=1),
    "chains-budget-3": dict(tree_width=1, tree_budget=3),
    "chains-budget-2-adaptive": dict(tree_width=1, tree_budget=2, adaptive=True, verify_token_cost=0.0),
    "trees-budget-5-staged": dict(tree_width=2, tree_budget=5),
}


@pytest.mark.parametrize("name", GREEDY_CASES)
def test_greedy_hybrid_rollouts_equal_autoregressive_decoding(asset_run, monkeypatch, name):
    """Earlier answers that hold the right answer for half the groups and another prompt's for the
    rest: both sources' paths are accepted, and the tokens and log-probs are autoregressive
    decoding's. The tree case runs staged (8 -> 4 -> 2 rows: the head's and suffix state move
    with their rows), the adaptive one switches depths."""
    ar, run = asset_run
    if name.endswith("staged"):
        monkeypatch.setattr(stages, "MIN_STAGE_ROWS", 2)
    out = run(answers(ar, [0, 1, 3, 2]), suffix_branches=True, **GREEDY_CASES[name])
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    np.testing.assert_array_equal(out.lengths, ar.lengths)
    np.testing.assert_allclose(out.logprobs, ar.logprobs, rtol=1e-5, atol=1e-5)
    assert 0 < out.stats["accepted_tokens"] < out.stats["drafted_tokens"], out.stats
    if name.endswith("staged"):
        assert out.stats["stage_rows"] == [8, 4, 2], out.stats


@pytest.fixture(scope="module")
def acceptance(asset_run):
    """Acceptance lengths (tokens per row and step) of greedy chains, k = 3, null budget: EAGLE-3
    alone and hybrid with histories that hold each group's answer ("knows"), another group's
    ("wrong"), and the first half of its answer followed by another group's ("half")."""
    ar, run = asset_run
    wrong = answers(ar, [1, 2, 3, 0])
    right = answers(ar, [0, 1, 2, 3])
    half = SuffixHistory(
        np.concatenate([right.tokens[:, :, : MAX_NEW // 2], wrong.tokens[:, :, MAX_NEW // 2 :]], axis=2),
        np.full_like(right.lengths, MAX_NEW),
    )
    out = {"eagle3": run()}
    for name, history in (("knows", right), ("wrong", wrong), ("half", half)):
        out[name] = run(history, suffix_branches=True)
        np.testing.assert_array_equal(out[name].tokens, ar.tokens)
    return {name: o.stats["acceptance_length"] for name, o in out.items()}


# Greedy rollouts are deterministic: the margins below are not sampling noise but how much the
# split may cost on these 8 rows (a step whose measured rates give the suffix branch nodes the
# head would have used; with a null budget the head keeps its whole chain unless the suffix share
# exceeds N - k = 3 nodes).
NO_WORSE = 0.05  # tokens per step
# The head's agreement is a lower bound (a step that emits fewer tokens than the head's chain
# holds cuts it short) over 20 distinct row-steps (2 rows per prompt agree): standard error ~0.25.
HEAD_SLACK = 0.6


def test_suffix_branches_that_know_the_answer_raise_acceptance(acceptance):
    assert acceptance["knows"] >= acceptance["eagle3"] + 0.5, acceptance
    assert acceptance["half"] >= acceptance["eagle3"] + 0.2, acceptance


def test_suffix_branches_that_do_not_know_cost_no_acceptance(acceptance):
    assert acceptance["wrong"] >= acceptance["eagle3"] - NO_WORSE, acceptance


def test_stochastic_drafts_with_suffix_branches_are_refused():
    with pytest.raises(ValueError, match=r"^Spec\.draft_sampling must be 'greedy' with suffix_branches"):
        Spec("eagle3", (None, None), suffix_branches=True, draft_sampling="stochastic")
    with pytest.raises(ValueError, match=r"^Spec\.suffix_branches .* needs method 'eagle3', got 'draft_model'"):
        Spec("draft_model", (None, None), suffix_branches=True)
    with pytest.raises(ValueError, match=r"^Spec\.draft\[2\] must be None or a SuffixHistory"):
        Spec("eagle3", (None, None, [1, 2]), suffix_branches=True)


def test_the_head_drafts_from_the_accepted_tokens_after_suffix_paths(asset_run, acceptance, monkeypatch):
    """Where the earlier answers hold the answer, most accepted paths are the suffix branch's; the
    head must still draft from the accepted tokens. Each step records how far the head's own chain
    agreed with the tokens the step emitted (accepted drafts, then the next root): 1 + that is a
    lower bound on what the head alone would have had accepted there, and it averages at least
    EAGLE-3 alone's acceptance length less HEAD_SLACK (a head that missed the suffix-accepted
    tokens drafts from stale entries and falls far below)."""
    ar, run = asset_run
    record = []
    update = HybridDrafter.update

    def spy(self, sources, state, verified):
        rows = state.rows
        agreed = accepted_depth(
            rows.tokens[:, HEAD],
            rows.parents[:, HEAD],
            rows.num_nodes[:, HEAD],
            new_tokens(verified),
            verified.num_accepted + 1,
            rows.tokens.shape[2] - 1,
        )
        jax.debug.callback(lambda a, n, m: record.append((a[m], n[m])), agreed, verified.num_accepted, verified.active)
        return update(self, sources, state, verified)

    monkeypatch.setattr(HybridDrafter, "update", spy)
    # suffix_candidates 15: a setting of its own, so that the loop is traced with the spy
    run(answers(ar, [0, 1, 2, 3]), suffix_branches=True, suffix_candidates=15)
    agreed, accepted = (np.concatenate(x) for x in zip(*record))
    assert np.mean(agreed < accepted) > 0.3, "many steps accept suffix paths the head did not draft"
    assert 1 + agreed.mean() >= acceptance["eagle3"] - HEAD_SLACK, (1 + agreed.mean(), acceptance)
