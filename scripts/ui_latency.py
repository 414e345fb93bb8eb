"""How fast a key reaches the prompt, idle and while tabs stream, measured: `python scripts/ui_latency.py [tabs]`,
on the demo backend (tuichat/ui/demo.py) in temporary folders: the same keys typed at
a fast typist's pace into an idle app, then with the tabs streaming long replies at 100 tokens/s each; the time
from a key event entering the app to its character in the prompt's document, and the ratio of the medians.
tests/test_ui_latency.py asserts the behaviour this times (a key never waits for the streams)."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

from textual import events
from textual.widgets import TextArea

from tuichat.config import Config
from tuichat.store import Store
from tuichat.ui.app import TuichatApp
from tuichat.ui.demo import REPLIES, DemoBackend
from tuichat.ui.measure import until

KEYS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMN"


async def type_keys(app, inserted: dict[str, float]) -> list[float]:
    """Post each key as the terminal would; ms until it is in the prompt."""
    latencies = []
    for character in KEYS:
        inserted.pop(character, None)
        sent = time.perf_counter()
        app.post_message(events.Key(character, character))
        await until(lambda: character in inserted, what=f"{character!r} in the prompt")
        latencies.append((inserted[character] - sent) * 1000)
        await asyncio.sleep(0.03)  # the typist's pace
    return latencies


def summary(values: list[float]) -> str:
    values = sorted(values)
    return f"p50 {statistics.median(values):.1f} ms, p90 {values[int(len(values) * 0.9)]:.1f} ms, max {values[-1]:.1f} ms"


async def measure(tabs: int) -> None:
    backend = DemoBackend(first_token_s=0.05, token_s=0.01, load_s=0.02, replies=["\n\n".join(REPLIES * 8)])
    inserted: dict[str, float] = {}

    def hook(message) -> None:
        if isinstance(message, TextArea.Changed) and message.text_area.text:
            inserted.setdefault(message.text_area.text[-1], time.perf_counter())

    app = TuichatApp(lambda: backend, Config(), Store())
    app.animation_level = "none"
    async with app.run_test(size=(110, 36), message_hook=hook):
        await until(lambda: "smollm2-135m" in backend.loaded, what="model")
        idle = await type_keys(app, inserted)
        app.active_tab.prompt.clear()
        for index in range(tabs):
            if index:
                await app.action_new_tab()
            app.active_tab.prompt.insert(f"tab {index}")
            app.active_tab.prompt.action_send()
            await until(lambda: app.active_tab.busy, what=f"tab {index} sent")
        await until(lambda: all(tab.meter.turn.tokens >= 20 for tab in app.tabs()), what="every tab streaming",
                    timeout=60)
        streaming = await type_keys(app, inserted)
        still = len(backend.in_flight)
        streamed = [tab.meter.turn.tokens for tab in app.tabs()]
        for tab in app.tabs():
            tab.stop()
    print(f"key → prompt idle: {summary(idle)}")
    print(f"key → prompt with {tabs} tabs streaming ({still} still at the end; tokens per tab: {streamed}): "
          f"{summary(streaming)}")
    print(f"streaming ÷ idle, p50: {statistics.median(streaming) / statistics.median(idle):.2f}×")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tabs", type=int, nargs="?", default=4, help="tabs streaming while the keys are typed")
    args = parser.parse_args()
    for name in ("CONFIG", "DATA", "CACHE"):
        os.environ[f"TUICHAT_{name}_DIR"] = tempfile.mkdtemp()
    asyncio.run(measure(args.tabs))
