"""How a long conversation feels, measured: `[SEND_TURNS=n] python scripts/ui_long_conversation.py [messages] [window]`,
on the demo backend (tuichat/ui/demo.py) in temporary folders:
(a) restoring a 300-message tab: app start until the first frame, and opening it from history;
(b) streaming a reply at the end of it: frames (layout + compositor update) and their cost per token;
(a') with SEND_TURNS: then n turns sent in a new tab, time per turn early and late; (b) and (c) in that tab;
(c) key → prompt document and key → next frame, while that reply streams.
tests/test_ui_long.py asserts the behaviour this times.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

from textual import events
from textual.widgets import TextArea

from tuichat.config import Config
from tuichat.store import Store
from tuichat.ui.app import TuichatApp
from tuichat.ui.demo import REPLIES, DemoBackend, fill_history
from tuichat.ui.measure import SIZE, Frames


def summary(values: list[float]) -> str:
    if not values:
        return "n=0"
    values = sorted(values)
    return (
        f"n={len(values)} p50 {statistics.median(values):.1f} p90 {values[int(len(values) * 0.9)]:.1f} "
        f"max {values[-1]:.1f} ms"
    )


async def measure(messages: int, sent_turns: int = 0) -> None:
    store = Store()
    long_id = fill_history(store, messages)
    store.set_setting("active_conversation", long_id)
    closed_id = fill_history(store, messages, "closed")
    store.set_open(closed_id, False)
    long_reply = "\n\n".join(REPLIES * 6)
    backend = DemoBackend(first_token_s=0.05, token_s=0.01, load_s=0.02, replies=[long_reply])
    inserted: dict[str, float] = {}

    def hook(message) -> None:
        if isinstance(message, TextArea.Changed) and message.text_area.text:
            inserted.setdefault(message.text_area.text[-1], time.perf_counter())

    with Frames() as frames:
        app = TuichatApp(lambda: backend, Config(), store)
        app.animation_level = "none"
        start = time.perf_counter()
        async with app.run_test(size=SIZE, message_hook=hook) as pilot:
            await pilot.pause()
            startup = (time.perf_counter() - start) * 1000
            tab = app.active_tab
            mounted = len(tab._messages())
            widgets = len(list(tab.query("*")))
            print(f"(a) start with a {messages}-message tab: {startup:.0f} ms to first frame "
                  f"({mounted} messages mounted, {widgets} widgets in the tab)")
            frames.clear()
            start = time.perf_counter()
            await app.open_conversation(closed_id)
            await pilot.pause()
            print(f"(a) open a closed {messages}-message conversation: {(time.perf_counter() - start) * 1000:.0f} ms")
            app.activate(tab)
            await pilot.pause()
            while "smollm2-135m" not in backend.loaded:
                await asyncio.sleep(0.01)
            if sent_turns:  # the other way to a long tab: a fresh one, by sending
                await app.action_new_tab()
                tab = app.active_tab
                await pilot.pause()
                backend.first_token_s, backend.token_s, backend.replies = 0.0, 0.0, list(REPLIES)
                turn_ms, sent_before = [], backend.streams
                for turn in range(sent_turns):
                    start = time.perf_counter()
                    tab.prompt.insert(f"turn {turn}")
                    tab.prompt.action_send()
                    while backend.streams <= sent_before + turn or tab.busy:
                        await asyncio.sleep(0.002)
                    turn_ms.append((time.perf_counter() - start) * 1000)
                tens = [f"{statistics.median(turn_ms[i : i + 10]):.0f}" for i in range(0, sent_turns, 10)]
                print(f"(a') {sent_turns} turns sent, median ms per turn by tens of turns: {' '.join(tens)}; "
                      f"{len(tab._messages())} messages mounted")
                backend.first_token_s, backend.token_s, backend.replies = 0.05, 0.01, [long_reply]

            # (b) stream a long reply at the end of the long tab
            frames.clear()
            tab.prompt.insert("one more")
            tab.prompt.action_send()
            while not tab.busy or not tab.last_reply().has_text:
                await asyncio.sleep(0.005)
            await asyncio.sleep(2.0)
            tokens = tab.meter.turn.tokens
            print(f"(b) streaming at 100 tok/s for 2 s ({tokens} tokens arrived): frames {summary([d for _, d in frames.frames])}; "
                  f"layouts {summary(frames.layouts)}; busy {sum(d for _, d in frames.frames) / max(tokens, 1):.1f} "
                  f"ms of frame work per token")

            # (c) keys while it streams
            frames.clear()
            key_doc, key_frame = [], []
            for index in range(30):
                character = chr(ord("a") + index % 26)
                inserted.pop(character, None)
                sent = time.perf_counter()
                app.post_message(events.Key(character, character))
                while character not in inserted:
                    await asyncio.sleep(0.001)
                key_doc.append((inserted[character] - sent) * 1000)
                while not any(end > inserted[character] for end, _ in frames.frames):
                    await asyncio.sleep(0.001)
                painted = next(end for end, _ in frames.frames if end > inserted[character])
                key_frame.append((painted - sent) * 1000)
                await asyncio.sleep(0.03)
            assert tab.busy, "the reply should still stream"
            print(f"(c) key → prompt document: {summary(key_doc)}")
            print(f"(c) key → next frame done: {summary(key_frame)}")
            tab.stop()
            while tab.busy:
                await asyncio.sleep(0.01)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("messages", type=int, nargs="?", default=300, help="messages in the long conversation")
    parser.add_argument("window", type=int, nargs="?", help="try another window size (messages mounted)")
    args = parser.parse_args()
    for name in ("CONFIG", "DATA", "CACHE"):
        os.environ[f"TUICHAT_{name}_DIR"] = tempfile.mkdtemp()
    if args.window is not None:
        import tuichat.ui.message_log

        tuichat.ui.message_log.WINDOW = args.window
    asyncio.run(measure(args.messages, int(os.environ.get("SEND_TURNS", "0"))))
