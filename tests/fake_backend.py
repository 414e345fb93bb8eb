"""A Backend for UI tests: DemoBackend's canned replies, a record of what it was asked, and knobs to hold a
reply in flight and to make things fail; and the virtual clock that fixes the meter's numbers. No torch
anywhere."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import replace

from tuichat.backends.protocol import Message, SamplingParams, StreamEvent, TuichatError, Usage
from tuichat.ui.demo import DemoBackend


class VirtualClock:
    """Time that moves only when someone sleeps on it: the meter shows the same numbers on every run."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


# Short, so a test's reply takes a few frames; one has a code block to copy.
SHORT_REPLIES = [
    "Use this:\n\n```python\nprint(\"hi\")\n```\n\nDone.",
    "A **plain** answer, in a few words.",
]


class Tap:
    """Each token of a stream after its first waits for a permit of that stream's own: a reply streams exactly
    as far as the test lets it, and is still streaming whenever the test says so, however fast the machine."""

    def __init__(self, tokens: int = 0) -> None:
        self.tokens = tokens  # the permits each stream starts with
        self._permits: dict[str, asyncio.Semaphore] = {}

    def open(self, conversation_id: str) -> None:
        self._permits.setdefault(conversation_id, asyncio.Semaphore(self.tokens))

    async def wait(self, conversation_id: str) -> None:
        self.open(conversation_id)
        await self._permits[conversation_id].acquire()

    def allow(self, tokens: int) -> None:
        """`tokens` more for every stream that has started."""
        for permits in self._permits.values():
            for _ in range(tokens):
                permits.release()


class FakeBackend(DemoBackend):
    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("replies", SHORT_REPLIES)
        kwargs.setdefault("first_token_s", 0.05)
        kwargs.setdefault("token_s", 0.005)
        kwargs.setdefault("load_s", 0.02)
        super().__init__(**kwargs)
        self.hold: asyncio.Event | None = None  # if given, replies wait for it after `hold_after` tokens
        self.hold_after = 1
        self.tap: Tap | None = None  # if given, replies stream only as far as it lets them
        self.sent = 0  # events yielded by every stream() so far
        self.stream_error: str | None = None  # when set: replies end with this error after one token
        self.load_delay_s = 0.0  # extra, real seconds in load(), to test waiting for a model
        self.load_calls: list[str] = []
        self.reported_usage: Usage | None = None  # if given, the prompt and cached tokens every reply reports
        self.calls: list[dict] = []  # every stream() call: conversation_id, messages, params, model
        self.max_in_flight = 0
        self.recommended: dict[str, dict] = {}  # model -> the sampling its generation config would recommend

    def _usage(self, conversation_id: str, messages: Sequence[Message]) -> Usage:
        if self.reported_usage is not None:
            return replace(self.reported_usage)
        return super()._usage(conversation_id, messages)

    def sampling_defaults(self, model: str) -> dict:
        return self.recommended.get(model, {}) if model in self.loaded else {}

    async def load(self, model, progress=None) -> str:
        self.load_calls.append(model)
        await asyncio.sleep(self.load_delay_s)
        return await super().load(model, progress)

    async def stream(
        self,
        conversation_id: str,
        messages: Sequence[Message],
        params: SamplingParams,
        model: str | None = None,
    ) -> AsyncIterator[StreamEvent]:
        if model not in self.loaded:
            raise TuichatError(f"{model} was never loaded")
        self.calls.append(
            {"conversation_id": conversation_id, "messages": list(messages), "params": params, "model": model}
        )
        # DemoBackend.stream adds it to in_flight before its first await.
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight | {conversation_id}))
        if self.tap is not None:
            self.tap.open(conversation_id)  # before its first token: a test that saw that token may allow the next
        async with aclosing(super().stream(conversation_id, messages, params, model)) as events:
            count = 0
            async for event in events:
                count += 1
                self.sent += 1
                yield event
                if event.finished:
                    return
                if self.stream_error:
                    failed = Usage(finish_reason="error")
                    yield StreamEvent("", self.clock(), failed, finished=True, error=self.stream_error)
                    return
                if self.hold is not None and count >= self.hold_after:
                    await self.hold.wait()
                if self.tap is not None:
                    await self.tap.wait(conversation_id)
