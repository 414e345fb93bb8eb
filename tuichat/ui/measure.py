"""What the UI's timing scripts (scripts/ui_latency.py, scripts/ui_long_conversation.py) and the tests of the
behaviour they time share: waiting on the event loop for a condition, timing the frames Textual paints, and the
terminal they run in."""

from __future__ import annotations

import asyncio
import time

from textual.screen import Screen

SIZE = (110, 36)  # columns, rows


async def until(condition, what: str = "condition", *, timeout: float = 10.0) -> None:
    """Wait for the condition a test is about to assert, never for a time: poll `condition()` every 10 ms of the
    loop (asyncio.sleep, not pilot.pause, which forces a full screen refresh each time); fail naming `what`."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class Frames:
    """Times Screen._on_timer_update (layout + compositor update) and _refresh_layout."""

    def __init__(self) -> None:
        self.frames: list[tuple[float, float]] = []  # (end perf_counter, duration ms)
        self.layouts: list[float] = []
        self._on_timer_update = Screen._on_timer_update
        self._refresh_layout = Screen._refresh_layout

    def __enter__(self):
        frames = self

        def on_timer_update(screen):
            start = time.perf_counter()
            frames._on_timer_update(screen)
            end = time.perf_counter()
            frames.frames.append((end, (end - start) * 1000))

        def refresh_layout(screen, *args, **kwargs):
            start = time.perf_counter()
            frames._refresh_layout(screen, *args, **kwargs)
            frames.layouts.append((time.perf_counter() - start) * 1000)

        Screen._on_timer_update = on_timer_update
        Screen._refresh_layout = refresh_layout
        return self

    def __exit__(self, *exc) -> None:
        Screen._on_timer_update = self._on_timer_update
        Screen._refresh_layout = self._refresh_layout

    def clear(self) -> None:
        self.frames.clear()
        self.layouts.clear()
