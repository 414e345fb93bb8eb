"""Snapshot tests of the main screens. Deterministic: a VirtualClock drives both the fake backend and the
meter, replies are held until the first token is painted (so TTFT is exact), animations and the cursor
blink are off, and notifications are cleared before the picture. Update with `--snapshot-update`."""

from __future__ import annotations

import asyncio

import pytest

from tests.fake_backend import FakeBackend, VirtualClock
from tuichat.config import Config
from tuichat.store import Store
from tuichat.ui.app import TuichatApp
from tuichat.ui.demo import REPLIES
from tuichat.ui.measure import until

SIZE = (110, 34)


@pytest.fixture(autouse=True)
def tuichat_dirs(tmp_path, monkeypatch):
    for name in ("config", "data", "cache"):
        monkeypatch.setenv(f"TUICHAT_{name.upper()}_DIR", str(tmp_path / name))


def snapshot_app() -> TuichatApp:
    clock = VirtualClock()
    backend = FakeBackend(first_token_s=0.31, token_s=0.024, clock=clock, sleep=clock.sleep)
    app = TuichatApp(lambda: backend, Config(), Store(), clock=clock)
    app.animation_level = "none"
    return app


async def chat(pilot, *turns: tuple[str, str]) -> None:
    """Each turn: (question, canned reply). Holding after the first token lets its paint happen before the
    virtual clock moves on, so the TTFT shown is exactly first_token_s."""
    app = pilot.app
    await until(lambda: app.backend is not None and "smollm2-135m" in app.backend.loaded)
    backend = app.backend
    for question, reply in turns:
        backend.replies = [reply]
        backend.hold = asyncio.Event()
        meter = app.active_tab.meter
        app.active_tab.prompt.insert(question)
        await pilot.press("enter")
        await until(lambda: meter.turn is not None and meter.turn.t_first is not None)
        backend.hold.set()
        await until(lambda: not app.active_tab.busy)


async def settle(pilot) -> None:
    pilot.app.clear_notifications()
    await until(lambda: not pilot.app.screen.query("Toast"), what="the notifications gone")


def test_main_screen_after_two_turns(snap_compare):
    async def run_before(pilot):
        await chat(pilot, ("Write fizzbuzz in Python", REPLIES[0]), ("Why does batching help tabs?", REPLIES[1]))
        await settle(pilot)

    assert snap_compare(snapshot_app(), terminal_size=SIZE, run_before=run_before)


def test_engine_panel(snap_compare):
    async def run_before(pilot):
        await chat(pilot, ("What does the prefix cache keep?", REPLIES[2]), ("And then?", REPLIES[2]))
        await pilot.press("ctrl+b")
        await settle(pilot)

    assert snap_compare(snapshot_app(), terminal_size=SIZE, run_before=run_before)


def test_model_picker(snap_compare):
    async def run_before(pilot):
        await until(lambda: "demo-large" in pilot.app.known_models)
        await pilot.press("ctrl+o", "d", "e")
        await settle(pilot)

    assert snap_compare(snapshot_app(), terminal_size=SIZE, run_before=run_before)


def test_help_screen(snap_compare):
    async def run_before(pilot):
        await pilot.press("f1")
        await settle(pilot)

    assert snap_compare(snapshot_app(), terminal_size=SIZE, run_before=run_before)
