"""What a generated workload asks of a policy and its drafter, under a given tokenizer.

From problems drawn with their choice points (`jaxspec.tasks.generate_recorded`), exactly:

* the entropy of a response given its question, H(Y | x) in nats: the data distribution's own
  uncertainty, the sum of the per-token entropies a policy that learned the data exactly would
  show along a response (chain rule). Entropy per token is sum_x H(Y | x) / sum_x E[T | x].
* the acceptance length an *ideal* greedy drafter would reach at draft depth k: one that drafts
  the argmax token of the data distribution at every position, verified exactly at T=1 against
  a policy equal to the data distribution. A trained head drafts from a worse model of the same
  distribution, so this is an upper bound for it.

Token level. Each written segment (a choice point, or fixed text) is tokenized alternative by
alternative, and the drawn response must tokenize as the concatenation of its segments' tokens
(checked on each response; the tally texts put every choice boundary at a pre-token boundary).
Adjacent segments are merged into *blocks* until no alternative of a block is a token-level
prefix of another; a response is then a concatenation of independent blocks, each a
distribution over token tuples, and the next-token distribution anywhere is the block's trie at
that point. The eos token is the last block.

Acceptance. With exact verification of a deterministic draft (`jaxspec.rollout`), accepting
draft x with probability p(x) and emitting a sample of p's residual otherwise is the same as
sampling the token x' ~ p and accepting iff x' = x. So along a response sampled from the data,
a verification step accepts the following tokens while each is its position's argmax (at most
k of them) and emits one more (the correction or the bonus). A run of r argmax tokens closed by
a non-argmax token then takes floor(r / (k + 1)) + 1 steps, a final open run ceil(r / (k + 1)).
As in `RolloutOutput.stats["acceptance_length"]`, the first response token comes from the
prefill (no step) and the acceptance length is the tokens the steps emit over the steps taken,
pooled over responses; it is estimated on the sampled responses (standard error by the delta
method over responses).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from jaxspec.tasks.phrasing import Segment
from jaxspec.tasks.tokenizer import ChatTokenizer

TokenDist = dict[tuple[int, ...], float]


@dataclasses.dataclass(frozen=True)
class ResponseStats:
    """One drawn response (solution + eos) seen token by token.

    tokens: int32 [T] its token ids (eos last).
    argmax: bool [T], True where the token is the argmax of the data's next-token distribution
        at its position (ties go to the token of the lowest-numbered alternative).
    entropy: H(response | question) in nats; entropy_var: the variance of -log p(response |
        question) over responses to that question (blocks are independent).
    expected_length: E[T | question] in tokens; logprob: log p(this response | question).
    """

    tokens: np.ndarray
    argmax: np.ndarray
    entropy: float
    entropy_var: float
    expected_length: float
    logprob: float


def _prefix_free(alternatives: Sequence[tuple[int, ...]]) -> bool:
    """No tuple is a prefix of another (in sorted order a prefix directly precedes an extension)."""
    ordered = sorted(alternatives)
    return all(b[: len(a)] != a for a, b in zip(ordered, ordered[1:]))


def _argmax_flags(dist: TokenDist, drawn: tuple[int, ...]) -> list[bool]:
    """For each token of `drawn` (an alternative of the prefix-free `dist`): is it the most
    probable next token given its prefix. Ties go to the token of the earliest alternative in
    `dist`'s order (the segments' alternatives, canonical first)."""
    candidates = [(alt, p) for alt, p in dist.items() if p > 0]
    flags = []
    for j, token in enumerate(drawn):
        mass: dict[int, float] = {}
        for alt, p in candidates:  # all longer than j: none is a prefix of `drawn`
            mass[alt[j]] = mass.get(alt[j], 0.0) + p
        best = max(mass.values())
        flags.append(next(t for t, m in mass.items() if m == best) == token)
        candidates = [(alt, p) for alt, p in candidates if alt[j] == token]
    return flags


@dataclasses.dataclass(frozen=True)
class _Block:
    """A prefix-free distribution over token tuples, with its entropy (nats), the variance of
    -log p under it and its expected length (tokens)."""

    dist: TokenDist
    entropy: float
    variance: float
    length: float


_EOS = None  # the key of the eos segment
_CACHE_LIMIT = 200_000  # entries per cache; past it a cache starts again (unique segments fill it)


class SegmentTokenizer:
    """A tokenizer's view of written segments: token ids of texts, token-level blocks and their
    statistics, each computed once and shared by the `analyze_response` calls of one workload
    (most segments, e.g. a line's opener, recur in every line)."""

    def __init__(self, tok: ChatTokenizer):
        self.tok = tok
        self.ids: dict[str, tuple[int, ...]] = {}
        self._blocks: dict[tuple, _Block | None] = {}
        self._paths: dict[tuple, tuple[list[bool], float]] = {}

    def add(self, segments: Sequence[Segment]) -> None:
        """Tokenizes the texts of `segments` not seen yet (one batch)."""
        missing = sorted({t for s in segments for t in s.texts if t not in self.ids})
        for text, enc in zip(missing, self.tok.tokenizer.encode_batch(missing, add_special_tokens=False)):
            self.ids[text] = tuple(enc.ids)

    def _distribution(self, key) -> TokenDist:
        if key is _EOS:
            return {(self.tok.eos_id,): 1.0}
        dist: TokenDist = {}
        for text, p in zip(*key):
            ids = self.ids[text]
            dist[ids] = dist.get(ids, 0.0) + p
        return dist

    def block(self, keys: tuple) -> _Block | None:
        """The block of the consecutive segments `keys` ((texts, probs) each), None if their
        token tuples are not prefix-free (the block must take in the next segment too)."""
        if keys in self._blocks:
            return self._blocks[keys]
        dist = self._distribution(keys[0])
        for key in keys[1:]:
            merged: TokenDist = {}
            for a, p in dist.items():
                for b, q in self._distribution(key).items():
                    merged[a + b] = merged.get(a + b, 0.0) + p * q
            dist = merged
        block = None
        if len(dist) == 1 or _prefix_free(list(dist)):
            probs = np.array([p for p in dist.values() if p > 0])
            nll = -np.log(probs)
            entropy = float(probs @ nll)
            block = _Block(
                dist, entropy, float(probs @ (nll - entropy) ** 2), float(sum(p * len(a) for a, p in dist.items()))
            )
        if len(self._blocks) >= _CACHE_LIMIT:
            self._blocks.clear()
        self._blocks[keys] = block
        return block

    def path(self, keys: tuple, block: _Block, drawn: tuple[int, ...]) -> tuple[list[bool], float]:
        """(argmax flag of each token of `drawn`, log p(drawn)) within `block`."""
        found = self._paths.get((keys, drawn))
        if found is None:
            flags = [True] * len(drawn) if len(block.dist) == 1 else _argmax_flags(block.dist, drawn)
            found = flags, math.log(block.dist[drawn])
            if len(self._paths) >= _CACHE_LIMIT:
                self._paths.clear()
            self._paths[(keys, drawn)] = found
        return found


def analyze_response(segments: Sequence[Segment], tokens: SegmentTokenizer) -> ResponseStats:
    """The token-level statistics of one response written as `segments` (see the module doc).
    Raises ValueError if the response does not tokenize as its segments' concatenation."""
    tokens.add(segments)
    tok = tokens.tok
    pieces = [tokens.ids[s.drawn] for s in segments]
    drawn_tokens = [t for piece in pieces for t in piece]
    whole = tok.encode("".join(s.drawn for s in segments))
    if whole != drawn_tokens:
        at = next(
            (i for i, (a, b) in enumerate(zip(whole, drawn_tokens)) if a != b), min(len(whole), len(drawn_tokens))
        )
        raise ValueError(
            f"the response does not tokenize as its segments do (first difference at token {at}): "
            f"a choice boundary is not a pre-token boundary of this tokenizer"
        )
    keys = [(s.texts, s.probs) for s in segments] + [_EOS]
    pieces.append((tok.eos_id,))
    flags: list[bool] = []
    entropy = variance = length = logprob = 0.0
    i = 0
    while i < len(keys):
        j = i + 1
        block = tokens.block(tuple(keys[i:j]))
        while block is None:  # the eos segment closes any block
            j += 1
            block = tokens.block(tuple(keys[i:j]))
        drawn = pieces[i] if j == i + 1 else tuple(t for piece in pieces[i:j] for t in piece)
        path_flags, path_logprob = tokens.path(tuple(keys[i:j]), block, drawn)
        flags += path_flags
        entropy, variance, length = entropy + block.entropy, variance + block.variance, length + block.length
        logprob += path_logprob
        i = j
    return ResponseStats(
        tokens=np.asarray(drawn_tokens + [tok.eos_id], np.int32),
        argmax=np.asarray(flags, bool),
        entropy=entropy,
        entropy_var=variance,
        expected_length=length,
        logprob=logprob,
    )


def verification_steps(argmax: np.ndarray, k: int) -> int:
    """Steps an ideal depth-k chain takes over a response with these argmax flags (bool [T]); the
    first token comes from the prefill."""
    flags = np.asarray(argmax[1:], bool)
    misses = np.flatnonzero(~flags)
    starts = np.concatenate([[0], misses + 1])
    closed = misses - starts[:-1]  # argmax tokens before each miss
    tail = len(flags) - starts[-1]
    return int(np.sum(closed // (k + 1) + 1) + -(-tail // (k + 1)))


def ideal_acceptance(responses: Sequence[ResponseStats], k: int) -> tuple[float, float]:
    """(acceptance length, its standard error) of an ideal depth-k chain over `responses`."""
    emitted = np.array([len(r.tokens) - 1 for r in responses], np.float64)
    steps = np.array([verification_steps(r.argmax, k) for r in responses], np.float64)
    ratio = emitted.sum() / steps.sum()
    n = len(responses)
    error = math.sqrt(np.var(emitted - ratio * steps) / n) / steps.mean() if n > 1 else math.nan
    return float(ratio), float(error)


def percentiles(values: Sequence[float], qs: Sequence[float] = (10, 50, 90, 99, 100)) -> dict[str, float]:
    """{"p10": ..., "p50": ..., "max": ...} of `values` (numpy's linear interpolation)."""
    points = np.percentile(np.asarray(values, np.float64), qs)
    return {("max" if q == 100 else f"p{q:g}"): float(v) for q, v in zip(qs, points)}


def summarize(responses: Sequence[ResponseStats], max_depth: int = 7) -> dict:
    """Token lengths, entropy and ideal acceptance of a workload's sampled responses.

    Returns {"responses", "response_tokens": percentiles (solution + eos), "mean_response_tokens",
    "entropy_per_token" (nats: sum of H(Y | x) over sum of E[T | x]), "entropy_per_response"
    (mean H(Y | x), nats), "ideal_acceptance": [length at k = 1..max_depth (the draft depth)],
    "ideal_acceptance_se": [their standard errors]}.
    """
    if not responses:
        raise ValueError("summarize needs at least one response")
    lengths = [len(r.tokens) for r in responses]
    acceptance = [ideal_acceptance(responses, k) for k in range(1, max_depth + 1)]
    return {
        "responses": len(responses),
        "response_tokens": percentiles(lengths),
        "mean_response_tokens": float(np.mean(lengths)),
        "entropy_per_token": sum(r.entropy for r in responses) / sum(r.expected_length for r in responses),
        "entropy_per_response": float(np.mean([r.entropy for r in responses])),
        "ideal_acceptance": [a for a, _ in acceptance],
        "ideal_acceptance_se": [e for _, e in acceptance],
    }
