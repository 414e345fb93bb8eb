"""Speculative decoding's proposer: n-gram lookup over a sequence's own tokens (its prompt, which holds the
whole conversation, and its reply so far), as llama.cpp's and vLLM's prompt lookup. Chat repeats its
context: code being edited, names from the question, quoted text, lists, a small model's loops. The engine
verifies the proposed tokens in the sequence's next step (engine.py) and keeps only those the model itself
would have produced, so a reply is the same with speculation on or off.
"""

from __future__ import annotations

import math
from collections import deque

MAX_NGRAM = 4  # the longest suffix looked up; longer matches predict better but are rarer
MIN_NGRAM = 2  # a single repeated token predicts too little to pay for the rows it adds
MAX_DRAFT = 8  # most tokens proposed at once
# The least one more row is taken to add to a step, as a share of a one-row step: what a draft row costs on
# the CPU path (docs/design/speculation.md has the measurement and scripts/draft_cost.py re-measures it). StepCost
# raises it where timed steps show rows cost more; it never lowers it, so a draft is never sized on a fit that
# flatters it.
PRIOR_ROW_SHARE = 0.15


class StepCost:
    """A step's time fitted as a + b * rows over the recent steps: what a draft token's row costs on this
    machine, for this model, now."""

    def __init__(self, window: int = 64) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._fit: tuple[float, float] | None = None
        self._since_fit = 0

    def add(self, rows: int, seconds: float) -> None:
        self._samples.append((rows, seconds))
        self._since_fit += 1
        if self._since_fit >= 16:
            self._since_fit = 0
            n = len(self._samples)
            mean_r = sum(r for r, _ in self._samples) / n
            mean_t = sum(t for _, t in self._samples) / n
            spread = sum((r - mean_r) ** 2 for r, _ in self._samples)
            if spread >= n:  # rows that vary enough (about one row or more) to tell b from noise
                b = sum((r - mean_r) * (t - mean_t) for r, t in self._samples) / spread
                a = mean_t - b * mean_r
                self._fit = (a, b) if a > 0 and b > 0 else None

    def row_share(self, rows: int) -> float:
        """How much one more row lengthens a step of `rows` rows, as a fraction of that step: the fit, never
        below the prior's (steps mixing prefill chunks make rows look cheaper than a draft's are)."""
        prior = PRIOR_ROW_SHARE / (1 + PRIOR_ROW_SHARE * (rows - 1))
        if self._fit is None:
            return prior
        a, b = self._fit
        return max(prior, b / (a + b * rows))


def draft_length(acceptance: float, worth: float) -> int:
    """The longest draft whose last token is still worth its row: it is kept with probability acceptance**k
    (each kept only if those before it were), and a row pays when that beats `worth`."""
    if acceptance <= worth:
        return 0
    if acceptance >= 0.999:
        return MAX_DRAFT
    return min(MAX_DRAFT, int(math.log(worth) / math.log(acceptance)))


class NgramProposer:
    """Where each n-gram of a sequence last ended, for MIN_NGRAM <= n <= MAX_NGRAM. The index grows with the
    tokens as they arrive (O(MAX_NGRAM) per token), never rescanning the history; only accepted tokens ever
    enter it. `acceptance` estimates how often this sequence's next draft token is kept: a decaying count of
    kept and cut tokens over a prior of one each, so it drifts back towards 1/2 while nothing is proposed and a
    sequence that stopped proposing tries again."""

    DECAY = 0.8

    def __init__(self) -> None:
        self._last_end: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the index
        self._kept = self._cut = 0.0
        self.proposed = 0  # totals, for the engine's stats
        self.accepted = 0

    @property
    def acceptance(self) -> float:
        return (self._kept + 1) / (self._kept + self._cut + 2)

    def _index(self, tokens: list[int]) -> None:
        # An n-gram ending at `end` is indexed once the token after it is known: the lookup of the current suffix
        # must find an earlier occurrence, with a continuation.
        for end in range(self._indexed, len(tokens) - 1):
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end + 1 >= n:
                    self._last_end[tuple(tokens[end + 1 - n : end + 1])] = end
        self._indexed = max(self._indexed, len(tokens) - 1)

    def propose(self, tokens: list[int], count: int) -> list[int]:
        """Up to `count` tokens that followed the latest earlier occurrence of the longest suffix of `tokens`
        found, or none."""
        self._index(tokens)
        if count <= 0:
            self.verified(0, 0)
            return []
        for n in range(min(MAX_NGRAM, len(tokens)), MIN_NGRAM - 1, -1):
            end = self._last_end.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return tokens[end + 1 : end + 1 + count]
        return []

    def verified(self, proposed: int, accepted: int) -> None:
        """A draft's outcome (0, 0: a step without one, which only lets the counts decay)."""
        self.proposed += proposed
        self.accepted += accepted
        self._kept = self.DECAY * self._kept + accepted
        self._cut = self.DECAY * self._cut + (accepted < proposed)
