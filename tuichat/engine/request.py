"""A sequence: one request's token ids, its place in the KV cache, sampling state and timestamps."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tuichat.engine.types import SamplingParams, Usage


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What the engine reports after a step for one request."""

    request_id: int
    text: str  # new text since the previous output
    new_token_ids: list[int]
    t: float
    finished: bool = False
    usage: Usage | None = None  # on the final output, with the ITL list
    error: str | None = None


_ids = itertools.count(1)


@dataclass(eq=False)
class Sequence:
    token_ids: list[int]
    params: SamplingParams
    on_output: Callable[[RequestOutput], None] | None = None
    id: int = field(default_factory=lambda: next(_ids))
    num_prompt_tokens: int = 0
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens [0, num_computed) have their K/V in the cache
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks registered in the prefix cache
    num_released_blocks: int = 0  # leading blocks whose sliding-window layers' K/V were released (BlockManager)
    last_block_hash: bytes | None = None
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    num_restored_tokens: int = 0  # of those, read back from disk (kv_disk.py)
    background: bool = False  # run only in steps with nothing else to do (a prefill while its user types)
    overtaken: int = 0  # later requests admitted while this one waited (the scheduler bounds it)
    finish_reason: str | None = None
    finish_detail: str | None = None  # why "length" came before max_tokens: the KV cache or the context was full
    error: str | None = None
    cancelled: bool = False
    # Timestamps (time.monotonic) and latency bookkeeping.
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_text_time: float | None = None
    last_text_time: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    generator: object | None = None  # per-request sampler.Noise, so a seed holds whatever the batch
    detok: object | None = None
    stop_matcher: object | None = None
    proposer: object | None = None  # a speculate.NgramProposer, while speculation is on
    draft: list[int] = field(default_factory=list)  # tokens proposed for the next step, verified by it
    steps: int = 0  # steps that sampled tokens for it
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def usage(self, now: float, final: bool) -> Usage:
        """The per-token copy leaves out the ITL list (growing with the reply); the final one has it all."""
        ms = lambda t: None if t is None else (t - self.arrival) * 1000  # noqa: E731
        return Usage(
            prompt_tokens=self.num_prompt_tokens,
            cached_tokens=self.num_cached_tokens or 0,
            restored_tokens=self.num_restored_tokens,
            completion_tokens=self.num_completion_tokens,
            queue_ms=ms(self.first_scheduled),
            ttft_ms=ms(self.first_text_time),
            itl_ms=list(self.itl_ms) if final else [],
            e2e_ms=ms(now),
            finish_reason=self.finish_reason,
            finish_detail=self.finish_detail,
            steps=self.steps,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
        )
