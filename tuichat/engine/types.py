"""The engine's vocabulary, which the front ends speak too: what a request asks for (SamplingParams), what it
reports (Usage), what to load (ResolvedModel) and how to serve it (ServingOptions), and the error whose
message is for the user. The engine owns these so that it stands alone; tuichat.backends.protocol re-exports them for
the front ends. No torch here: the TUI imports this at start-up.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Literal

FinishReason = Literal["stop", "length", "cancelled", "error"]
ProgressCallback = Callable[[str, float | None], None]  # (what is happening, fraction done or None)
SpeculateMode = Literal["auto", "ngram", "off"]


class TuichatError(Exception):
    """A problem the user can act on (unknown model, prompt too long, ...), whoever raises it: the engine, a
    backend, a front end. Its message is shown as is."""


class ModelNotFound(TuichatError):
    """The model asked for is nowhere to be found (a server answers 404)."""


class PromptTooLong(TuichatError):
    """A prompt longer than the model's context or the whole KV cache: it can never run."""


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 512
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # OpenAI's: each logit less presence_penalty if its token is in the reply so far, and frequency_penalty
    # times how often. 0 leaves the model's distribution (and greedy's exact answer) untouched.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

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
        # Seeds are 64-bit, as torch's and numpy's generators take them.
        if self.seed is not None and not (whole(self.seed) and 0 <= self.seed < 2**64):
            problems.append(f"seed must be a whole number from 0 to 2**64 - 1, or unset, not {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (number(value) and -2 <= value <= 2):
                problems.append(f"{name} must be a number from -2 to 2 (0 is off), not {value!r}")
        if not (isinstance(self.stop, tuple) and all(isinstance(s, str) for s in self.stop)):
            problems.append(f"stop must be a tuple of strings, not {self.stop!r}")
        if problems:
            raise TuichatError("; ".join(problems) + ".")


@dataclass
class Usage:
    """Per-request metrics, in vLLM's vocabulary. Times are milliseconds."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    restored_tokens: int = 0  # of those, read back from disk (KV kept across restarts)
    completion_tokens: int = 0
    queue_ms: float | None = None  # submitted -> first scheduled
    ttft_ms: float | None = None  # submitted -> first non-empty text
    itl_ms: list[float] = field(default_factory=list)  # gaps between text chunks
    e2e_ms: float | None = None
    finish_reason: FinishReason | None = None
    finish_detail: str | None = None  # why a reply ended early at "length": a full KV cache, the context length
    # Speculative decoding: steps that gave this reply tokens, tokens proposed, and of those the ones kept.
    steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # The conversation against the model's context (set by a backend that renders chats: LocalBackend).
    context_tokens: int = 0  # the most tokens a conversation can hold: the model's context, or the whole KV cache
    dropped_messages: int = 0  # the oldest messages left out of this prompt to fit it (and a reply) in the context
    dropped_tokens: int = 0  # what they weighed
    summary: str | None = None  # what stands for them, where the policy summarises
    cache_miss: str | None = None  # why fewer prompt tokens came from the cache than the conversation had run

    @property
    def tokens_per_step(self) -> float | None:
        return self.completion_tokens / self.steps if self.steps else None

    @property
    def acceptance(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def tokens_per_s(self) -> float | None:
        """Decode speed after the first token (TPOT inverted)."""
        if self.e2e_ms is None or self.ttft_ms is None or self.completion_tokens < 2:
            return None
        decode_s = (self.e2e_ms - self.ttft_ms) / 1000
        return (self.completion_tokens - 1) / decode_s if decode_s > 0 else None


@dataclass(frozen=True)
class ResolvedModel:
    """A model spec resolved (tuichat.catalog) to something the loader can open."""

    name: str  # canonical name shown to the user
    kind: Literal["gguf", "local", "hub"]
    source: str  # .gguf path, local folder, or hub id
    converted_at: Callable[[], Path] | None = field(default=None, repr=False, compare=False)
    stop: tuple[str, ...] = ()  # stop strings of every reply, from the model's store (Ollama's params)
    template: str | None = None  # Ollama's Go chat template, for a GGUF that holds no Jinja one (go_template.py)

    @cached_property
    def converted_dir(self) -> Path | None:
        """Where a .gguf's conversion is cached, worked out on first use: it hashes the whole file the first time
        (seconds for gigabytes), which a GGUF served from its file never needs."""
        return self.converted_at() if self.converted_at is not None else None


@dataclass(frozen=True)
class ModelInfo:
    """A model a front end can offer: its spec and where it was found, and, for a model file found on disk
    (tuichat.stores), what a user needs to know before loading it, read from its metadata alone."""

    spec: str  # what `--model` accepts
    kind: Literal["embedded", "converted", "local", "hf-cache", "config", "remote", "ollama", "lmstudio", "dir"]
    description: str = ""
    path: str | None = None  # the file or folder it loads from
    size_bytes: int | None = None
    format: str | None = None  # "gguf" or "safetensors"
    family: str | None = None  # transformers' model_type
    quant: str | None = None  # a GGUF's file type (Q4_K_M, Q8_0, F16, ...)
    parameters: int | None = None
    context: int | None = None  # the model's context length
    runs: bool | None = None  # whether tuichat serves it (None: not known before loading)
    reason: str | None = None  # why not, or what is wrong with the entry


@dataclass(frozen=True)
class ServingOptions:
    """How the engine serves a model, as a user sets it (tuichat.backends.protocol.EngineOptions adds where and in which
    dtype it loads; the engine's EngineConfig adds what only the engine and its tests set)."""

    kv_cache_mb: int | None = None  # None: 16k tokens' worth on CPU (at most 20 % of RAM), 40 % of free GPU memory on CUDA
    batching: Literal["continuous", "static", "off"] = "continuous"
    prefix_cache: bool = True
    max_batched_tokens: int | None = None  # per-step token budget; None: 512 on CPU (a chunk ~0.5 s), 8192 on CUDA
    max_num_seqs: int = 64
    tp: int = 1  # tensor-parallel ranks; ranks 1.. are worker processes the engine starts
    # Where the C layers run: auto serves a GGUF's linears in its own blocks (a dense model in its dtype), none
    # in bf16; int8 / int4 quantize every linear to the blocks of quant.QUANT_FORMATS at load (a GGUF's own
    # blocks stay). Elsewhere the model serves in its dtype and the engine's `weights` says why.
    quant: Literal["auto", "none", "int8", "int4"] = "auto"
    # Speculative decoding from the sequence's own n-grams (speculate.py): auto proposes where it pays (a small
    # batch, a sequence whose proposals get accepted), ngram whenever a match is found, off never. Replies
    # are the same token for token either way.
    speculate: SpeculateMode = "auto"
    # The KV cache's second tier (kv_disk.py): blocks the pool evicts, and all of its blocks when the model
    # unloads, kept in the cache dir up to this many MiB and read back instead of computed again. 0: off.
    kv_disk_mb: int = 2048
