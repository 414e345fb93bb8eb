"""The TUI over the real engine on a tiny random Llama with a 512-token context (the embedded model's tokenizer and
chat template): the meter's context count against transformers' own count, a conversation that outgrows the
context going on with a notice of what was left out, a message longer than the context refused and left in the
prompt, the reason a reopened conversation missed the cache in the engine panel, and the policy switched from
the palette."""

from __future__ import annotations

import re
from dataclasses import replace

from tests.helpers import template_ids
from tuichat.backends.local import LocalBackend
from tuichat.backends.protocol import EngineOptions, Message
from tuichat.config import Config
from tuichat.store import Store
from tuichat.ui.app import TuichatApp
from tuichat.ui.measure import until

SIZE = (120, 36)
LIMIT = 511


def app_for(model: str, store: Store | None = None, **engine) -> TuichatApp:
    config = replace(Config(), model=model, sampling={"max_tokens": 8, "temperature": 0},
                     engine=EngineOptions(dtype="float32", **engine))
    return TuichatApp(lambda: LocalBackend(config.engine, config.model), config, store or Store())


def notifications(app) -> str:
    return "\n".join(f"{n.title}: {n.message}" for n in app._notifications)


async def send(pilot, app, text: str, replies: int) -> None:
    tab = app.active_tab
    tab.prompt.insert(text)
    await pilot.press("enter")
    await until(lambda: len([m for m in app.store.messages(tab.conversation_id) if m.role == "assistant"]) == replies
                and not tab.busy, f"reply {replies}", timeout=120)


def shown_context(tab) -> tuple[int, int]:
    held, limit = re.search(r"ctx ([\d,]+)/([\d,]+)", str(tab.meter.query_one("#meter-context").render())).groups()
    return int(held.replace(",", "")), int(limit.replace(",", ""))


async def test_the_meter_counts_the_conversation_and_a_trim_is_said(tiny_chat_model, embedded):
    tokenizer = embedded[3]
    app = app_for(tiny_chat_model)
    async with app.run_test(size=SIZE) as pilot:
        tab = app.active_tab
        await send(pilot, app, "Hello there, how are you?", 1)
        stored = app.store.messages(tab.conversation_id)
        history = [Message("user", stored[0].content)]
        reply = stored[1]
        assert shown_context(tab) == (len(template_ids(tokenizer, history)) + reply.meta["completion_tokens"], LIMIT)
        for i in range(1, 12):
            await send(pilot, app, f"Question {i}: " + "word " * 60, i + 1)
            if "Context full" in notifications(app):
                break
        assert re.search(r"Context full in .*: The conversation outgrew 511 tokens: its (\d+) oldest messages "
                         r"\(([\d,]+) tokens\) are left out of what the model sees; the system prompt stays\. This "
                         r"turn prefilled ([\d,]+) tokens\.", notifications(app)), notifications(app)
        meter = str(tab.meter.query_one("#meter-context").render())
        assert re.search(r"· \d+ left out", meter)
        turns = len([m for m in app.store.messages(tab.conversation_id) if m.role == "assistant"])
        await send(pilot, app, "And after the trim?", turns + 1)
        assert app.store.messages(tab.conversation_id)[-1].status == "done"
        held, _ = shown_context(tab)
        assert held <= LIMIT


async def test_a_message_longer_than_the_context_stays_in_the_prompt(tiny_chat_model):
    app = app_for(tiny_chat_model)
    text = "word " * 600
    async with app.run_test(size=SIZE) as pilot:
        tab = app.active_tab
        tab.prompt.insert(text)
        await pilot.press("enter")
        await until(lambda: "This message is" in notifications(app), "the refusal", timeout=120)
        await until(lambda: not tab.busy, "the tab free again")
        assert re.search(r"This message is [\d,]+ tokens long .* holds 511 tokens a conversation\. Shorten it, or split "
                         r"it over several messages\. Your message is back in the prompt\.", notifications(app))
        assert tab.prompt.text == text
        assert app.store.messages(tab.conversation_id) == []


async def test_a_reopened_conversation_reads_its_kv_back_or_says_why_not(tiny_chat_model, tmp_path):
    app = app_for(tiny_chat_model, Store())
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, app, "Hello there, how are you?", 1)
        conversation = app.active_tab.conversation_id
    again = app_for(tiny_chat_model, Store())  # a restart: the same history file, a new engine, the KV on disk
    async with again.run_test(size=SIZE) as pilot:
        tab = again.active_tab
        assert tab.conversation_id == conversation
        await send(pilot, again, "Tell me more.", 2)
        meter = str(tab.meter.query_one("#meter-text").render())
        cached, prompt, restored = map(int, re.search(r"cached (\d+)/(\d+) \((\d+) from disk\)", meter).groups())
        assert cached == restored > 0 and prompt > cached
        assert "cache_miss" not in again.store.messages(conversation)[-1].meta
    off = app_for(tiny_chat_model, Store(), kv_disk_mb=0)  # again, with the KV's second tier off
    async with off.run_test(size=SIZE) as pilot:
        await send(pilot, off, "And more?", 3)
        await pilot.press("ctrl+b")
        await until(lambda: "missed:" in str(off.query_one("#engine-turn").render()), "the miss reason")
        turn = str(off.query_one("#engine-turn").render()).replace("\n", " ")
        assert "missed: its earlier turns were not run by this engine since it started" in turn
        assert off.store.messages(conversation)[-1].meta["cache_miss"].startswith("its earlier turns were not run")


