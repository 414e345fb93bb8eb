"""Long conversations: a tab mounts only its last WINDOW messages, so a frame costs the same at turn 150 as
at turn 10; earlier messages mount on demand, and the model still sees them all.

The tests assert behaviour, not timings; scripts/ui_long_conversation.py measures them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
from textual.widgets import Markdown

from tests.fake_backend import FakeBackend
from tuichat.config import Config
from tuichat.store import Store
from tuichat.ui.app import TuichatApp
from tuichat.ui.demo import fill_history
from tuichat.ui.measure import SIZE, until
from tuichat.ui.message_log import PAGE, WINDOW, EarlierMessages
from tuichat.ui.messages import AssistantMessage, UserMessage
from tuichat.ui.pacing import PaintPacer


@pytest.fixture(autouse=True)
def tuichat_dirs(tmp_path, monkeypatch):
    for name in ("config", "data", "cache"):
        monkeypatch.setenv(f"TUICHAT_{name.upper()}_DIR", str(tmp_path / name))


def long_app(messages: int = 300, **backend_args) -> tuple[TuichatApp, FakeBackend, str]:
    store = Store()
    conversation = fill_history(store, messages)
    store.set_setting("active_conversation", conversation)
    backend = FakeBackend(**backend_args)
    app = TuichatApp(lambda: backend, Config(), store)
    app.animation_level = "none"
    return app, backend, conversation


def mounted_ids(tab) -> list[int]:
    return [widget.message_id for widget in tab._messages()]


async def test_a_restored_long_tab_mounts_only_its_last_messages_and_the_model_sees_them_all():
    app, backend, conversation = long_app(300)
    rows = app.store.messages(conversation)
    async with app.run_test(size=SIZE) as pilot:
        tab = app.active_tab
        assert mounted_ids(tab) == [row.id for row in rows[-WINDOW:]]
        assert tab.earlier_count == 300 - WINDOW
        bar = tab.query_one(EarlierMessages)
        assert bar.display and f"{300 - WINDOW} earlier messages" in str(bar.render())
        assert tab.prompt.prompt_history[0] == rows[0].content  # ↑ still reaches the first prompt
        tab.prompt.insert("and now?")
        await pilot.press("enter")
        await until(lambda: backend.calls and not tab.busy, what="reply")
        sent = backend.calls[-1]["messages"]
        assert [m.content for m in sent if m.role != "system"] == [row.content for row in rows] + ["and now?"]
        # A new turn keeps the window: the oldest mounted messages went back above it.
        assert len(tab._messages()) == WINDOW and tab.earlier_count == 300 - WINDOW + 2
        assert stored_roles(app, conversation)[-2:] == ["user", "assistant"]


def stored_roles(app, conversation: str) -> list[str]:
    return [row.role for row in app.store.messages(conversation)]


TOTAL = WINDOW + 3 * PAGE


async def test_earlier_messages_mount_a_page_at_a_time_when_scrolled_to_the_top_or_paged_up():
    app, _, conversation = long_app(TOTAL)
    rows = app.store.messages(conversation)
    async with app.run_test(size=SIZE) as pilot:
        tab = app.active_tab
        log = tab.log_view
        first = tab._messages()[0]
        log.scroll_home(animate=False)  # as the mouse wheel or scrollbar would
        await until(lambda: len(tab._messages()) == WINDOW + PAGE, what="a page by scrolling to the top")
        assert mounted_ids(tab) == [row.id for row in rows[-(WINDOW + PAGE) :]]
        # The view stays on the same text (the first region shows it once the scroll is composited).
        await until(
            lambda: log.scroll_y > 0 and first.region.overlaps(log.region), what="the view to keep its place"
        )
        # PageUp in the prompt: up to the top, then once more mounts the next page.
        for _ in range(100):
            tab.prompt.action_scroll_log(-1)
            await pilot.pause()
            if len(tab._messages()) > WINDOW + PAGE:
                break
        assert mounted_ids(tab) == [row.id for row in rows[-(WINDOW + 2 * PAGE) :]]
        assert tab.earlier_count == TOTAL - WINDOW - 2 * PAGE
        bar = tab.query_one(EarlierMessages)
        await until(lambda: f"{tab.earlier_count} earlier messages" in str(bar.render()), what="the ▲ count")
        for _ in range(-(-tab.earlier_count // PAGE)):  # a page a time, counted: a show that mounts none fails below
            await tab.show_earlier()
        assert mounted_ids(tab) == [row.id for row in rows]
        assert not tab.query_one(EarlierMessages).display  # nothing left above: the ▲ line goes


async def test_a_click_on_the_earlier_line_mounts_a_page():
    store = Store()
    conversation = store.create_conversation("short lines", "smollm2-135m")
    for index in range(WINDOW + 4):
        store.add_message(conversation, "user" if index % 2 == 0 else "assistant", f"line {index}")
    app = TuichatApp(lambda: FakeBackend(), Config(), store)
    app.animation_level = "none"
    async with app.run_test(size=(110, 120)) as pilot:  # tall: the window does not fill the log
        tab = app.active_tab
        assert tab.log_view.max_scroll_y == 0 and tab.earlier_count == 4
        await pilot.click(EarlierMessages)
        await until(lambda: tab.earlier_count == 0, what="the page above")
        assert [w.text for w in tab._messages()] == [f"line {index}" for index in range(WINDOW + 4)]


async def test_search_opens_a_hit_far_above_the_window():
    app, _, conversation = long_app(150)
    store = app.store
    rows = store.messages(conversation)
    old = rows[60]
    store.update_message(old.id, content=old.content + " with the word quokka")
    async with app.run_test(size=SIZE) as pilot:
        tab = app.active_tab
        assert old.id not in mounted_ids(tab)
        await pilot.press("ctrl+f", *"quokka")
        await until(lambda: app.screen.query_one("OptionList").option_count > 0, what="hits")
        await pilot.press("enter")
        await until(lambda: old.id in mounted_ids(tab), what="the hit mounted")
        widget = tab.query_one(f"#msg-{old.id}")
        await until(lambda: widget.has_class("-found"), what="the hit highlighted")
        log = tab.log_view
        await until(lambda: log.region.contains_region(widget.region), what="the hit in view")
        # Mounted from a little above it down to the window, in order, nothing twice.
        assert mounted_ids(tab) == [row.id for row in rows[60 - PAGE // 2 :]]


async def test_edit_last_and_regenerate_work_whatever_is_mounted():
    app, backend, conversation = long_app(2 * WINDOW + 4)
    rows = app.store.messages(conversation)
    async with app.run_test(size=SIZE) as pilot:
        tab = app.active_tab
        await until(lambda: "smollm2-135m" in backend.loaded, what="model")
        await pilot.press("ctrl+g")
        assert tab.prompt.text == rows[-2].content
        assert len(tab._messages()) == WINDOW  # the window is filled back from above
        assert mounted_ids(tab) == [row.id for row in rows[-2 - WINDOW : -2]]
        tab.prompt.clear()
        await pilot.press("ctrl+r")
        await until(lambda: len(backend.calls) == 1 and not tab.busy, what="regenerated")
        assert [m.content for m in backend.calls[0]["messages"]] == [row.content for row in rows[:-3]]
        assert isinstance(tab._messages()[-1], AssistantMessage) and isinstance(tab._messages()[-2], UserMessage)


async def test_a_hidden_tab_paints_its_streamed_text_when_shown():
    """A reply streaming in a hidden tab would lay out the shown one on every token: its text waits."""
    app, backend, _ = long_app(4, first_token_s=1.0, token_s=0.001)
    backend.hold, backend.hold_after = asyncio.Event(), 6
    async with app.run_test(size=SIZE) as pilot:
        first = app.active_tab
        await until(lambda: "smollm2-135m" in backend.loaded, what="model")
        first.prompt.insert("stream while hidden")
        await pilot.press("enter", "ctrl+t")
        await until(lambda: first.busy and len(first.last_reply()._chunks) >= 6, what="six tokens")
        reply = first.last_reply()
        markdown = reply.query_one(Markdown)
        assert app.active_tab is not first and markdown.source == ""
        await pilot.press("ctrl+pageup")
        await until(lambda: markdown.source == reply.text, what="painted once shown")
        backend.hold.set()
        await until(lambda: not first.busy, what="reply finished")
        assert markdown.source == reply.text == app.store.messages(first.conversation_id)[-1].content




async def test_a_fast_stream_is_painted_in_bursts_and_its_first_token_at_once(monkeypatch):
    """Each paint of a streaming reply lays out the screen: tokens arriving faster than the pacer's shortest
    pause share one."""
    reply_text = " ".join(f"word{index}" for index in range(600))
    app, backend, _ = long_app(4, first_token_s=0.05, token_s=0.001, replies=[reply_text])
    appended: list[tuple[Markdown, str, float]] = []
    append = Markdown.append

    def recording_append(markdown, text):
        appended.append((markdown, text, time.monotonic()))
        return append(markdown, text)

    monkeypatch.setattr(Markdown, "append", recording_append)
    async with app.run_test(size=SIZE) as pilot:
        tab = app.active_tab
        await until(lambda: "smollm2-135m" in backend.loaded, what="model")
        tab.sampling = replace(tab.sampling, max_tokens=10_000)
        tab.prompt.insert("go")
        await pilot.press("enter")
        await until(lambda: tab.last_reply() is not None and not tab.busy, what="reply finished")
        finished = time.monotonic()
        markdown = tab.last_reply().query_one(Markdown)
        assert markdown.source == reply_text
    painted = [text for widget, text, _ in appended if widget is markdown]
    first_painted = next(t for widget, _, t in appended if widget is markdown)
    assert painted[0] == "word0"  # the first token alone, at once: TTFT is not delayed
    assert reply_text.startswith("".join(painted))  # the rest came with the one full render at the end
    # However fast this machine streams: after the first token, no more paints than one per shortest pause.
    most = (finished - first_painted) / PaintPacer.SHORTEST + 1
    assert len(painted) <= most, (len(painted), most)
