"""Earlier responses to each prompt, which the suffix drafter (`spec.method: suffix`) drafts from
when GRPO meets the prompt again in a later step or epoch (`spec.suffix_history`)."""

from __future__ import annotations

import collections

import numpy as np

from jaxspec.rollout.speculative.suffix import SuffixHistory


class ResponseHistory:
    """The last `size` responses (up to `max_new_tokens` tokens each) generated for every prompt id.

    Kept in host memory by the process that generates; not checkpointed, so a resumed run drafts
    from an empty history at first (its rollouts are distributed as an uninterrupted run's, though
    not token for token the same).
    """

    def __init__(self, size: int, max_new_tokens: int):
        self.size, self.max_new_tokens = size, max_new_tokens
        self._responses: dict[int, collections.deque] = {}

    def of(self, ids) -> SuffixHistory:
        """The responses to prompts `ids` (one group each, in order): tokens int32 [len(ids), size,
        max_new_tokens], lengths int32 [len(ids), size] (0 where fewer responses are kept)."""
        tokens = np.zeros((len(ids), self.size, self.max_new_tokens), np.int32)
        lengths = np.zeros((len(ids), self.size), np.int32)
        for q, i in enumerate(ids):
            for h, response in enumerate(self._responses.get(int(i), ())):
                tokens[q, h, : len(response)] = response
                lengths[q, h] = len(response)
        return SuffixHistory(tokens, lengths)

    def add(self, ids, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Keeps the responses tokens int [len(ids) * G, N] (lengths int [len(ids) * G]) of the
        groups of G rows generated for prompts `ids`, the latest `size` per prompt."""
        if not self.size:
            return
        group = len(tokens) // len(ids)
        for q, i in enumerate(ids):
            kept = self._responses.setdefault(int(i), collections.deque(maxlen=self.size))
            for r in range(q * group, (q + 1) * group):
                kept.append(np.asarray(tokens[r, : lengths[r]], np.int32)[: self.max_new_tokens])
