"""The group-suffix drafter proposes exactly the continuations its sources hold: its trees equal a
brute-force Python reference (every position of every source scanned, a dict trie) on random token
streams, with ties (3-token vocabulary) and rows that match nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.rollout import Sampling, Spec, generate, stages
from jaxspec.rollout.speculative.drafter import Pooled
from jaxspec.rollout.speculative.suffix import (
    SuffixDrafter,
    SuffixHistory,
    SuffixPool,
    SuffixSources,
    first_longest,
    group_rows,
    suffix_sources,
)

SLOTS = 24  # pool slots per row
HIST_LEN = 10


def reference_paths(pool, row, siblings, history, *, max_match, num_candidates, depth, width, num_nodes):
    """The set of drafted root-to-node token paths for `row`, by brute force."""
    tokens, length, prompt_length = pool
    own = list(tokens[row][: length[row]])
    n = len(own)
    sources = [(own, 0)]
    sources += [(list(tokens[s][: length[s]]), prompt_length[s] - 1) for s in siblings if s >= 0]
    sources += [(list(h[:hl]), 0) for h, hl in zip(*history)]
    matches = []  # (match length, continuation), in source order
    for stream, lo in sources:
        for j in range(lo, len(stream) - 1):
            m = 0
            while m < max_match and j - m >= 0 and n - 1 - m >= 0 and stream[j - m] == own[n - 1 - m]:
                m += 1
            if m:
                matches.append((m, tuple(stream[j + 1 : j + 1 + depth])))
    if not matches:
        return set()
    longest = max(m for m, _ in matches)
    conts = [c for m, c in matches if m == longest][:num_candidates]
    count, first = {}, {}
    for i, c in enumerate(conts):
        for d in range(1, len(c) + 1):
            count[c[:d]] = count.get(c[:d], 0) + 1
            first.setdefault(c[:d], i)
    eligible = []

    def expand(path):
        children = sorted(
            (p for p in count if len(p) == len(path) + 1 and p[:-1] == path), key=lambda p: (-count[p], first[p])
        )
        for child in children[:width]:
            eligible.append(child)
            expand(child)

    expand(())
    eligible.sort(key=lambda p: (-count[p], len(p), first[p]))
    return set(eligible[:num_nodes])


def tree_paths(tree, b):
    tokens, parents, num = (np.asarray(x)[b] for x in (tree.tokens, tree.parents, tree.num_nodes))
    paths = {0: ()}
    for node in range(1, int(num)):
        assert 0 <= parents[node] < node
        paths[node] = paths[int(parents[node])] + (int(tokens[node]),)
    return set(list(paths.values())[1:])


def random_call(rng, vocab, num_rows, group_size, num_hist):
    row_prompt = np.repeat(np.arange(num_rows // group_size), group_size)
    prompt_length = np.repeat(rng.integers(1, 6, num_rows // group_size), group_size)
    length = prompt_length + rng.integers(1, SLOTS - 6, num_rows)
    tokens = rng.integers(0, vocab, (num_rows, SLOTS))
    for r in range(num_rows):  # the rows of one prompt share it
        tokens[r, : prompt_length[r]] = tokens[row_prompt[r] * group_size, : prompt_length[r]]
        tokens[r, length[r] :] = 0
    groups = num_rows // group_size
    history = SuffixHistory(
        rng.integers(0, vocab, (groups, num_hist, HIST_LEN)), rng.integers(0, HIST_LEN + 1, (groups, num_hist))
    )
    return row_prompt, (tokens, length, prompt_length), history


@pytest.mark.parametrize(
    "vocab, width, num_nodes, max_match, num_candidates",
    [(3, 1, 4, 3, 6), (3, 3, 7, 4, 8), (4, 2, 5, 8, 16), (50, 2, 6, 3, 4)],
    ids=["chain-ties", "tree-ties", "tree-long-match", "sparse-no-match"],
)
def test_suffix_drafts_equal_the_brute_force_reference(vocab, width, num_nodes, max_match, num_candidates):
    rng = np.random.default_rng(vocab * 100 + width)
    depth = 4
    drafter = SuffixDrafter(
        max_match=max_match, num_candidates=num_candidates, depth=depth, width=width, num_nodes=num_nodes
    )
    propose = jax.jit(drafter.propose)
    outcomes = {"empty": 0, "drafted": 0}
    for trial in range(6):
        row_prompt, pool, history = random_call(rng, vocab, num_rows=8, group_size=4, num_hist=2)
        sources = suffix_sources(history, row_prompt, 4, vocab)
        # The loop's rows after a stage move: a subset of the call's rows, in another order.
        rows = rng.permutation(8)[:6].astype(np.int32)
        state = Pooled(rows=jnp.asarray(rows), pool=SuffixPool(*map(jnp.asarray, pool)))
        root = jnp.asarray(pool[0][rows, pool[1][rows] - 1])
        _, tree = propose(sources, state, root, None, None, None)
        for b, row in enumerate(rows):
            want = reference_paths(
                pool,
                row,
                np.asarray(sources.siblings)[row],
                (history.tokens[row // 4], history.lengths[row // 4]),
                max_match=max_match,
                num_candidates=num_candidates,
                depth=depth,
                width=width,
                num_nodes=num_nodes,
            )
            assert tree_paths(tree, b) == want, (trial, row)
            assert int(tree.tokens[b, 0]) == int(root[b])
            outcomes["empty" if not want else "drafted"] += 1
    assert outcomes["drafted"] > 0
    if vocab == 50:
        assert outcomes["empty"] > 0, "rows that match nothing draft nothing"


def test_group_rows_splits_the_rows_of_a_prompt_into_groups():
    row_group, siblings, num = group_rows(np.array([0, 0, 1, 0, 1, 0]), 2)
    assert num == 3 and row_group.tolist() == [0, 0, 1, 2, 1, 2]
    assert siblings.tolist() == [[1], [0], [4], [5], [2], [3]]
    row_group, siblings, num = group_rows(np.array([0, 1, 0]), None)
    assert num == 2 and row_group.tolist() == [0, 1, 0] and siblings.tolist() == [[2], [-1], [0]]


def test_bad_history_is_refused_by_name():
    good = SuffixHistory(np.zeros((2, 1, 4), np.int32), np.full((2, 1), 4, np.int32))
    row_prompt = np.array([0, 0, 1, 1])
    assert isinstance(suffix_sources(good, row_prompt, None, 10), SuffixSources)
    with pytest.raises(ValueError, match="holds 1 groups, the call has 2"):
        suffix_sources(SuffixHistory(good.tokens[:1], good.lengths[:1]), row_prompt, None, 10)
    tokens = good.tokens.copy()
    tokens[1, 0, 2] = 12
    with pytest.raises(ValueError, match=r"tokens\[1, 0, 2\] = 12 is outside the vocabulary"):
        suffix_sources(SuffixHistory(tokens, good.lengths), row_prompt, None, 10)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 4\]"):
        suffix_sources(SuffixHistory(good.tokens, good.lengths + 1), row_prompt, None, 10)
    with pytest.raises(ValueError, match="must be None or a SuffixHistory"):
        Spec("suffix", (1, 2))
    with pytest.raises(ValueError, match="must be 'greedy' for method='suffix'"):
        Spec("suffix", draft_sampling="stochastic")


def test_earlier_responses_to_the_prompt_are_drafted_and_the_rollout_stays_exact(policy):
    """With each group's history holding the policy's greedy answer to its prompt, greedy suffix
    drafts are (nearly) all accepted, and the rollout equals autoregressive decoding token for
    token; a history of the other group's answers is refused by verification, not copied."""
    cfg, params = policy
    prompts = [[5, 9, 11, 4], [5, 9, 11, 4], [2, 40, 33, 17, 8], [2, 40, 33, 17, 8]]
    sampling = Sampling(temperature=0.0, max_new_tokens=20)
    ar = generate(cfg, params, prompts, jax.random.key(0), sampling)
    answers = np.asarray(ar.tokens)[[0, 2]][:, None, :]  # [2 groups, H = 1, L = 20]
    lengths = np.asarray(ar.lengths)[[0, 2]][:, None]
    for history, at_least, at_most in (
        (SuffixHistory(answers, lengths), 3.5, 4.0),
        (SuffixHistory(answers[::-1], lengths[::-1]), 1.0, 1.5),
    ):
        spec = Spec("suffix", history, num_draft_tokens=3, suffix_group_rows=2)
        out = generate(cfg, params, prompts, jax.random.key(1), sampling, spec=spec)
        np.testing.assert_array_equal(out.tokens, ar.tokens)
        np.testing.assert_allclose(out.logprobs, ar.logprobs, rtol=1e-5, atol=1e-5)
        assert at_least <= out.stats["acceptance_length"] <= at_most, out.stats


