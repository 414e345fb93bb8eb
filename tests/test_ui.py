"""Pilot tests of the TUI over FakeBackend: what a user does, what the store and the backend then see."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from textual.widgets import Markdown, Static

from tests.fake_backend import SHORT_REPLIES, FakeBackend, Tap, VirtualClock
from tuichat.backends.protocol import CHAT_SAMPLING, EngineStats, SamplingParams, Usage
from tuichat.config import Config
from tuichat.store import Store
from tuichat.ui.app import TuichatApp
from tuichat.ui.chat import ChatTab
from tuichat.ui.measure import until
from tuichat.ui.messages import AssistantMessage, UserMessage
from tuichat.ui.pacing import PaintPacer
from tuichat.ui.screens import HelpScreen, ModelPicker, SamplingScreen, SearchScreen
from tuichat.ui.turns import sampling_key
from tuichat.ui.widgets import EnginePanel, TtftMeter

SIZE = (110, 36)


@pytest.fixture(autouse=True)
def tuichat_dirs(tmp_path, monkeypatch) -> Path:
    for name in ("config", "data", "cache"):
        monkeypatch.setenv(f"TUICHAT_{name.upper()}_DIR", str(tmp_path / name))
    return tmp_path


def make_app(backend: FakeBackend | None = None, *, config: Config | None = None, warnings=(), **kwargs):
    backend = backend or FakeBackend()
    app = TuichatApp(lambda: backend, config or Config(), Store(), list(warnings), **kwargs)
    app.animation_level = "none"
    return app, backend


async def send(pilot, text: str) -> None:
    """Type a message as a paste (one event) and press Enter."""
    pilot.app.active_tab.prompt.insert(text)
    await pilot.press("enter")


async def send_and_wait(pilot, text: str) -> AssistantMessage:
    app = pilot.app
    tab = app.active_tab
    before = len(stored(app, tab))
    await send(pilot, text)

    def answered() -> bool:
        rows = stored(app, tab)
        return len(rows) == before + 2 and rows[-1].status != "streaming" and not tab.busy

    await until(answered, what="reply finished")
    return tab.last_reply()


def notifications(app) -> str:
    return "\n".join(f"{n.title}: {n.message}" for n in app._notifications)


def stored(app, tab: ChatTab | None = None):
    tab = tab or app.active_tab
    return app.store.messages(tab.conversation_id)


# --- start-up ---------------------------------------------------------------------------------------


async def test_first_frame_does_not_wait_for_the_backend_and_early_message_waits_for_load():
    """The factory (torch import in real life) runs in a thread and here returns only when the test says;
    the UI is up meanwhile, takes typing, and a message sent early is answered once the backend is there."""
    release, returned = threading.Event(), threading.Event()
    backend = FakeBackend()

    def slow_factory():
        release.wait(30)
        returned.set()
        return backend

    app = TuichatApp(slow_factory, Config(), Store())
    app.animation_level = "none"
    async with app.run_test(size=SIZE) as pilot:
        # The first frame is up while the factory has not returned: it did not wait for it.
        assert "starting the engine" in str(app.active_tab.query_one(".model-bar").render())
        await send(pilot, "early bird")
        meter_text = app.active_tab.meter.query_one("#meter-text")
        await until(lambda: app.active_tab.busy and "waiting" in str(meter_text.render()), what="the wait shown")
        assert not returned.is_set() and not backend.calls
        release.set()
        await until(lambda: not app.active_tab.busy, what="reply")
        assert backend.calls[0]["messages"][-1].content == "early bird"
        assert stored(app)[-1].status == "done"


def test_tui_never_imports_torch():
    """In a fresh interpreter: start the app on the fake backend, chat once, and look at sys.modules."""
    script = """
import asyncio, os, sys, tempfile
for name in ("CONFIG", "DATA", "CACHE"):
    os.environ[f"TUICHAT_{name}_DIR"] = tempfile.mkdtemp()
from tests.fake_backend import SHORT_REPLIES, FakeBackend
from tuichat.config import Config
from tuichat.store import Store
from tuichat.ui.app import TuichatApp

