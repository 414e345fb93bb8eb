"""The UI without a model: `python -m tuichat.ui.demo` runs tuichat on DemoBackend, a Backend that streams
canned Markdown at a steady pace (no torch import; history in demo-history.sqlite3 in the data dir).
`python -m tuichat.ui.demo --screenshots assets` writes the README's SVG screenshots."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import re
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from pathlib import Path

from tuichat import paths
from tuichat.backends.protocol import (
    EngineStats,
    Message,
    ModelInfo,
    ProgressCallback,
    SamplingParams,
    StreamEvent,
    TuichatError,
    Usage,
)

REPLIES = [
    """Here is a small **Python** function that does it:

```python
def fizzbuzz(n: int) -> str:
    if n % 15 == 0:
        return "FizzBuzz"
    if n % 3 == 0:
        return "Fizz"
    return "Buzz" if n % 5 == 0 else str(n)
```

- `n % 15` comes first: 15 is divisible by both.
- The function returns text, so the caller decides how to print it.
""",
    """Continuous batching lets requests **join and leave** the running batch at every step:

1. Decode steps of running sequences go first.
2. The rest of the token budget goes to *prefill chunks* of new prompts.
3. A finished sequence frees its KV blocks at once.

So a new tab never waits for another tab's reply to end.
""",
    """A prefix cache keeps the KV of token blocks it has seen, keyed by a hash of the block **and** all the