def test_rows_keep_their_sources_when_the_loop_moves_into_smaller_batches(policy, monkeypatch):
    """Staged loops (8 -> 4 -> 2 rows) move each row's drafting state with it and keep every row's
    tokens in the call-wide pool: with the groups' answers as history the drafts stay accepted after
    the moves, and the rollout equals autoregressive decoding."""
    cfg, params = policy
    base = [[5, 9, 11, 4], [2, 40, 33, 17, 8], [3, 3, 12, 50], [21, 22, 23]]
    prompts = [p for p in base for _ in range(2)]
    plain = Sampling(temperature=0.0, max_new_tokens=24)
    answers = np.asarray(generate(cfg, params, base, jax.random.key(0), plain).tokens)
    # An eos that ends the first group early and never appears in the last group's answer.
    eos = next(int(t) for t in answers[0, 3:10] if t not in answers[3] and t not in answers[0, :3])
    sampling = Sampling(temperature=0.0, max_new_tokens=24, eos_id=eos)
    monkeypatch.setattr(stages, "MIN_STAGE_ROWS", 2)
    ar = generate(cfg, params, prompts, jax.random.key(0), sampling)
    history = SuffixHistory(np.asarray(ar.tokens)[::2, None, :], np.asarray(ar.lengths)[::2, None])
    spec = Spec("suffix", history, num_draft_tokens=3, suffix_group_rows=2)
    out = generate(cfg, params, prompts, jax.random.key(1), sampling, spec=spec)
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    np.testing.assert_array_equal(out.lengths, ar.lengths)
    assert out.stats["stage_rows"] == [8, 4, 2] and sum(out.stats["stage_steps"][1:]) > 0, out.stats
    assert out.stats["acceptance_length"] >= 3.5, out.stats


