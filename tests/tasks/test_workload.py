"""Token-level entropy and ideal-drafter acceptance of a workload, against brute force, against the
real verification procedure, and the variation knob's effect on the tally task."""

import dataclasses
import itertools
import math
import random

import numpy as np
import pytest

from jaxspec.tasks import generate_problems, train_tokenizer
from jaxspec.tasks.generator import generate_recorded
from jaxspec.tasks.phrasing import Segment, alt, draw, option_probs
from jaxspec.tasks.tally import StepLaw, TallyConfig
from jaxspec.tasks.tokenizer import ChatTokenizer
from jaxspec.tasks.workload import SegmentTokenizer, analyze_response, ideal_acceptance, summarize, verification_steps

SHORT = TallyConfig(steps=StepLaw(median=10, sigma=0.5, min_steps=3, max_steps=30), variation=0.7)

# Segments whose token tuples are not prefix-free on their own (" 1" / " 12", an empty option,
# " we add" / " we add it"), with two texts alike in the last one.
TEXTS = [
    ("Day", "On day"),
    (" 1", " 12"),
    (":", ",", ""),
    (" we add", " we add it", " plus"),
    (" 5", " 7"),
    (".\n", "!\n", ". Good.\n"),
    ("The end.", "Fin.", "The end."),
]


@pytest.fixture(scope="module")
def toy():
    """(tokenizer, probabilities of the toy segments' texts: no two paths tie)."""
    import tempfile
    from pathlib import Path

    corpus = ["Day 1: we add it 5.\nThe end.", "On day 12, plus 7!\nFin.", "Day 12 we add 5. Good.\nThe end."] * 50
    folder = Path(tempfile.mkdtemp())
    train_tokenizer(corpus, 300, folder / "tokenizer.json")
    rng = np.random.default_rng(0)
    probs = [tuple(float(p) for p in rng.dirichlet(np.ones(len(t)))) for t in TEXTS]
    # Where options share their first token, that token is the most probable next one although
    # another option alone is more probable than each of them.
    probs[3], probs[6] = (0.3, 0.25, 0.45), (0.3, 0.4, 0.3)
    return ChatTokenizer.from_file(folder / "tokenizer.json"), probs


def _segments(probs, choice):
    return [Segment(t, p, t[i]) for t, p, i in zip(TEXTS, probs, choice)]


def _reference(tok, probs):
    """{token tuple of a whole response (eos included): probability}, by enumerating every path."""
    dist = {}
    for choice in itertools.product(*(range(len(t)) for t in TEXTS)):
        text = "".join(t[i] for t, i in zip(TEXTS, choice))
        key = tuple(tok.encode(text) + [tok.eos_id])
        dist[key] = dist.get(key, 0.0) + math.prod(p[i] for p, i in zip(probs, choice))
    return dist


def _reference_flags(dist, tokens):
    """Per position: is the token the most probable next token given its prefix (unique max)."""
    flags = []
    for j, token in enumerate(tokens):
        mass = {}
        for seq, p in dist.items():
            if len(seq) > j and seq[:j] == tokens[:j]:
                mass[seq[j]] = mass.get(seq[j], 0.0) + p
        best = sorted(mass.values())
        assert len(best) == 1 or best[-1] - best[-2] > 1e-9  # no ties: the reference's argmax is unique
        flags.append(mass[token] == best[-1])
    return flags


def test_analysis_matches_brute_force_enumeration(toy):
    """Entropy, variance of -log p, expected length, log p and argmax flags of every response
    equal those of the enumerated distribution over whole token sequences."""
    tok, probs = toy
    dist = _reference(tok, probs)
    p = np.array(list(dist.values()))
    assert p.sum() == pytest.approx(1.0) and len(dist) < math.prod(len(t) for t in TEXTS)  # "The end." twice
    entropy = float(-(p * np.log(p)).sum())
    variance = float((p * (-np.log(p) - entropy) ** 2).sum())
    length = sum(q * len(s) for s, q in dist.items())
    tokens = SegmentTokenizer(tok)
    for choice in itertools.product(*(range(len(t)) for t in TEXTS)):
        stats = analyze_response(_segments(probs, choice), tokens)
        key = tuple(stats.tokens.tolist())
        assert key in dist
        assert stats.entropy == pytest.approx(entropy, abs=1e-12)
        assert stats.entropy_var == pytest.approx(variance, abs=1e-12)
        assert stats.expected_length == pytest.approx(length, abs=1e-12)
        assert stats.logprob == pytest.approx(math.log(dist[key]), abs=1e-12)
        assert stats.argmax.tolist() == _reference_flags(dist, key)