blocks before it. The next turn of a conversation repeats the whole earlier conversation, so only the new
message needs computing.
""",
]


def fill_history(store, messages: int, title: str = "long") -> str:
    """A conversation of `messages` canned messages in `store` (a tuichat.store.Store), for a long history to
    open, scroll and search; its id."""
    conversation = store.create_conversation(title, "smollm2-135m")
    for index in range(messages // 2):
        store.add_message(conversation, "user", f"question {index}: tell me about thing {index}")
        store.add_message(
            conversation, "assistant", f"Answer {index}.\n\n" + REPLIES[index % len(REPLIES)],
            meta={"model": "smollm2-135m", "ttft_ms": 100.0},
        )
    return conversation


class DemoBackend:
    """Follows the Backend protocol with canned replies. Timings are parameters, and so are `clock` and
    `sleep`: a virtual clock makes the numbers on screen the same on every machine."""

    def __init__(
        self,
        *,
        first_token_s: float = 0.35,
        token_s: float = 0.03,
        load_s: float = 0.8,
        models: Sequence[str] = ("smollm2-135m", "demo-large"),
        replies: Sequence[str] = REPLIES,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] = asyncio.sleep,
    ) -> None:
        self.first_token_s = first_token_s
        self.token_s = token_s
        self.load_s = load_s
        self.models = list(models)
        self.replies = list(replies)
        self.clock = clock
        self.sleep = sleep
        self.loaded: list[str] = []
        self.cancelled: list[str] = []  # conversation ids passed to cancel()
        self.in_flight: set[str] = set()
        self.streams = 0  # replies asked for: a turn sent has reached the backend
        self._cached: dict[str, int] = {}  # conversation -> tokens its KV holds (prompt + reply)
        self._prompt_tokens = 0
        self._hit_tokens = 0

    async def load(self, model: str, progress: ProgressCallback | None = None) -> str:
        if model not in self.models:
            raise TuichatError(f'unknown model "{model}" (the demo has {", ".join(self.models)})')
        steps = 4
        for step in range(steps):
            if progress:
                progress("reading weights", step / steps)
            await self.sleep(self.load_s / steps)
        if progress:
            progress("ready", 1.0)
        self.loaded.append(model)
        return model

    def reply_for(self, messages: Sequence[Message]) -> str:
        question = next((m.content for m in reversed(messages) if m.role == "user"), "")
        return self.replies[hashlib.sha1(question.encode()).digest()[0] % len(self.replies)]

    @staticmethod
    def chunks(text: str) -> list[str]:
        """Word-sized pieces, whitespace kept: like tokens, and joining them gives the text back."""
        return re.findall(r"\s*\S+|\s+$", text)

    def _usage(self, conversation_id: str, messages: Sequence[Message]) -> Usage:
        prompt = sum(len(self.chunks(m.content)) + 4 for m in messages)
        cached = min(self._cached.get(conversation_id, 0), prompt - 1)
        self._prompt_tokens += prompt
        self._hit_tokens += cached
        return Usage(prompt_tokens=prompt, cached_tokens=cached)

    async def stream(
        self,
        conversation_id: str,
        messages: Sequence[Message],
        params: SamplingParams,
        model: str | None = None,
    ) -> AsyncIterator[StreamEvent]:
        self.streams += 1
        if conversation_id in self.cancelled:
            self.cancelled.remove(conversation_id)
        usage = self._usage(conversation_id, messages)
        start = self.clock()
        self.in_flight.add(conversation_id)
        try:
            await self.sleep(self.first_token_s)
            pieces = self.chunks(self.reply_for(messages))[: params.max_tokens]
            for index, piece in enumerate(pieces):
                if conversation_id in self.cancelled:
                    usage.finish_reason = "cancelled"
                    break
                if index:
                    await self.sleep(self.token_s)
                usage.completion_tokens = index + 1
                if index == 0:
                    usage.ttft_ms = (self.clock() - start) * 1000
                yield StreamEvent(piece, self.clock(), replace(usage))
            usage.finish_reason = usage.finish_reason or "stop"
            usage.e2e_ms = (self.clock() - start) * 1000
            self._cached[conversation_id] = usage.prompt_tokens + usage.completion_tokens
            yield StreamEvent("", self.clock(), usage, finished=True)
        finally:
            self.in_flight.discard(conversation_id)

    async def prefill(self, conversation_id: str, messages, model: str | None = None) -> int:
        return 0

    def cancel(self, conversation_id: str) -> None:
        self.cancelled.append(conversation_id)

    def stats(self, model: str | None = None) -> EngineStats:
        running = len(self.in_flight)
        return EngineStats(
            model=model or (self.loaded[-1] if self.loaded else ""),
            device="cpu (demo)",
            dtype="bfloat16",
            running=running,
            waiting=0,
            batch_size=running,
            kv_blocks_used=40 + 96 * running,
            kv_blocks_total=512,
            prefix_hit_rate=self._hit_tokens / self._prompt_tokens if self._prompt_tokens else 0.0,
            tokens_per_s=running / self.token_s if running else 0.0,
        )

    def list_models(self) -> list[ModelInfo]:
        return [ModelInfo(spec, "embedded", "demo model, canned replies") for spec in self.models]

    def sampling_defaults(self, model: str) -> dict:
        return {}

    async def close(self) -> None:
        pass


async def take_screenshots(folder: Path) -> None:
    """The README's screenshots: a streamed reply with its meter, the engine panel while two tabs stream,
    the model picker."""
    from tuichat.config import Config
    from tuichat.store import Store
    from tuichat.ui.app import TuichatApp

    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as data:
        backend = DemoBackend(token_s=0.02, load_s=0.2)
        app = TuichatApp(lambda: backend, Config(), Store(Path(data) / "history.sqlite3"))
        app.animation_level = "none"
        async with app.run_test(size=(110, 34)) as pilot:

            async def ask(text: str) -> None:
                app.active_tab.prompt.text = text
                await pilot.press("enter")
                while not app.active_tab.busy:
                    await pilot.pause(0.05)
                while app.active_tab.busy:
                    await pilot.pause(0.05)

            await ask("Write fizzbuzz in Python, please.")
            await ask("How does continuous batching help tabs?")
            app.clear_notifications()
            await pilot.pause(0.3)
            app.save_screenshot("tuichat-main.svg", str(folder))

            # Two tabs streaming at once. Not pilot.press here: it waits for an idle app, and an app
            # that is streaming is never idle.
            backend.token_s = 0.08
            def send_now(question: str) -> None:
                app.active_tab.prompt.insert(question)
                app.active_tab.prompt.action_send()

            await app.action_new_tab()
            send_now("And what does the prefix cache keep?")
            await asyncio.sleep(0.2)
            app.action_previous_tab()
            send_now("Why does that help a second turn?")
            app.action_toggle_engine()
            await asyncio.sleep(1.5)
            app.clear_notifications()
            await asyncio.sleep(0.6)  # the panel refreshes twice a second
            app.save_screenshot("tuichat-engine-panel.svg", str(folder))
            for tab in app.tabs():
                tab.stop()
            while any(tab.busy for tab in app.tabs()):
                await pilot.pause(0.05)

            await pilot.press("ctrl+b", "ctrl+o")
            await pilot.pause(0.2)
            app.clear_notifications()
            await pilot.pause(0.1)
            app.save_screenshot("tuichat-model-picker.svg", str(folder))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--screenshots", type=Path, metavar="DIR", help="write SVG screenshots to DIR and exit")
    parser.add_argument("--first-token-ms", type=float, default=350)
    parser.add_argument("--token-ms", type=float, default=30)
    args = parser.parse_args()
    if args.screenshots:
        asyncio.run(take_screenshots(args.screenshots))
        return
    from tuichat.config import Config
    from tuichat.store import Store
    from tuichat.ui.app import run_tui

    backend = DemoBackend(first_token_s=args.first_token_ms / 1000, token_s=args.token_ms / 1000)
    # A history of its own, next to the real one: restarts bring the demo's tabs back.
    run_tui(lambda: backend, Config(), Store(paths.data_dir() / "demo-history.sqlite3"), [])


if __name__ == "__main__":
    main()
