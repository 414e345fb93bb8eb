"""The one way tests wait: for the condition they are about to assert, never for a time."""

from __future__ import annotations

import asyncio
import time


async def until(condition, timeout: float = 10.0, what: str = "condition") -> None:
    """Wait until `condition()` holds, checking every 10 ms of the loop. asyncio.sleep, not pilot.pause:
    that forces a full screen refresh on every poll."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