async def main():
    app = TuichatApp(FakeBackend, Config(), Store())
    async with app.run_test() as pilot:
        app.active_tab.prompt.insert("hello")
        await pilot.press("enter")
        while app.backend is None or not app.backend.calls or app.active_tab.busy:
            await pilot.pause(0.02)
    print("torch" in sys.modules, "transformers" in sys.modules)

asyncio.run(main())
"""
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


# --- streaming and the meter ------------------------------------------------------------------------


async def test_meter_shows_real_ttft_from_enter_to_first_token():
    # A first token long enough to see the wait counting even on a loaded machine.
    app, backend = make_app(FakeBackend(first_token_s=1.0))
    async with app.run_test(size=SIZE) as pilot:
        await until(lambda: "smollm2-135m" in backend.loaded, what="model load")
        meter = app.active_tab.meter
        meter_text = meter.query_one("#meter-text")
        before_enter = time.monotonic()
        await send(pilot, "how fast?")
        await until(lambda: "waiting" in str(meter_text.render()), what="the wait shown")
        await until(lambda: meter.turn.t_first is not None, what="the first token painted")
        seen_ms = (time.monotonic() - before_enter) * 1000
        await until(lambda: not app.active_tab.busy)
        ttft = meter.turn.ttft_ms
        # No faster than the backend's first token, no slower than the test saw it painted.
        assert 1000 <= ttft <= seen_ms, (ttft, seen_ms)
        assert f"TTFT {ttft:,.0f} ms" in str(meter_text.render())
        assert stored(app)[-1].meta["ttft_ms"] == pytest.approx(ttft, abs=0.1)


async def test_meter_numbers_on_a_virtual_clock():
    """With time that only moves when the backend sleeps, every number is exact."""
    clock = VirtualClock()
    backend = FakeBackend(first_token_s=0.25, token_s=0.02, clock=clock, sleep=clock.sleep)
    backend.hold = asyncio.Event()
    app, _ = make_app(backend, clock=clock)
    async with app.run_test(size=SIZE) as pilot:
        meter: TtftMeter = app.active_tab.meter
        await until(lambda: "smollm2-135m" in backend.loaded, what="model load")  # or TTFT includes it
        await send(pilot, "numbers")
        await until(lambda: meter.turn is not None and meter.turn.t_first is not None, what="first token")
        backend.hold.set()
        await until(lambda: not app.active_tab.busy)
        text = str(meter.query_one("#meter-text").render())
        tokens = len(backend.chunks(backend.reply_for(backend.calls[-1]["messages"])))
        assert "TTFT 250 ms" in text and "ITL 20 ms" in text and "50.0 tok/s" in text
        assert f"{tokens} tok" in text


async def test_streamed_reply_is_complete_rendered_and_stored():
    expected = SHORT_REPLIES[0]  # with a code block
    app, backend = make_app(FakeBackend(token_s=0.001, replies=[expected]))
    async with app.run_test(size=SIZE) as pilot:
        reply = await send_and_wait(pilot, "fizzbuzz")
        assert reply.text == expected
        assert reply.query_one(Markdown).source == expected  # the last tokens were not dropped
        assert [block.code for block in reply.code_blocks()] == ['print("hi")']
        rows = stored(app)
        assert [(r.role, r.status) for r in rows] == [("user", "done"), ("assistant", "done")]
        assert rows[-1].content == expected
        assert app.active_tab.title == "fizzbuzz"  # a new chat is named after its first message


async def test_partial_reply_is_flushed_while_streaming():
    clock = VirtualClock()
    backend = FakeBackend(first_token_s=0.05, token_s=0.3, clock=clock, sleep=clock.sleep)
    backend.hold, backend.hold_after = asyncio.Event(), 6
    app, _ = make_app(backend, clock=clock)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "flush")
        await until(lambda: len(app.active_tab.last_reply().text.split()) >= 6, what="six tokens")
        row = stored(app)[-1]
        assert row.status == "streaming"
        assert row.content and app.active_tab.last_reply().text.startswith(row.content)
        backend.hold.set()
        await until(lambda: not app.active_tab.busy)
        assert stored(app)[-1].status == "done"


async def test_escape_stops_the_reply_and_keeps_the_partial_text():
    app, backend = make_app()
    backend.hold = asyncio.Event()
    async with app.run_test(size=SIZE) as pilot:
        tab = app.active_tab
        await send(pilot, "tell me everything")
        await until(lambda: tab.last_reply() is not None and tab.last_reply().has_text, what="first token")
        await pilot.press("escape")
        await until(lambda: not tab.busy, what="stop")
        assert backend.cancelled == [tab.conversation_id]
        assert not backend.in_flight  # the stream was closed too
        reply_row = stored(app)[-1]
        assert reply_row.status == "stopped"
        assert reply_row.content == tab.last_reply().text != ""
        assert "stopped" in str(tab.last_reply().query_one(".status").render())


async def test_escape_before_the_first_token_puts_the_message_back_in_the_prompt():
    app, backend = make_app(FakeBackend(first_token_s=5))
    async with app.run_test(size=SIZE) as pilot:
        tab = app.active_tab
        await send(pilot, "never mind")
        await until(lambda: backend.calls, what="stream call")
        await pilot.press("escape")
        await until(lambda: not tab.busy, what="stop")
        assert backend.cancelled == [tab.conversation_id]
        assert tab.prompt.text == "never mind"
        assert stored(app) == [] and tab._messages() == []


async def test_two_tabs_stream_at_the_same_time():
    app, backend = make_app()
    backend.hold = asyncio.Event()
    async with app.run_test(size=SIZE) as pilot:
        first = app.active_tab
        await send(pilot, "first tab")
        await pilot.press("ctrl+t")
        second = app.active_tab
        assert second is not first
        await send(pilot, "second tab")
        await until(lambda: len(backend.in_flight) == 2, what="both in flight")
        assert first.busy and second.busy
        backend.hold.set()
        await until(lambda: not first.busy and not second.busy)
        assert backend.max_in_flight == 2
        assert {c["conversation_id"] for c in backend.calls} == {first.conversation_id, second.conversation_id}
        assert stored(app, first)[-1].status == stored(app, second)[-1].status == "done"


async def test_errors_show_in_the_tab_and_lose_nothing():
    app, backend = make_app()
    backend.stream_error = "out of KV blocks"
    async with app.run_test(size=SIZE) as pilot:
        tab = app.active_tab
        reply = await send_and_wait(pilot, "will fail")
        assert reply.status == "error"
        assert "out of KV blocks" in str(reply.query_one(".status").render())
        assert [r.status for r in stored(app)] == ["done", "error"]
        assert stored(app)[-1].meta["error"] == "out of KV blocks"
        assert isinstance(tab._messages()[0], UserMessage)  # the message stays on screen
        # The failed turn is left out of the next prompt.
        backend.stream_error = None
        await send_and_wait(pilot, "again")
        assert [m.content for m in backend.calls[-1]["messages"]] == ["again"]


async def test_a_reply_cut_short_says_why_and_still_does_after_a_restart():
    detail = "the KV cache is full (64 tokens); raise kv_cache_mb (--kv-cache-mb) or shorten the conversation"
    app, backend = make_app()
    backend.reported_usage = Usage(prompt_tokens=12, finish_reason="length", finish_detail=detail)
    async with app.run_test(size=SIZE) as pilot:
        status = (await send_and_wait(pilot, "tell me a long story")).query_one(".status")
        assert status.display and str(status.render()) == f"✂ cut short: {detail}"
        assert stored(app)[-1].meta["finish_detail"] == detail
        backend.reported_usage = None
        status = (await send_and_wait(pilot, "and a short one")).query_one(".status")
        assert not status.display  # a reply that ended on its own says nothing
    app.store.close()
    app, _ = make_app()
    async with app.run_test(size=SIZE):
        first_reply = app.active_tab._messages()[1]
        status = first_reply.query_one(".status")
        assert status.display and str(status.render()) == f"✂ cut short: {detail}"


async def test_backend_that_fails_to_start_is_reported():
    def broken():
        raise RuntimeError("no torch here")

    app = TuichatApp(broken, Config(), Store())
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "hello?")
        await until(lambda: not app.active_tab.busy)
        reply = app.active_tab.last_reply()
        assert reply.status == "error" and "no torch here" in reply.error
        assert "no torch here" in notifications(app)


# --- prompt -----------------------------------------------------------------------------------------


async def test_up_recalls_earlier_prompts_and_ctrl_j_is_a_newline():
    app, _ = make_app()
    async with app.run_test(size=SIZE) as pilot:
        prompt = app.active_tab.prompt
        await send_and_wait(pilot, "first")
        await pilot.press("s", "e", "c", "ctrl+j", "2")
        assert prompt.text == "sec\n2"
        await pilot.press("enter")
        await until(lambda: not app.active_tab.busy and len(stored(app)) == 4)
        assert prompt.text == ""
        await pilot.press("up")
        assert prompt.text == "sec\n2"
        await pilot.press("up", "up")  # the first ↑ moves to the entry's first line
        assert prompt.text == "first"
        await pilot.press("down")
        assert prompt.text == "sec\n2"
        await pilot.press("down")
        assert prompt.text == ""


async def test_a_message_sent_while_a_reply_streams_goes_back_to_the_prompt():
    app, backend = make_app()
    backend.hold = asyncio.Event()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "one")
        await until(lambda: app.active_tab.busy)
        await send(pilot, "two")
        await until(lambda: "Esc stops it" in notifications(app), what="the refusal")
        assert app.active_tab.prompt.text == "two"
        assert [c["messages"][-1].content for c in backend.calls] == ["one"]
        backend.hold.set()


# --- redo -------------------------------------------------------------------------------------------


async def test_regenerate_replaces_the_last_reply():
    app, backend = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "question")
        old_id = stored(app)[-1].id
        await pilot.press("ctrl+r")
        await until(lambda: len(backend.calls) == 2 and not app.active_tab.busy)
        assert backend.calls[1]["messages"] == backend.calls[0]["messages"]
        rows = stored(app)
        assert [r.role for r in rows] == ["user", "assistant"] and rows[-1].id != old_id


async def test_edit_last_message_puts_it_back_in_the_prompt():
    app, backend = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "first")
        await send_and_wait(pilot, "secnod")
        await pilot.press("ctrl+g")
        prompt = app.active_tab.prompt
        assert prompt.text == "secnod"
        assert [r.content for r in stored(app) if r.role == "user"] == ["first"]
        prompt.text = "second"
        await pilot.press("enter")
        await until(lambda: len(backend.calls) == 3 and not app.active_tab.busy)
        assert [m.content for m in backend.calls[-1]["messages"] if m.role == "user"] == ["first", "second"]


# --- models -----------------------------------------------------------------------------------------


async def test_model_switch_applies_to_the_next_reply():
    app, backend = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "one")
        await pilot.press("ctrl+o")
        assert isinstance(app.screen, ModelPicker)
        await pilot.press(*"large", "enter")
        tab = app.active_tab
        assert tab.model == "demo-large"
        assert app.store.conversation(tab.conversation_id).model == "demo-large"
        assert "demo-large" in str(tab.query_one(".model-bar").render())
        await send_and_wait(pilot, "two")
        assert "demo-large" in backend.load_calls
        assert [c["model"] for c in backend.calls] == ["smollm2-135m", "demo-large"]


async def test_a_model_that_does_not_load_is_reported_in_the_reply():
    app, backend = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+o", *"no-such-model", "enter")
        reply = await send_and_wait(pilot, "hello")
        assert reply.status == "error" and "no-such-model" in reply.error
        assert "no-such-model did not load" in notifications(app)


async def test_sending_during_a_slow_model_load_waits_and_the_ui_keeps_working():
    app, backend = make_app()
    backend.load_delay_s = 0.6
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "patience")
        await pilot.press("ctrl+t")  # the UI answers while the model loads
        assert len(app.tabs()) == 2
        await until(lambda: backend.calls and not any(t.busy for t in app.tabs()))
        assert backend.load_calls.count("smollm2-135m") == 1  # tabs share one load


# --- engine panel, copy, export, help ---------------------------------------------------------------


async def test_engine_panel_and_meter_show_exactly_what_the_backend_reports():
    app, backend = make_app()
    backend.reported_usage = Usage(prompt_tokens=1234, cached_tokens=987, steps=2, draft_tokens=40, accepted_tokens=25)
    backend.stats = lambda model=None: EngineStats(
        model="smollm2-135m", device="cpu", dtype="bfloat16", running=3, waiting=2, batch_size=5,
        kv_blocks_used=40, kv_blocks_total=512, prefix_hit_rate=0.25, tokens_per_s=42.5,
        speculate="auto", draft_tokens=400, accepted_tokens=300, tokens_per_step=1.8,
    )
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "one")
        assert "cached 987/1234" in str(app.active_tab.meter.query_one("#meter-text").render())
        meta = stored(app)[-1].meta
        assert (meta["prompt_tokens"], meta["cached_tokens"]) == (1234, 987)
        await pilot.press("ctrl+b")
        panel = app.query_one(EnginePanel)
        assert panel.display

        def shown(name: str) -> str:
            return str(panel.query_one(f"#engine-{name}", Static).render())

        assert shown("model") == "smollm2-135m\ncpu · bfloat16 · tp 1\ncontinuous batching"  # no kernel named
        assert shown("sched") == ("running 3 · waiting 2\nbatch 5 · 42.5 tok/s\n"
                                  "speculation auto · 75% kept\n1.80 tokens a step")
        assert shown("kv").startswith("KV cache 8%") and shown("kv").endswith("\n40/512 blocks")
        assert shown("prefix") == "prefix hits 25%"
        assert shown("turn") == ("last turn: 987 of 1234\nprompt tokens from cache\n"
                                 f"drafts: 25 of 40 kept\n{meta['completion_tokens'] / 2:.2f} tokens a step")
        assert not panel.query_one("#engine-kv").has_class("-warning")
        backend.stats = lambda model=None: EngineStats(
            model="m", kv_blocks_used=90, kv_blocks_total=100, matmul="torch (no AMX on this CPU)"
        )
        await until(lambda: panel.query_one("#engine-kv").has_class("-warning"), what="the KV warning")
        assert shown("model").endswith("continuous batching\ntorch matmul")
        backend.stats = lambda model=None: EngineStats(model="m", matmul="amx", layers="C")
        await until(lambda: shown("model").endswith("\namx matmul · C layers"), what="the kernels")
        backend.stats = lambda model=None: EngineStats(model="m", layers="C", weights="Q8_0", weight_bytes=3 * 2**20)
        await until(lambda: shown("model").endswith("\nQ8_0 weights · 3 MB a step"), what="the weights")
        why = "int8 needs the C layers: qwen3 layers are not implemented in C"
        backend.stats = lambda model=None: EngineStats(model="m", weights=f"bfloat16 ({why})", weight_bytes=6 * 2**20)
        await until(lambda: shown("model").endswith(f"\nbfloat16 weights · 6 MB a step\n{why}"), what="why not int8")
        backend.stats = lambda model=None: EngineStats(model="m", layers="C", weights="Q4_K, Q6_K", weight_bytes=763 * 2**20,
                                                       mapped_bytes=718 * 2**20, huge_page_bytes=754 * 2**20,
                                                       rss_bytes=int(1.73 * 2**30), peak_rss_bytes=int(1.8 * 2**30))
        await until(lambda: shown("model").endswith("\nQ4_K, Q6_K weights · 763 MB a step\n718 MB read in place from "
                                                    "the file, 754 MB of it in 2 MB pages\nRSS 1.73 GB · peak 1.80 GB"),
                    what="memory")
        await pilot.press("ctrl+b")
        assert not panel.display


async def test_copy_last_reply_and_code_block_say_osc52():
    app, _ = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("alt+c")
        assert "No reply" in notifications(app)
        app.backend.replies = [SHORT_REPLIES[0]]  # the one with a code block
        reply = await send_and_wait(pilot, "code please")
        await pilot.press("alt+c")
        assert app.clipboard == reply.text
        await pilot.press("alt+b")
        assert app.clipboard == 'print("hi")'
        assert "OSC 52; some terminals ignore it" in notifications(app)


async def test_export_writes_markdown_and_says_where(tuichat_dirs):
    app, _ = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "export me")
        await pilot.press("ctrl+s")
        files = list((tuichat_dirs / "data" / "exports").glob("*.md"))
        assert len(files) == 1 and "export me" in files[0].read_text()
        assert str(files[0]) in notifications(app)


async def test_help_lists_every_binding_with_its_id():
    app, _ = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        ids = [row[2] for row in app.screen.rows]
        assert {b.id for b in TuichatApp.BINDINGS} <= set(ids) and "prompt.newline" in ids
        assert all(b.id for b in TuichatApp.all_bindings())  # so [keymap] can rebind every one
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_only_http_links_open_and_only_on_a_click(monkeypatch):
    """A reply is model output: its links open in the browser only when clicked, and only http(s) ones; the
    others are refused with a notification that says why."""
    import webbrowser

    opened: list[str] = []
    monkeypatch.setattr(webbrowser, "open", lambda url, *args, **kwargs: opened.append(url))
    text = "See [docs](https://example.com/docs) or [run](x-custom://run?cmd=calc) now."
    app, _ = make_app(FakeBackend(replies=[text]))
    async with app.run_test(size=SIZE) as pilot:
        reply = await send_and_wait(pilot, "links")
        assert opened == []  # streamed and rendered: nothing opens by itself
        paragraph = reply.query_one(Markdown).children[0]
        shown = str(paragraph.render())
        assert shown == "See docs or run now."
        await pilot.click(paragraph, offset=(shown.index("run"), 0))
        await until(lambda: "Not opened: x-custom://run?cmd=calc" in notifications(app), what="refusal")
        assert "Only http and https links open." in notifications(app) and opened == []
        # markdown-it already renders file: and javascript: links as text; a link that got through anyway:
        markdown = reply.query_one(Markdown)
        refused = ("file:///etc/passwd", "javascript:alert(1)", "//example.com")
        for href in (*refused, "HTTPS://EXAMPLE.COM/"):
            markdown.post_message(Markdown.LinkClicked(markdown, href))
        await until(lambda: opened, what="the links handled")  # in order: the refusals came first
        assert all(f"Not opened: {href}" in notifications(app) for href in refused)
        assert opened == ["HTTPS://EXAMPLE.COM/"]  # a scheme in capitals is still http(s)
        opened.clear()
        await pilot.click(paragraph, offset=(shown.index("docs"), 0))
        await until(lambda: opened, what="the https link opened")
        assert opened == ["https://example.com/docs"]


# --- settings ---------------------------------------------------------------------------------------


async def test_keymap_from_config_rebinds_and_unknown_ids_are_reported():
    config = Config(keymap={"tab.new": "f5", "tab.nope": "f6"})
    app, _ = make_app(config=config, warnings=["config.toml: \"x\" must be a number; using the default."])
    async with app.run_test(size=SIZE) as pilot:
        text = notifications(app)
        assert '"x" must be a number' in text and "tab.nope" in text
        await pilot.press("f5")
        assert len(app.tabs()) == 2


async def test_theme_choice_persists_across_restarts():
    app, _ = make_app()
    async with app.run_test(size=SIZE):
        assert app.theme == "tuichat-dark"
        app.theme = "tuichat-light"
    assert Store().get_setting("theme") == "tuichat-light"
    app, _ = make_app()
    async with app.run_test(size=SIZE):
        assert app.theme == "tuichat-light"


async def test_broken_theme_file_and_unknown_theme_fall_back_with_notifications(tuichat_dirs):
    themes = tuichat_dirs / "config" / "themes"
    themes.mkdir(parents=True)
    (themes / "broken.toml").write_text('name = "broken"\nprimary = "not a colour"\n')
    Store().set_setting("theme", "gone")
    app, _ = make_app()
    async with app.run_test(size=SIZE):
        text = notifications(app)
        assert "broken.toml" in text and '"gone" not found' in text
        assert app.theme == "tuichat-dark"


# --- history ----------------------------------------------------------------------------------------


async def test_open_tabs_and_the_active_one_come_back_after_a_restart():
    app, _ = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "kept one")
        await pilot.press("ctrl+t")
        await send_and_wait(pilot, "kept two")
        await pilot.press("ctrl+t")
        await pilot.press("ctrl+t", "alt+w")  # a closed tab does not come back
        await pilot.press("f2", "ctrl+a", "ctrl+k", *"renamed", "enter")
        await pilot.press("ctrl+pageup")
    app.store.close()
    app, _ = make_app()
    async with app.run_test(size=SIZE):
        tabs = app.tabs()
        assert [t.title for t in tabs] == ["kept one", "kept two", "renamed"]
        assert app.active_tab is tabs[1]
        assert [type(w).__name__ for w in tabs[1]._messages()] == ["UserMessage", "AssistantMessage"]
        assert tabs[0].meter._history  # the TTFT sparkline comes back too


async def test_search_opens_the_hit_in_a_tab():
    app, _ = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "the word zanzibar is here")
        conversation = app.active_tab.conversation_id
        await pilot.press("alt+w")  # closed: search must reopen it
        assert app.active_tab.conversation_id != conversation
        await pilot.press("ctrl+f")
        assert isinstance(app.screen, SearchScreen)
        await pilot.press(*"zanzib")
        await until(lambda: app.screen.query_one("OptionList").option_count > 0, what="hits")
        await pilot.press("enter")
        await until(lambda: app.active_tab.conversation_id == conversation, what="hit opened")
        message_id = app.store.messages(conversation)[0].id
        await until(lambda: app.active_tab.query_one(f"#msg-{message_id}").has_class("-found"))


async def test_sampling_is_per_tab_and_passed_to_the_backend():
    app, backend = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f3")
        app.screen.query_one("#temperature").value = "0.7"
        app.screen.query_one("#seed").value = "42"
        app.screen.query_one("#temperature").focus()
        await pilot.press("enter")
        await send_and_wait(pilot, "creative")
        params = backend.calls[-1]["params"]
        assert (params.temperature, params.seed) == (0.7, 42)
        assert "temp 0.7" in str(app.active_tab.query_one(".model-bar").render())
        await pilot.press("ctrl+t")
        await send_and_wait(pilot, "default")
        # The embedded model recommends no sampling: a new tab has tuichat's default.
        assert backend.calls[-1]["params"] == SamplingParams(temperature=0.2, top_p=0.9, frequency_penalty=0.5)


async def test_a_tab_follows_its_models_recommended_sampling_under_the_config():
    backend = FakeBackend()
    backend.recommended = {"smollm2-135m": {"temperature": 0.6, "top_k": 20}}
    app, _ = make_app(backend, config=replace(Config(), sampling={"max_tokens": 64, "top_k": 5}))
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hello")
        assert backend.calls[-1]["params"] == SamplingParams(temperature=0.6, top_k=5, max_tokens=64)
        await until(lambda: "temp 0.6 · top-k 5 · max 64" in str(app.active_tab.model_bar.render()),
                    what="the model bar showing the sampling")


async def test_temperature_0_in_the_dialog_turns_the_default_penalty_off_unless_it_is_set():
    app, backend = make_app()
    async with app.run_test(size=SIZE) as pilot:
        for penalty, want in (("0.5", 0.0), ("0.25", 0.25)):
            await pilot.press("f3")
            assert app.screen.query_one("#frequency_penalty").value == "0.5"  # the default, shown
            app.screen.query_one("#frequency_penalty").value = penalty
            app.screen.query_one("#temperature").value = "0"
            app.screen.query_one("#temperature").focus()
            await pilot.press("enter")
            await until(lambda: not isinstance(app.screen, SamplingScreen), what="the dialog closed")
            await send_and_wait(pilot, "greedy")
            params = backend.calls[-1]["params"]
            assert (params.temperature, params.frequency_penalty, params.presence_penalty) == (0, want, 0)
            app.active_tab.set_sampling(SamplingParams(**CHAT_SAMPLING))  # back to the default for the next round


async def test_sampling_dialog_refuses_a_value_the_params_reject_and_applies_nothing():
    app, backend = make_app()
    async with app.run_test(size=SIZE) as pilot:
        tab = app.active_tab
        before = tab.sampling
        await pilot.press("f3")
        assert isinstance(app.screen, SamplingScreen)
        app.screen.query_one("#top_p").focus()
        await pilot.press("ctrl+a", "ctrl+k", "0", "enter")
        error = app.screen.query_one("#sampling-error", Static)
        await until(lambda: error.display, what="the refusal")
        assert isinstance(app.screen, SamplingScreen)  # still open, to correct the value
        assert str(error.render()) == "top_p must be a number above 0 and at most 1 (1 is off), not 0.0."
        assert tab.sampling == before and app.store.get_setting(sampling_key(tab.conversation_id)) is None
        await pilot.press("backspace", *"0.5", "enter")
        await until(lambda: not isinstance(app.screen, SamplingScreen), what="the dialog closed")
        assert tab.sampling == replace(before, top_p=0.5)
        await send_and_wait(pilot, "sampled")
        assert backend.calls[-1]["params"].top_p == 0.5


async def test_a_stored_sampling_the_params_reject_gives_the_default():
    """top_p 0 could be saved before the params were checked: such a tab opens with the configured default."""
    store = Store()
    conversation = store.create_conversation("old tab", "smollm2-135m")
    store.set_setting(sampling_key(conversation), '{"temperature": 0.7, "top_p": 0, "stop": []}')
    store.close()
    config = replace(Config(), sampling={"max_tokens": 64})
    app, _ = make_app(config=config)
    async with app.run_test(size=SIZE):
        assert app.active_tab.sampling == SamplingParams(temperature=0.2, top_p=0.9, frequency_penalty=0.5, max_tokens=64)


async def test_each_chunk_reparses_only_the_last_block(monkeypatch):
    """Painting a token must not cost more at the end of a long reply than at the start: MarkdownStream
    parses from the last block on, so what one append parses stays small however long the reply grows."""
    from markdown_it import MarkdownIt

    paragraph = "A sentence with **bold** and `code` in it. " * 2
    long_reply = "\n\n".join(f"Part {index}: {paragraph}" for index in range(40))  # ~4,000 characters
    backend = FakeBackend(token_s=0, replies=[long_reply])
    parsed: list[int] = []
    parse = MarkdownIt.parse

    def recording_parse(self, src, env=None):
        parsed.append(len(src))
        return parse(self, src, env)

    monkeypatch.setattr(MarkdownIt, "parse", recording_parse)
    # Paint every chunk, as a slow stream would: many parses to look at.
    monkeypatch.setattr(PaintPacer, "SHORTEST", 0)
    monkeypatch.setattr(PaintPacer, "LONGEST", 0)
    app, _ = make_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await until(lambda: "smollm2-135m" in backend.loaded)
        app.active_tab.sampling = replace(app.active_tab.sampling, max_tokens=10_000)
        parsed.clear()
        reply = await send_and_wait(pilot, "long")
    assert reply.text == long_reply
    *streaming, final = parsed  # the last parse is the one full render at the end
    assert final == len(long_reply)
    assert len(streaming) > 20 and max(streaming) < len(long_reply) / 10


async def test_fast_tab_keys_never_split_the_view_from_the_typing():
    """Keys typed right after tab keys, without waiting for a frame: the tab shown is the tab typed in."""
    from textual import events

    app, _ = make_app()
    async with app.run_test(size=SIZE):
        first = app.active_tab
        for key in ["ctrl+t", *"two", "ctrl+pageup", *"one"]:
            app.post_message(events.Key(key, key if len(key) == 1 else None))
        await until(lambda: len(first.prompt.text) + sum(len(t.prompt.text) for t in app.tabs()[1:]) == 6,
                    what="every key typed")
        second = app.tabs()[1]
        assert (first.prompt.text, second.prompt.text) == ("one", "two")
        assert app.active_tab is first and app.focused is first.prompt


async def test_log_follows_new_text_until_the_user_scrolls_up_and_again_at_the_bottom():
    long_reply = "\n\n".join(f"Paragraph {index} of a long answer." for index in range(80))
    backend = FakeBackend(token_s=0.01, replies=[long_reply])
    backend.tap = Tap(120)  # enough paragraphs to fill the view; more only as the test lets them
    app, _ = make_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        log = app.active_tab.log_view

        async def more_text() -> None:
            grown = log.max_scroll_y
            backend.tap.allow(30)  # a few paragraphs, a small part of what is left of the reply
            await until(lambda: log.max_scroll_y > grown + 3, what="more text")

        await send(pilot, "long")
        await until(lambda: log.max_scroll_y > 5 and log.scroll_y == log.max_scroll_y, what="following")
        app.active_tab.prompt.action_scroll_log(-1)  # PageUp in the prompt
        await until(lambda: log.scroll_y < log.max_scroll_y - 5, what="scrolled up")
        log.scroll_home(animate=False)
        for _ in range(2):  # twice: a scroll that follows the first growth has happened by the second
            await more_text()
        assert app.active_tab.busy and log.scroll_y == 0  # left where the user is, while the text grew
        log.scroll_end(animate=False)
        await more_text()
        await until(lambda: log.scroll_y == log.max_scroll_y, what="following again")
        assert app.active_tab.busy
        app.active_tab.stop()
