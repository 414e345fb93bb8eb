"""The run's progress on stderr, one step per measurement."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

import rich.progress
from rich.console import Console


class Progress:
    """rich's progress bar on a terminal, redrawn in place; one plain line per step otherwise (a log keeps every
    step, with no control codes). Redrawn only when a step starts or ends: a refresh thread would take the GIL
    from the engine's thread in the middle of a measurement."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.enabled = enabled
        self.started = time.perf_counter()
        self.console = Console(file=stream if stream is not None else sys.stderr, markup=False, highlight=False,
                               emoji=False)
        self.tty = enabled and self.console.is_terminal
        self.bar: rich.progress.Progress | None = None

    def start(self, label: str) -> None:
        if not self.enabled:
            return
        if not self.tty:
            elapsed = time.perf_counter() - self.started
            self.console.print(f"[bench {self.done}/{self.total} {min(self.done / self.total, 1.0):4.0%} "
                               f"{int(elapsed // 60)}:{int(elapsed % 60):02d}] {label}", soft_wrap=True)
            return
        if self.bar is None:  # started with the first step: nothing to stop if the run fails before it
            # stdout stays the report's (and --json's) alone; stray stderr lines print above the bar.
            self.bar = rich.progress.Progress(
                rich.progress.TextColumn("[bench]", markup=False), rich.progress.BarColumn(bar_width=24),
                rich.progress.TaskProgressColumn(), rich.progress.TimeElapsedColumn(),
                rich.progress.TextColumn("{task.description}", markup=False),
                console=self.console, auto_refresh=False, redirect_stdout=False,
            )
            self.task = self.bar.add_task(label, total=self.total)
            self.bar.start()
        else:
            self.bar.update(self.task, description=label, refresh=True)

    def advance(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(self.task, advance=1, refresh=True)

    @contextmanager
    def step(self, label: str) -> Iterator[None]:
        self.start(label)
        try:
            yield
        finally:
            self.advance()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description="done")
            self.bar.stop()  # drawn once more, left on screen
            self.bar = None
