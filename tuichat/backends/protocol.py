"""The one interface between the front ends (TUI, `tuichat ask`, `tuichat bench`) and an engine.

This module must stay free of torch/transformers imports: the TUI imports it at start-up and has to paint
its first frame in well under a second. `tuichat.backends.local.LocalBackend` is the real implementation (it imports
the engine lazily); tests use fakes that follow the same protocol.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

# The request and reply vocabulary is the engine's (it stands alone); every front end and backend speaks it.
from tuichat.engine.types import (
    FinishReason,
    ModelInfo,
    ModelNotFound,
    ProgressCallback,
    PromptTooLong,
    ResolvedModel,
    SamplingParams,
    ServingOptions,
    TuichatError,
    Usage,
)

__all__ = ["CHAT_SAMPLING", "Backend", "TuichatError", "EngineOptions", "EngineStats", "FinishReason", "Message",
           "ModelInfo", "ModelNotFound", "ProgressCallback", "PromptTooLong", "RemoteStats", "ResolvedModel", "Role",
           "SamplingParams", "StreamEvent", "Usage"]

Role = Literal["system", "user", "assistant"]
ContextPolicy = Literal["drop", "summarise", "refuse"]


# What a chat samples with when neither the model's generation config nor the user says: of the settings
# scripts/loops.py compares (docs/design/sampling.md), the one whose replies loop least on the embedded model.
CHAT_SAMPLING: Mapping[str, Any] = {"temperature": 0.2, "top_p": 0.9, "frequency_penalty": 0.5}


def chat_sampling(recommended: Mapping[str, Any], chosen: Mapping[str, Any]) -> SamplingParams:
    """The sampling of a reply in every front end: what the user chose (config, flags, a dialog, a request's
    fields) over the model's recommendation, or CHAT_SAMPLING when it has none. A chosen temperature of 0 is
    exact greedy, as SamplingParams() is: the defaults' penalties are dropped and only the user's own apply.
    Raises TuichatError for a value out of range."""
    base = {} if chosen.get("temperature") == 0 else (recommended or CHAT_SAMPLING)
    return SamplingParams(**{**base, **chosen})


@dataclass(frozen=True)
class Message:
    role: Role
    content: str


@dataclass(frozen=True)
class EngineOptions(ServingOptions):
    """How a model is loaded and served. Every front end accepts the same options."""

    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device_map: str | None = None  # "auto": accelerate layer split over the visible GPUs
    # A conversation that outgrows the context: "drop" leaves out its oldest turns, keeping the system prompt
    # and the latest turns; "summarise" puts a summary of those turns, made by the model, in their place;
    # "refuse" answers it with PromptTooLong (serve's default: OpenAI's API never trims).
    context_policy: ContextPolicy = "drop"


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
    speculate: str = "off"  # speculative decoding's mode
    draft_tokens: int = 0  # since start: tokens proposed, and those the model agreed with
    accepted_tokens: int = 0
    tokens_per_step: float = 0.0  # tokens a sequence got per step it was sampled in, since start
    rss_bytes: int = 0  # the serving process's resident memory now, and its most so far
    peak_rss_bytes: int = 0
    load_s: float = 0.0  # how long the model took to load, kernels' build excluded
    mapped_bytes: int = 0  # weights read in place from the model's file (a GGUF's map: no copy)
    huge_page_bytes: int = 0  # of the file, what the process mapped in 2 MB pages as it loaded
    kv_bytes: int = 0  # the KV cache's pool
    kv_disk_bytes: int = 0  # its second tier: blocks kept in the cache dir (kv_disk.py)
    kv_disk_reads: int = 0  # blocks read back from there since the model loaded, not computed again

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True)
class RemoteStats(EngineStats):
    """A remote engine's state as its Prometheus /metrics tells it (vLLM's names, SGLang's, llama.cpp's);
    None where the server reports nothing. `device` is the server's base URL."""

    running: int | None = None
    waiting: int | None = None
    kv_fraction: float | None = None  # share of the server's KV cache in use
    prefix_hit_rate: float | None = None
    note: str = ""  # why nothing is reported (no /metrics, unreachable, not read yet)

    @property
    def kv_usage(self) -> float:
        return self.kv_fraction or 0.0


class Backend(Protocol):
    """What every front end needs from an engine. Implementations are safe to call from one asyncio loop."""

    async def load(self, model: str, progress: ProgressCallback | None = None) -> str:
        """Make `model` ready (convert/load if needed) and return its canonical name. Raises TuichatError."""
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

    async def prefill(self, conversation_id: str, messages: Sequence[Message], model: str | None = None) -> int:
        """Prepare the turn `messages` would be (the user still typing its last message): compute what it can
        ahead, below every request's priority. Returns the prompt tokens prepared; 0 where it does nothing (a
        remote server)."""
        ...

    def complete(self, request_id: str, prompt: str, params: SamplingParams,
                 model: str | None = None) -> AsyncIterator[StreamEvent]:
        """Continue `prompt` as plain text, no chat template (an OpenAI /v1/completions request)."""
        ...

    def cancel(self, conversation_id: str) -> None:
        """Stop the reply in flight for this conversation, if any; its KV blocks are freed at once."""
        ...

    def stats(self, model: str | None = None) -> EngineStats:
        ...

    def sampling_defaults(self, model: str) -> dict[str, Any]:
        """The sampling the loaded `model`'s makers recommend (its generation config), as SamplingParams
        fields; {} when it gives none or is not loaded. Front ends pass it to `chat_sampling`."""
        ...

    def list_models(self) -> list[ModelInfo]:
        """Safe to call from any thread (it scans folders; it may be slow, so UIs call it off the loop)."""
        ...

    async def close(self) -> None:
        ...
