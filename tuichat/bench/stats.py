"""Timing one reply and summing a set of them up.

Every number is timed on the client side with time.perf_counter, tuichat's through `LocalBackend.stream`
(what a front end sees): TTFT = submitted -> first non-empty text; ITL = gaps between text chunks; TPOT =
(e2e - TTFT) / (output tokens - 1); throughput = output tokens / wall time of the scenario. Output tokens
include the EOS token for every system alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def percentile(values: Sequence[float | None], q: float) -> float | None:
    """The q-quantile of the values that are not None (numpy's default: linear interpolation between closest
    ranks); None when there are none."""
    data = [v for v in values if v is not None]
    return float(np.quantile(data, q)) if data else None


def median(values: Sequence[float | None]) -> float | None:
    return percentile(values, 0.5)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


@dataclass
class RequestResult:
    """One reply, timed on the client side (perf_counter seconds; *_ms relative to submission)."""

    submitted: float
    ttft_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    e2e_ms: float | None = None
    tokens: int = 0  # output tokens, EOS included
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""
    finished: float = 0.0
    steps: int = 0  # steps that gave this reply tokens, and its drafted and kept tokens (speculation)
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def set_token_times(self, times: Sequence[float]) -> None:
        """TTFT, ITL and end-to-end from a peer's per-token timestamps (perf_counter seconds)."""
        if times:
            self.ttft_ms = (times[0] - self.submitted) * 1000
            self.itl_ms = [(b - a) * 1000 for a, b in zip(times, times[1:])]
            self.e2e_ms = (times[-1] - self.submitted) * 1000

    @property
    def tpot_ms(self) -> float | None:
        if self.ttft_ms is None or self.e2e_ms is None or self.tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.tokens - 1)

    @property
    def decode_tokens_per_s(self) -> float | None:
        tpot = self.tpot_ms
        return 1000 / tpot if tpot else None


def summarize(results: Sequence[RequestResult], wall_s: float) -> dict[str, Any]:
    """vLLM's aggregate metrics over a set of replies."""
    tokens = sum(r.tokens for r in results)
    ttfts = [r.ttft_ms for r in results]
    itls = [gap for r in results for gap in r.itl_ms]
    tpots = [r.tpot_ms for r in results]
    # Little's law: the replies in flight on average over the wall. Near 1 for tabs, the scenario times the
    # arrivals rather than the batching: each reply ended before the next tab came.
    in_flight = sum(r.finished - r.submitted for r in results) / wall_s if wall_s > 0 and all(r.finished for r in results) else None
    return {
        "requests": len(results),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "ttft_ms_p50": percentile(ttfts, 0.5),
        "ttft_ms_p90": percentile(ttfts, 0.9),
        "itl_ms_p50": percentile(itls, 0.5),
        "itl_ms_p90": percentile(itls, 0.9),
        "tpot_ms_p50": percentile(tpots, 0.5),
        "tpot_ms_p90": percentile(tpots, 0.9),
        "in_flight_mean": in_flight,
    }