def test_a_segment_boundary_inside_a_pre_token_is_refused(toy):
    """A word the tokenizer writes as one token, cut into two segments, tokenizes differently."""
    tok, _ = toy
    vocab = tok.tokenizer.get_vocab()
    word = next(t for t in sorted(vocab) if t.isascii() and t.isalpha() and len(t) >= 2 and tok.encode(t) == [vocab[t]])
    cut = [Segment((word[:1],), (1.0,), word[:1]), Segment((word[1:], "x"), (0.5, 0.5), word[1:])]
    with pytest.raises(ValueError, match="pre-token boundary"):
        analyze_response(cut, SegmentTokenizer(tok))
    whole = [Segment((word,), (1.0,), word), Segment((" x", " y"), (0.5, 0.5), " x")]
    assert analyze_response(whole, SegmentTokenizer(tok)).entropy == pytest.approx(math.log(2))


def _steps_by_loop(flags, k):
    """Verification steps by walking the response: a step accepts argmax tokens while fewer than k
    are accepted, then emits one more token; the first token comes from the prefill."""
    steps, accepted, j = 0, 0, 1
    while j < len(flags):
        if accepted < k and flags[j]:
            accepted += 1
        else:
            steps, accepted = steps + 1, 0
        j += 1
    return steps + (accepted > 0)


def test_verification_steps_match_a_step_by_step_walk():
    rng = np.random.default_rng(1)
    for _ in range(300):
        flags = rng.random(int(rng.integers(1, 60))) < rng.uniform(0.2, 1.0)
        for k in range(1, 8):
            assert verification_steps(flags, k) == _steps_by_loop(flags.tolist(), k)


def _speculative_rollouts(dist, k, n, rng):
    """(emitted tokens, verification steps) per rollout of the real procedure: a drafter that
    proposes the argmax continuation of the sequence distribution `dist`, verified exactly (accept
    draft x with probability p(x), else sample from p with x removed; a bonus token after k)."""
    nexts = {}
    for seq, p in dist.items():
        for j in range(len(seq)):
            nexts.setdefault(seq[:j], {}).setdefault(seq[j], 0.0)
            nexts[seq[:j]][seq[j]] += p
    nexts = {prefix: (list(m), np.array(list(m.values())) / sum(m.values())) for prefix, m in nexts.items()}
    ends = set(dist)

    def sample(prefix, exclude=None):
        tokens, p = nexts[prefix]
        if exclude is not None:
            p = np.where(np.array(tokens) == exclude, 0.0, p)
            p = p / p.sum()
        return tokens[rng.choice(len(tokens), p=p)]

    out = []
    for _ in range(n):
        seq = (sample(()),)  # the prefill's token
        steps = 0
        while seq not in ends:
            steps += 1
            for _ in range(k):
                tokens, p = nexts[seq]
                draft = tokens[int(np.argmax(p))]
                if rng.random() < p[int(np.argmax(p))]:
                    seq += (draft,)
                    if seq in ends:
                        break
                else:
                    seq += (sample(seq, exclude=draft),)
                    break
            else:
                seq += (sample(seq),)
        out.append((len(seq) - 1, steps))
    return np.array(out, np.float64)


@pytest.mark.parametrize("k", [1, 3])
def test_ideal_acceptance_is_that_of_exact_verification(toy, k):
    """The acceptance the analysis assigns (its flags, over the exact distribution of responses)
    equals the one 20000 rollouts of the real accept/resample procedure reach, within 5 standard
    errors (~0.01 here). Negative control: the analysis at depth k + 1 (an off-by-one) is
    rejected by the same rollouts."""
    tok, probs = toy
    dist = _reference(tok, probs)
    tokens = SegmentTokenizer(tok)
    responses = {}
    for choice in itertools.product(*(range(len(t)) for t in TEXTS)):
        stats = analyze_response(_segments(probs, choice), tokens)
        responses[tuple(stats.tokens.tolist())] = stats

    def expected(depth):
        emitted = sum(p * (len(s) - 1) for s, p in dist.items())
        return emitted / sum(p * verification_steps(responses[s].argmax, depth) for s, p in dist.items())

    runs = _speculative_rollouts(dist, k, 20000, np.random.default_rng(k))
    ratio = runs[:, 0].sum() / runs[:, 1].sum()
    se = math.sqrt(np.var(runs[:, 0] - ratio * runs[:, 1]) / len(runs)) / runs[:, 1].mean()
    assert se < 0.01
    assert abs(ratio - expected(k)) < 5 * se
    assert abs(ratio - expected(k + 1)) > 5 * se


