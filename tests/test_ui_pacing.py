"""The paint pacer: a streaming reply is painted as often as the UI thread's CPU budget allows, and the TTFT
meter redraws no more often than the reply. The pacer runs on fake clocks here: paints cost what a test says."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from tests.fake_backend import FakeBackend
from tests.test_ui import make_app, send
from tuichat.ui.measure import until
from tuichat.ui.pacing import PaintPacer
from tuichat.ui.widgets import TtftMeter

TOKEN_S = 0.01  # tokens arrive this often: a paint is due at the first token after its pause


class Clocks:
    def __init__(self) -> None:
        self.now = 100.0
        self.cpu = 0.0


def stream(pacer: PaintPacer, clocks: Clocks, seconds: float, paint_cpu_s: float) -> list[float]:
    """A reply streaming for `seconds`, each paint costing `paint_cpu_s` of UI CPU. Returns the pause after
    each paint."""
    pauses = []
    end = clocks.now + seconds
    while clocks.now < end:
        clocks.now += TOKEN_S
        if pacer.wait() <= 0:
            pacer.painted()
            clocks.cpu += paint_cpu_s
            pauses.append(pacer.pause)
    return pauses


def make_pacer() -> tuple[PaintPacer, Clocks]:
    clocks = Clocks()
    return PaintPacer(cpu_clock=lambda: clocks.cpu, clock=lambda: clocks.now), clocks


def test_cheap_paints_keep_the_shortest_pause():
    pacer, clocks = make_pacer()
    assert pacer.wait() <= 0  # the first token is painted at once
    pauses = stream(pacer, clocks, 5, paint_cpu_s=0.002)  # 4 % of a core at 20 paints/s
    assert set(pauses) == {PaintPacer.SHORTEST}


def test_costly_paints_lengthen_the_pause_to_fit_the_budget_and_it_settles():
    pacer, clocks = make_pacer()
    # 10 ms a paint: 20 paints/s would take 20 % of a core, 10/s takes 10 %.
    pauses = stream(pacer, clocks, 8, paint_cpu_s=0.010)
    assert pauses[-1] == 2 * PaintPacer.SHORTEST
    settled = pauses[len(pauses) // 2 :]
    assert set(settled) == {2 * PaintPacer.SHORTEST}  # no swinging back and forth
    cpu_before, start = clocks.cpu, clocks.now
    stream(pacer, clocks, 4, paint_cpu_s=0.010)
    assert (clocks.cpu - cpu_before) / (clocks.now - start) <= PaintPacer.BUDGET


def test_very_costly_paints_stop_at_the_longest_pause():
    pacer, clocks = make_pacer()
    pauses = stream(pacer, clocks, 8, paint_cpu_s=0.2)
    assert max(pauses) == pauses[-1] == PaintPacer.LONGEST


def test_the_pause_comes_back_down_when_paints_get_cheap_and_a_quiet_spell_changes_nothing():
    pacer, clocks = make_pacer()
    stream(pacer, clocks, 8, paint_cpu_s=0.2)
    clocks.now += 30  # the user reads; nothing streams
    assert pacer.wait() <= 0  # the next reply's first token is painted at once
    # The quiet spell is not a window of low share: the pause stays where the same paints had put it.
    assert stream(pacer, clocks, 0.6, paint_cpu_s=0.2)[-1] == PaintPacer.LONGEST
    pauses = stream(pacer, clocks, 5, paint_cpu_s=0.001)  # a smaller screen, say
    assert pauses[-1] == PaintPacer.SHORTEST


async def test_the_meter_redraws_no_more_often_than_the_reply_is_painted(monkeypatch):
    monkeypatch.setattr(PaintPacer, "SHORTEST", 0.4)
    monkeypatch.setattr(PaintPacer, "LONGEST", 0.4)
    redraws: list[float] = []  # when the meter redrew after the first token
    redraw = TtftMeter._redraw

    def recording_redraw(meter):
        if meter._turn is not None and meter._turn.t_first is not None:
            redraws.append(time.monotonic())
        return redraw(meter)

    monkeypatch.setattr(TtftMeter, "_redraw", recording_redraw)
    reply = " ".join(f"w{index}" for index in range(250))
    app, backend = make_app(FakeBackend(token_s=0.005, replies=[reply]))  # 200 tokens/s, for 1.25 s
    async with app.run_test() as pilot:
        await until(lambda: "smollm2-135m" in backend.loaded, what="model")
        tab = app.active_tab
        tab.sampling = replace(tab.sampling, max_tokens=1000)
        await send(pilot, "go")
        await until(lambda: tab.last_reply() is not None and not tab.busy, timeout=10, what="reply")
    # The first token and the end, and in between no more than one every 0.4 s, however long the stream
    # took here; every 50 ms (the meter's own limit) would be ~25 for a 1.25 s stream.
    most = (redraws[-1] - redraws[0]) / 0.4 + 2
    assert 2 <= len(redraws) <= most, (len(redraws), most)


@pytest.mark.parametrize("share", [PaintPacer.BUDGET * 1.01, PaintPacer.BUDGET * 0.49])
def test_one_window_moves_the_pause_one_step(share):
    pacer, clocks = make_pacer()
    pacer.painted()
    pacer.pause = 0.1
    clocks.now += PaintPacer.WINDOW_S
    clocks.cpu += share * PaintPacer.WINDOW_S
    pacer.painted()  # (the window was one long pause: a test's shortcut)
    assert pacer.pause == (0.2 if share > PaintPacer.BUDGET else PaintPacer.SHORTEST)
