"""One end-to-end run of the TUI over the real engine and the embedded model: type a question, an
answer streams in, the meter shows a TTFT in ms, and the second turn is served from the cache."""

from __future__ import annotations

import re
from dataclasses import replace

from tuichat.backends.local import LocalBackend
from tuichat.backends.protocol import EngineOptions
from tuichat.config import Config
from tuichat.store import Store
from tuichat.ui.app import TuichatApp
from tuichat.ui.measure import until


async def test_question_answered_by_the_embedded_model(embedded):
    # Greedy: "Paris" is float32's greedy answer.
    config = replace(Config(), sampling={"max_tokens": 24, "temperature": 0}, engine=EngineOptions(dtype="float32"))
    app = TuichatApp(lambda: LocalBackend(config.engine, config.model), config, Store())
    async with app.run_test(size=(110, 36)) as pilot:
        tab = app.active_tab
        for turn, question in enumerate(["What is the capital of France?", "And of Italy?"]):
            tab.prompt.insert(question)
            await pilot.press("enter")
            await until(lambda: len(app.store.messages(tab.conversation_id)) == 2 * (turn + 1)
                           and not tab.busy, f"reply {turn + 1}", timeout=120)
            reply = app.store.messages(tab.conversation_id)[-1]
            assert reply.status == "done" and reply.content.strip()
            meter = str(tab.meter.query_one("#meter-text").render())
            assert re.search(r"TTFT [\d,]+ ms", meter), meter
        assert "Paris" in app.store.messages(tab.conversation_id)[1].content
        cached, prompt = map(int, re.search(r"cached (\d+)/(\d+)", meter).groups())
        assert cached >= 32 and prompt > cached  # turn 2 reused turn 1's blocks
