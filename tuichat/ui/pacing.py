"""How often a streaming reply is painted.

A streamed chunk changes the reply's height, so each paint lays out and renders the whole screen on the UI
thread. Where the engine's threads hold every core (a laptop, this project's 2-core CI machine), that time is
taken from decode steps: the engine's threads meet at a barrier after every layer, so one of them preempted
by the UI stalls the whole step: the engine loses about the share of a core the UI thread takes (the figures
are in docs/design/painting.md). The cost of a paint depends on the machine, the terminal size and what the
tab shows, so the pause between paints is not fixed: it follows the UI thread's own CPU time.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class PaintPacer:
    """The pause between two paints of a streaming reply. It starts at SHORTEST. Every WINDOW_S of paints it
    looks at the share of a core the UI thread used meanwhile: over BUDGET, the pause doubles; under half of
    it (so that twice the paints would still fit), it halves; always within [SHORTEST, LONGEST]. The first
    token is painted at once (TTFT), and LONGEST keeps the text looking live."""

    SHORTEST = 0.05
    LONGEST = 0.4
    BUDGET = 0.15  # of one core: room for taking tokens in and a few paints a second (docs/design/painting.md)
    WINDOW_S = 0.5  # one paint's share is noise (a block mounted, a store write): judge a few together
    QUIET_S = 1.0  # a paint after a longer quiet spell (a new reply, a tab shown again) starts a new window

    def __init__(
        self,
        *,
        cpu_clock: Callable[[], float] = time.thread_time,  # CPU time of the thread that paints: the UI's
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cpu_clock = cpu_clock
        self._clock = clock
        self.pause = self.SHORTEST
        self._painted_at: float | None = None
        self._window: tuple[float, float] = (0.0, 0.0)  # (clock, cpu_clock) when the window began

    def wait(self) -> float:
        """Seconds until the next paint is due (≤ 0: now)."""
        if self._painted_at is None:
            return 0.0
        return self.pause - (self._clock() - self._painted_at)

    def painted(self) -> None:
        now, cpu = self._clock(), self._cpu_clock()
        began, cpu_began = self._window
        if self._painted_at is None or now - self._painted_at > self.QUIET_S:
            self._window = (now, cpu)
        elif now - began >= self.WINDOW_S:
            share = (cpu - cpu_began) / (now - began)
            if share > self.BUDGET:
                self.pause = min(self.pause * 2, self.LONGEST)
            elif share * 2 < self.BUDGET:
                self.pause = max(self.pause / 2, self.SHORTEST)
            self._window = (now, cpu)
        self._painted_at = now