@pytest.mark.parametrize("slots", [5, 128, 300, 1000])
@pytest.mark.parametrize("num", [1, 4, 16])
def test_first_longest_keeps_the_first_slots_of_the_longest_match(slots, num):
    """The blocked selection keeps exactly the slots that a top-k over all slots keeps at the
    maximum, in slot order: rows with many ties (values 0-3), few, and none (all -1)."""
    num = min(num, slots)
    rng = np.random.default_rng(slots * 100 + num)
    matched = rng.integers(-1, 4, (6, slots)).astype(np.int32)
    matched[1] = np.where(rng.random(slots) < 0.01, 5, matched[1])  # a rare longest match
    matched[2] = -1  # nothing matches
    matched[3] = np.where(np.arange(slots) == slots - 1, 7, 0)  # only the last slot
    found, position = jax.jit(first_longest, static_argnums=1)(jnp.asarray(matched), num)
    found, position = np.asarray(found), np.asarray(position)
    for row in range(matched.shape[0]):
        longest = matched[row].max()
        expected = np.flatnonzero(matched[row] == longest)[:num] if longest >= 1 else np.array([], int)
        assert found[row].tolist() == [True] * len(expected) + [False] * (num - len(expected)), row
        assert position[row, : len(expected)].tolist() == expected.tolist(), row
        assert (position[row] >= 0).all() and (position[row] < slots).all()