async def test_the_palette_switches_the_context_policy(tiny_chat_model):
    app = app_for(tiny_chat_model)
    async with app.run_test(size=SIZE) as pilot:
        await until(lambda: app.backend is not None, "the engine")
        await pilot.press("ctrl+p")
        await pilot.press(*"Context policy: summarise")
        from textual.command import CommandList

        await until(lambda: app.screen.query(CommandList) and app.screen.query_one(CommandList).option_count > 0,
                    "the command listed")
        await pilot.press("enter")
        await until(lambda: app.backend.options.context_policy == "summarise", "the policy set")
        assert "Context policy: summarise." in notifications(app)


async def test_a_pause_in_typing_prefills_the_turn_so_far(tiny_chat_model):
    """Typing, a pause, more typing, Enter: the turn's cached count covers the history and what was typed
    before the pause, where without the prefill it would cover the history alone."""
    app = app_for(tiny_chat_model)
    async with app.run_test(size=SIZE) as pilot:
        tab = app.active_tab
        await send(pilot, app, "Hello there, how are you?", 1)
        first = app.store.messages(tab.conversation_id)[-1].meta
        history = first["prompt_tokens"] + first["completion_tokens"]
        tab.prompt.insert("Tell me about " + "word " * 80)
        await until(lambda: tab.prefilled > history + 80, "the prefill after the pause", timeout=60)
        prefilled = tab.prefilled
        await send(pilot, app, " and then some more.", 2)
        turn = app.store.messages(tab.conversation_id)[-1].meta
        assert turn["prompt_tokens"] > prefilled
        assert turn["cached_tokens"] >= (prefilled - 1) // 16 * 16 > history


async def test_a_fork_shares_the_kv_of_its_history(tiny_chat_model):
    """F5, the latest reply: a new tab with the conversation's messages, whose first turn finds their KV in the
    prefix cache; forking at a message of the user's puts it back in the new tab's prompt instead."""
    app = app_for(tiny_chat_model)
    async with app.run_test(size=SIZE) as pilot:
        source = app.active_tab
        await send(pilot, app, "Hello there, how are you?", 1)
        await send(pilot, app, "Tell me about " + "word " * 30, 2)
        rows = app.store.messages(source.conversation_id)
        last = rows[-1].meta
        await pilot.press("f5")
        await until(lambda: type(app.screen).__name__ == "ForkPicker", "the picker")
        await pilot.press("enter")  # the latest message first: the last reply
        await until(lambda: len(app.tabs()) == 2, "the fork's tab")
        fork = app.active_tab
        assert fork is not source
        assert [(m.role, m.content) for m in app.store.messages(fork.conversation_id)] == \
               [(m.role, m.content) for m in rows]
        await send(pilot, app, "And then?", 3)
        turn = app.store.messages(fork.conversation_id)[-1].meta
        assert turn["cached_tokens"] >= (last["prompt_tokens"] + last["completion_tokens"]) // 16 * 16 - 16
        assert "cache_miss" not in turn
        await pilot.press("f5")
        await until(lambda: type(app.screen).__name__ == "ForkPicker", "the picker")
        await pilot.press("down", "enter")  # the fork's message before its last reply: "And then?"
        await until(lambda: len(app.tabs()) == 3, "the second fork's tab")
        assert app.active_tab.prompt.text == "And then?"
        assert [m.content for m in app.store.messages(app.active_tab.conversation_id)] == [m.content for m in rows]


async def test_one_message_sent_to_every_tab(tiny_chat_model):
    app = app_for(tiny_chat_model)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+t")
        await pilot.press("ctrl+t")
        await until(lambda: len(app.tabs()) == 3, "three tabs")
        app.active_tab.prompt.insert("Same question everywhere")
        await pilot.press("f9")
        await until(lambda: all(len(app.store.messages(t.conversation_id)) == 2 and not t.busy for t in app.tabs()),
                    "every tab's reply", timeout=120)
        for tab in app.tabs():
            user, reply = app.store.messages(tab.conversation_id)
            assert user.content == "Same question everywhere" and reply.status == "done"
        assert app.active_tab.prompt.text == ""