@pytest.mark.parametrize("m, variation", [(4, 0.3), (8, 0.7)])
def test_a_choice_takes_the_canonical_option_as_often_as_stated(m, variation):
    """P(canonical) = 1 - v + v/m: 100000 draws within 5 standard deviations (~0.007); negative
    control: the frequency of v + 0.02 is rejected (it moves P by 0.02 (1 - 1/m) >= 0.015)."""
    expr = alt(*(f"o{i}" for i in range(m)))
    rng = random.Random(0)
    n = 100_000
    hits = sum(draw(expr, rng, variation) == "o0" for _ in range(n))

    def z(v):
        p = option_probs(m, v)[0]
        return (hits - n * p) / math.sqrt(n * p * (1 - p))

    assert abs(z(variation)) < 5
    assert abs(z(variation + 0.02)) > 5
    assert sum(option_probs(m, variation)) == pytest.approx(1.0)


@pytest.fixture(scope="module")
def tally_tok(tmp_path_factory):
    """A BPE trained on tally problems as `jaxspec pretrain` trains one (here on 300 problems)."""
    problems = generate_problems(300, seed=0, kinds=("tally",), tally=dataclasses.replace(SHORT, variation=1.0))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer((t for p in problems for t in (p["question"], p["solution"])), 2048, path)
    return ChatTokenizer.from_file(path)


def _first_problems(variation, seeds):
    """The first problem of each seed: its structure (days, rules) does not depend on variation."""
    cfg = dataclasses.replace(SHORT, variation=variation)
    return [generate_recorded(1, seed=s, kinds=("tally",), tally=cfg)[0][1] for s in seeds]


def test_sampled_responses_follow_the_reported_distribution(tally_tok):
    """sum of -log p(response) over 150 problems against the exact sum of H(Y | x): the difference
    has mean 0 and the summed exact variances; |z| < 5. Negative control: responses drawn at
    variation 0.8 scored with the probabilities of 0.7 give |z| > 5."""
    tokens = SegmentTokenizer(tally_tok)
    seeds = range(150)

    def z(segments_of):
        stats = [analyze_response(s, tokens) for s in segments_of]
        return (sum(-s.logprob for s in stats) - sum(s.entropy for s in stats)) / math.sqrt(
            sum(s.entropy_var for s in stats)
        )

    at_07 = _first_problems(0.7, seeds)
    assert abs(z(at_07)) < 5
    drawn_at_08 = _first_problems(0.8, seeds)
    mixed = [[Segment(a.texts, a.probs, b.drawn) for a, b in zip(x, y)] for x, y in zip(at_07, drawn_at_08)]
    assert all(a.texts == b.texts for x, y in zip(at_07, drawn_at_08) for a, b in zip(x, y))
    assert abs(z(mixed)) > 5


def test_variation_sets_entropy_and_acceptance(tally_tok):
    """0 gives no entropy and an ideal drafter every token (acceptance exactly that of all-argmax
    responses); entropy per token rises and every depth's ideal acceptance falls with the knob."""
    tokens = SegmentTokenizer(tally_tok)
    curve = []
    for variation in (0.0, 0.25, 0.5, 1.0):
        cfg = dataclasses.replace(SHORT, variation=variation)
        recorded = generate_recorded(60, seed=3, kinds=("tally",), tally=cfg)
        responses = [analyze_response(segments, tokens) for _, segments in recorded]
        curve.append(summarize(responses, max_depth=7))
        if variation == 0.0:
            assert all(r.argmax.all() and r.entropy == 0.0 for r in responses)
            for k in range(1, 8):
                steps = sum(-(-(len(r.tokens) - 1) // (k + 1)) for r in responses)
                assert ideal_acceptance(responses, k)[0] == sum(len(r.tokens) - 1 for r in responses) / steps
    entropy = [c["entropy_per_token"] for c in curve]
    assert entropy[0] == 0.0 and all(a < b for a, b in zip(entropy, entropy[1:]))
    for k in range(7):
        acceptance = [c["ideal_acceptance"][k] for c in curve]
        assert all(a > b for a, b in zip(acceptance, acceptance[1:]))
    assert curve[-1]["ideal_acceptance"][2] < 3.0  # uniform phrasing: the k=3 bound well below k + 1
