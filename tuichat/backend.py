"""The one interface between the front ends (TUI, `tuichat ask`, `tuichat bench`) and an engine.

This module must stay free of torch/transformers imports: the TUI imports it at start-up and has to paint
its first frame in well under a second. `tuichat.local.LocalBackend` is the real implementation (it imports
the engine lazily); tests use fakes that follow the same protocol.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Literal, Protocol, Sequence

Role = Literal["system", "user", "assistant"]
FinishReason = Literal["stop", "length", "cancelled", "error"]


class BackendError(Exception):
    """A problem the user can act on (unknown model, prompt too long, ...). Its message is shown as is."""


@dataclass(frozen=True)
class Message:
    role: Role
    content: str


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 512
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Every front end builds its params here, and the sampler trusts them: top_p 0, for one, would give
        # NaN probabilities and a reply of invisible tokens. bool is an int subclass, never a number here.
        def number(value) -> bool:
            return type(value) in (int, float) and math.isfinite(value)

        def whole(value) -> bool:
            return type(value) is int

        problems = []
        if not (number(self.temperature) and self.temperature >= 0):
            problems.append(f"temperature must be a number ≥ 0 (0 is greedy), not {self.temperature!r}")
        if not (number(self.top_p) and 0 < self.top_p <= 1):
            problems.append(f"top_p must be a number above 0 and at most 1 (1 is off), not {self.top_p!r}")
        if not (whole(self.top_k) and self.top_k >= 0):
            problems.append(f"top_k must be a whole number ≥ 0 (0 is off), not {self.top_k!r}")
        if not (whole(self.max_tokens) and self.max_tokens >= 1):
            problems.append(f"max_tokens must be a whole number ≥ 1, not {self.max_tokens!r}")
        # torch's generators take a seed of 64 bits.
        if self.seed is not None and not (whole(self.seed) and 0 <= self.seed < 2**64):
            problems.append(f"seed must be a whole number from 0 to 2**64 - 1, or unset, not {self.seed!r}")
        if not (isinstance(self.stop, tuple) and all(isinstance(s, str) for s in self.stop)):
            problems.append(f"stop must be a tuple of strings, not {self.stop!r}")
        if problems:
            raise BackendError("; ".join(problems) + ".")


@dataclass(frozen=True)
class EngineOptions:
    """How a model is loaded and served. Every front end accepts the same options."""

    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    kv_cache_mb: int | None = None  # None: a default per device
    batching: Literal["continuous", "static", "off"] = "continuous"
    prefix_cache: bool = True
    max_batched_tokens: int | None = None  # per-step token budget; None: a default per device
    max_num_seqs: int = 64
    tp: int = 1
    device_map: str | None = None  # "auto": accelerate layer split over the visible GPUs
    # Where the C layers run: auto reads a GGUF's linears in its own blocks (a dense model's in its dtype), none
    # in bf16, int8 / int4 quantize a dense model's (and what a GGUF holds in no such blocks) at load.
    quant: Literal["auto", "none", "int8", "int4"] = "auto"


@dataclass
class Usage:
    """Per-request metrics, in vLLM's vocabulary. Times are milliseconds."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    completion_tokens: int = 0
    queue_ms: float | None = None  # submitted -> first scheduled
    ttft_ms: float | None = None  # submitted -> first non-empty text
    itl_ms: list[float] = field(default_factory=list)  # gaps between text chunks
    e2e_ms: float | None = None
    finish_reason: FinishReason | None = None
    finish_detail: str | None = None  # why a reply ended early at "length": a full KV cache, the context length

    @property
    def tokens_per_s(self) -> float | None:
        """Decode speed after the first token (TPOT inverted)."""
        if self.e2e_ms is None or self.ttft_ms is None or self.completion_tokens < 2:
            return None
        decode_s = (self.e2e_ms - self.ttft_ms) / 1000
        return (self.completion_tokens - 1) / decode_s if decode_s > 0 else None


@dataclass(frozen=True)
class StreamEvent:
    """One item of a reply stream. `text` is the new text since the previous event (may be empty on the
    final event). `t` is time.monotonic() when the engine produced it. The final event has `finished` set
    and carries the full usage; `error` is set when the request failed."""

    text: str
    t: float
    usage: Usage
    finished: bool = False
    error: str | None = None


@dataclass(frozen=True)
class EngineStats:
    model: str = ""
    device: str = ""
    dtype: str = ""
    tp: int = 1
    running: int = 0
    waiting: int = 0
    batch_size: int = 0  # sequences in the last step
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_hit_rate: float = 0.0  # cached prompt tokens / prompt tokens, since start
    tokens_per_s: float = 0.0  # generated tokens per second over the last few seconds
    batching: str = "continuous"
    prefix_cache: bool = True
    matmul: str = ""  # decode-step kernels: "amx", or "torch (why not)"
    weights: str = ""  # how a step reads the linears' weights: "bf16", or a GGUF's "Q4_1, Q8_0"
    weight_bytes: int = 0  # bytes of weights a decode step reads
    layers: str = ""  # who runs the decoder layers of short steps: "C" (decoder.c), or "transformers (why)"

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True)
class ModelInfo:
    spec: str  # what `--model` accepts
    kind: Literal["embedded", "converted", "local", "hf-cache", "config"]
    description: str = ""


ProgressCallback = Callable[[str, float | None], None]  # (what is happening, fraction done or None)


class Backend(Protocol):
    """What every front end needs from an engine. Implementations are safe to call from one asyncio loop."""

    async def load(self, model: str, progress: ProgressCallback | None = None) -> str:
        """Make `model` ready (convert/load if needed) and return its canonical name. Raises BackendError."""
        ...

    def stream(
        self,
        conversation_id: str,
        messages: Sequence[Message],
        params: SamplingParams,
        model: str | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """Reply to the last user message of `messages`. Calls with the same `conversation_id` reuse that
        conversation's KV cache. Closing the iterator early (or `cancel`) stops the request."""
        ...

    def cancel(self, conversation_id: str) -> None:
        """Stop the reply in flight for this conversation, if any; its KV blocks are freed at once."""
        ...

    def stats(self, model: str | None = None) -> EngineStats:
        ...

    def list_models(self) -> list[ModelInfo]:
        """Safe to call from any thread (it scans folders; it may be slow, so UIs call it off the loop)."""
        ...

    async def close(self) -> None:
        ...
