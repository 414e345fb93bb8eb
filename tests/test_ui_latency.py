"""Typing stays responsive while several tabs stream: with four tabs streaming long replies, each key typed
reaches the prompt's document, in order, before the streams have sent the tokens let through just before it:
a key never waits for the streams. The unit is tokens, not milliseconds, so the test says the same on any
machine; scripts/ui_latency.py measures the milliseconds, idle and streaming."""

from __future__ import annotations

from dataclasses import replace

import pytest
from textual import events
from textual.widgets import TextArea

from tests.fake_backend import FakeBackend, Tap
from tuichat.config import Config
from tuichat.store import Store
from tuichat.ui.app import TuichatApp
from tuichat.ui.demo import REPLIES
from tuichat.ui.measure import until

TABS = 4
KEYS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMN"
ROUND = 10  # tokens each stream may send per key: many times what the streams send while a key goes in


@pytest.fixture(autouse=True)
def tuichat_dirs(tmp_path, monkeypatch):
    for name in ("config", "data", "cache"):
        monkeypatch.setenv(f"TUICHAT_{name.upper()}_DIR", str(tmp_path / name))


async def test_each_key_reaches_the_prompt_before_the_streams_send_what_they_were_let_through():
    backend = FakeBackend(first_token_s=0.05, token_s=0.002, replies=["\n\n".join(REPLIES * 8)])
    backend.tap = Tap()
    heard: dict[str, int] = {}  # the prompt's text -> the tokens streamed when the app was first told of it

    def hook(message) -> None:
        if isinstance(message, TextArea.Changed):
            heard.setdefault(message.text_area.text, backend.sent)

    app = TuichatApp(lambda: backend, Config(), Store())
    app.animation_level = "none"
    async with app.run_test(size=(110, 36), message_hook=hook):
        await until(lambda: "smollm2-135m" in backend.loaded, what="model")
        # Not pilot.press: it waits for the app to be idle, which it is not while replies stream.
        for index in range(TABS):
            if index:
                await app.action_new_tab()
            app.active_tab.sampling = replace(app.active_tab.sampling, max_tokens=10_000)
            app.active_tab.prompt.insert(f"tab {index}")
            app.active_tab.prompt.action_send()
            await until(lambda: app.active_tab.busy, what=f"tab {index} sent")
        await until(lambda: backend.sent == TABS, what="every tab's first token")  # then each waits at the tap

        prompt = app.active_tab.prompt
        for typed, character in enumerate(KEYS, 1):
            before = backend.sent
            backend.tap.allow(ROUND)
            app.post_message(events.Key(character, character))
            await until(lambda: KEYS[:typed] in heard, what=f"{character!r} in the prompt")
            assert heard[KEYS[:typed]] < before + TABS * ROUND, "the key waited for the streams"
            await until(lambda: backend.sent == before + TABS * ROUND, what="the streams to send what they may")
        assert prompt.text == KEYS  # every key, in order
        assert len(backend.in_flight) == TABS and all(tab.busy for tab in app.tabs())  # streaming throughout
        for tab in app.tabs():
            tab.stop()
