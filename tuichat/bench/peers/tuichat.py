"""tuichat itself, through the Backend protocol (`LocalBackend.stream`), timed as a front end sees it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from tuichat.backends.protocol import Message, SamplingParams, TuichatError
from tuichat.bench.corpus import WARMUP_QUESTION
from tuichat.bench.settings import BenchSettings
from tuichat.bench.stats import RequestResult
from tuichat.engine.heap import settle_heap


async def stream_once(backend, conversation_id: str, messages: Sequence[Message], params: SamplingParams,
                      submitted: float | None = None) -> RequestResult:
    """Send one turn through LocalBackend.stream and time it as a front end sees it."""
    result = RequestResult(submitted=submitted if submitted is not None else time.perf_counter())
    last_text: float | None = None
    chunks: list[str] = []
    async for event in backend.stream(conversation_id, messages, params):
        now = time.perf_counter()
        if event.text:
            chunks.append(event.text)
            if last_text is None:
                result.ttft_ms = (now - result.submitted) * 1000
            else:
                result.itl_ms.append((now - last_text) * 1000)
            last_text = now
        if event.finished:
            if event.error:
                raise TuichatError(event.error)
            usage = event.usage
            result.tokens = usage.completion_tokens
            result.prompt_tokens = usage.prompt_tokens
            result.cached_tokens = usage.cached_tokens
            result.finish_reason = usage.finish_reason
            result.steps, result.draft_tokens, result.accepted_tokens = usage.steps, usage.draft_tokens, usage.accepted_tokens
    result.finished = time.perf_counter()
    result.e2e_ms = (result.finished - result.submitted) * 1000
    result.text = "".join(chunks)
    return result


class _Tuichat:
    """One BenchBackend with given options, loaded and warmed up once, closed on exit."""

    def __init__(self, settings: BenchSettings, **changes: Any) -> None:
        from tuichat.bench.backend import BenchBackend

        self.backend = BenchBackend(settings.engine_options(**changes), settings.model)
        self.model = settings.model
        self.kernels: dict[str, str] = {}

    def __enter__(self) -> _Tuichat:
        self.name = asyncio.run(self.backend.load(self.model))  # on a thread that ends with the load
        stats = self.backend.stats(self.name)
        self.kernels = {"decode_matmul": stats.matmul, "decode_layers": stats.layers}
        self.weights, self.weight_bytes = stats.weights, stats.weight_bytes  # what a decode step reads
        self.load_s, self.mapped_bytes, self.huge_page_bytes = stats.load_s, stats.mapped_bytes, stats.huge_page_bytes
        asyncio.run(stream_once(self.backend, "warmup", [Message("user", WARMUP_QUESTION)], SamplingParams(max_tokens=4)))
        return self

    def run(self, coro_fn: Callable[..., Any], *args: Any) -> Any:
        return asyncio.run(coro_fn(self.backend, *args))

    def __exit__(self, *exc: Any) -> None:
        asyncio.run(self.backend.close())
        self.backend = None
        settle_heap()  # collect what was closed; freeze what stays


async def run_tabs(backend, conversations: Sequence[Sequence[Message]], params: SamplingParams, stagger_s: float,
                   tag: str = "tab") -> tuple[list[RequestResult], float]:
    """Conversations arriving stagger_s apart; returns their results and the wall time (first submit -> last end)."""
    t0 = time.perf_counter()

    async def tab(i: int, messages: Sequence[Message]) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + i * stagger_s - time.perf_counter()))
        return await stream_once(backend, f"{tag}-{i}", messages, params)

    results = await asyncio.gather(*(tab(i, m) for i, m in enumerate(conversations)))
    return list(results), max(r.finished for r in results) - t0
