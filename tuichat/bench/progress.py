"""The run's progress on stderr, one step per measurement."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, one line per step otherwise."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.started = time.perf_counter()
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.label = ""

    def _draw(self) -> None:
        if not self.enabled:
            return
        fraction = min(self.done / self.total, 1.0)
        elapsed = time.perf_counter() - self.started
        clock = f"{int(elapsed // 60)}:{int(elapsed % 60):02d}"
        if self.tty:
            width = 24
            filled = round(width * fraction)
            bar = "█" * filled + "░" * (width - filled)
            self.stream.write(f"\r\033[K[bench] {bar} {fraction:4.0%} {clock}  {self.label}")
        else:
            self.stream.write(f"[bench {self.done}/{self.total} {fraction:4.0%} {clock}] {self.label}\n")
        self.stream.flush()

    def start(self, label: str) -> None:
        self.label = label
        self._draw()

    def advance(self) -> None:
        self.done += 1
        if self.tty:
            self._draw()

    def step(self, label: str):
        progress = self

        class _Step:
            def __enter__(self):
                progress.start(label)

            def __exit__(self, *exc):
                progress.advance()
                return False

        return _Step()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.label = "done"
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
