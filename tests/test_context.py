"""A conversation against the model's context, through LocalBackend on a tiny random Llama with a 512-token
context and the embedded model's tokenizer and chat template: trimming keeps the system prompt and the latest
turns and says what it left out, the next turn hits the cache for all of what was kept, the summarise policy
puts the model's own summary in place of the dropped turns, and each reason for a cache miss is caused here
and reported. Token counts are checked against transformers' chat template and tokenizer."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from tests.helpers import hf_greedy, template_ids
from tuichat.backends.context import SUMMARY_TITLE, evicted_reason, with_summary
from tuichat.backends.local import SUMMARY_PROMPT, LocalBackend, chat_ids, summary_tokens
from tuichat.backends.protocol import EngineOptions, Message, SamplingParams

SYSTEM = Message("system", "You are terse.")
# Greedy: the same replies, and so the same cache, every run (with the chat's sampling, one CI run in five saw a
# turn before the trim miss the cache; its reason was not kept).
SHORT = SamplingParams(max_tokens=8, temperature=0.0)
LIMIT = 511  # the tiny model's 512 positions, less the one a reply needs


def exchange(i: int, words: int = 40) -> list[Message]:
    return [Message("user", f"Question {i}: " + "word " * words), Message("assistant", f"Answer {i}: " + "thing " * words)]


def history(n: int) -> list[Message]:
    return [SYSTEM, *(m for i in range(n) for m in exchange(i))]


async def ask(backend, conversation: str, messages: list[Message], model: str | None = None):
    events = [event async for event in backend.stream(conversation, messages, SHORT, model)]
    assert events[-1].error is None, events[-1].error
    return "".join(e.text for e in events), events[-1].usage


def test_a_conversation_that_outgrows_the_context_drops_its_oldest_turns_once(tiny_chat_model, embedded):
    tokenizer = embedded[3]
    backend = LocalBackend(EngineOptions(dtype="float32"), default_model=tiny_chat_model)

    async def run():
        messages, usages = history(2), []
        for i in range(2, 9):
            messages = [*messages, Message("user", f"Question {i}: " + "word " * 40)]
            reply, usage = await ask(backend, "c", messages)
            usages.append((list(messages), usage))
            messages.append(Message("assistant", reply))
        await backend.close()
        return usages

    usages = asyncio.run(run())
    first_trim = next(i for i, (_, usage) in enumerate(usages) if usage.dropped_messages)
    messages, usage = usages[first_trim]
    dropped, rest = usage.dropped_messages, messages[1:]
    kept = [SYSTEM, *rest[dropped:]]
    assert usage.context_tokens == LIMIT
    assert dropped % 2 == 0 and rest[dropped].role == "user"  # whole turns, from the oldest
    assert usage.prompt_tokens == len(template_ids(tokenizer, kept))  # the system prompt is kept
    assert usage.dropped_tokens == len(template_ids(tokenizer, messages)) - usage.prompt_tokens
    # It dropped until a quarter of the context was free, and no more.
    assert usage.prompt_tokens + SHORT.max_tokens <= LIMIT - LIMIT // 4
    assert len(template_ids(tokenizer, [SYSTEM, *rest[dropped - 2:]])) + SHORT.max_tokens > LIMIT - LIMIT // 4
    assert "trimmed to fit the context" in usage.cache_miss
    # The turns before and after: nothing dropped before; after, the same turns stay out and all that was
    # kept (the prompt and reply, in full blocks) comes from the cache.
    before = [(u.dropped_messages, u.cache_miss) for _, u in usages[1:first_trim]]
    assert all(not gone and miss is None for gone, miss in before), before  # the reasons, if one misses
    previous = usage
    for _, after in usages[first_trim + 1:]:
        if after.dropped_messages != previous.dropped_messages:
            break
        assert after.cache_miss is None
        assert after.cached_tokens >= (previous.prompt_tokens + previous.completion_tokens) // 16 * 16
        previous = after
    assert previous is not usage, "no turn after the trim kept the same turns out"


def test_the_summarise_policy_puts_the_models_summary_in_place_of_the_dropped_turns(tiny_chat_model, embedded):
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = embedded[3]
    backend = LocalBackend(EngineOptions(dtype="float32", context_policy="summarise"), default_model=tiny_chat_model)
    # Short early turns: what is dropped fits the summary's request whole (no cut to fit it).
    messages = [SYSTEM, *(m for i in range(8) for m in exchange(i, 12)), *exchange(8), *exchange(9),
                Message("user", "And now? " + "word " * 40)]

    async def run():
        result = await ask(backend, "c", messages)
        await backend.close()
        return result

    _, usage = asyncio.run(run())
    dropped, rest = usage.dropped_messages, messages[1:]
    assert dropped and usage.summary is not None
    transcript = "\n\n".join(f"{m.role.capitalize()}: {m.content}" for m in rest[:dropped])
    request = chat_ids(tokenizer, [Message("user", f"{SUMMARY_PROMPT}\n\n{transcript}")])
    reference = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32)
    most = summary_tokens(LIMIT)
    assert len(request) + most <= LIMIT
    want = tokenizer.decode(hf_greedy(reference, request, most, tokenizer.eos_token_id),
                            skip_special_tokens=True).strip().removesuffix("\ufffd")  # a stream never ends in half a character
    assert usage.summary == want
    sent = with_summary([SYSTEM], want) + rest[dropped:]
    assert sent[0].content.startswith(f"{SYSTEM.content}\n\n{SUMMARY_TITLE}: ")
    assert usage.prompt_tokens == len(template_ids(tokenizer, sent))


def test_a_history_ending_on_a_block_boundary_is_not_reported_evicted():
    """The reply's last token is never computed (its K/V comes with the next turn) unless a draft brought it, so a
    336-token history in blocks of 16 finds 320 tokens cached: no eviction (speculation's timing-sized drafts made
    this turn up as "16 tokens evicted" now and then). One block fewer is one."""
    assert evicted_reason(320, 336, 16) is None and evicted_reason(336, 336, 16) is None
    assert evicted_reason(336, 337, 16) is None
    assert "17 tokens of the history had been evicted" in evicted_reason(320, 337, 16)
    assert "32 tokens of the history had been evicted" in evicted_reason(304, 336, 16)


def test_each_reason_for_a_cache_miss_is_reported(tiny_chat_model, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_chat_model, other)
    # The KV's second tier off: evicted blocks are gone, and a restart finds nothing.
    backend = LocalBackend(EngineOptions(dtype="float32", kv_cache_mb=1, kv_disk_mb=0), default_model=tiny_chat_model)
    one = [SYSTEM, Message("user", "Hello there, how are you?")]

    async def run():
        reasons = {}
        reply, usage = await ask(backend, "c", one)
        reasons["first turn"] = usage.cache_miss
        turn = [*one, Message("assistant", reply), Message("user", "Tell me more.")]
        reply2, usage = await ask(backend, "c", turn)
        reasons["next turn"] = usage.cache_miss
        reasons["hit"] = usage.cached_tokens
        edited = [SYSTEM, Message("user", "Hello there, how were you?"), *turn[2:]]
        _, usage = await ask(backend, "c", edited)
        reasons["edited"] = usage.cache_miss
        changed = [Message("system", "You are verbose."), *edited[1:]]
        _, usage = await ask(backend, "c", changed)
        reasons["system"] = usage.cache_miss
        _, usage = await ask(backend, "c", changed, model=str(other))
        reasons["switched"] = usage.cache_miss
        # Other conversations fill the 1 MiB pool (128 blocks of 16 tokens) and evict this one's blocks.
        reply, _ = await ask(backend, "d", one)
        for i in range(6):
            await ask(backend, f"filler{i}", [SYSTEM, Message("user", f"{i} " + "filler " * 400)])
        _, usage = await ask(backend, "d", [*one, Message("assistant", reply), Message("user", "Go on.")])
        reasons["evicted"] = usage.cache_miss
        await backend.close()
        # Restarts: with the KV's second tier off, then on (the first of them wrote its blocks as it closed).
        for name in ("restart", "restart from disk"):
            restarted = LocalBackend(EngineOptions(dtype="float32"), default_model=tiny_chat_model)
            _, usage = await ask(restarted, "c", turn)
            reasons[name] = usage.cache_miss, usage.restored_tokens, usage.cached_tokens
            await restarted.close()
        off = LocalBackend(EngineOptions(dtype="float32", prefix_cache=False), default_model=tiny_chat_model)
        reply, _ = await ask(off, "c", one)
        _, usage = await ask(off, "c", [*one, Message("assistant", reply), Message("user", "More.")])
        reasons["off"] = usage.cache_miss
        await off.close()
        return reasons

    reasons = asyncio.run(run())
    assert reasons["first turn"] is None and reasons["next turn"] is None and reasons["hit"] > 0
    assert "edited" in reasons["edited"]
    assert reasons["system"] == "the system prompt changed"
    assert reasons["switched"] == f"the model was switched (from {tiny_chat_model})"
    assert "evicted from the KV cache" in reasons["evicted"]
    assert "not run by this engine since it started" in reasons["restart"][0] and reasons["restart"][1:] == (0, 0)
    miss, restored, cached = reasons["restart from disk"]
    assert miss is None and restored == cached > 0
    assert reasons["off"] == "the prefix cache is off"


@pytest.mark.parametrize("policy", ["drop", "summarise"])
def test_one_message_longer_than_the_context_is_refused_with_its_length(tiny_chat_model, embedded, policy):
    from tuichat.backends.protocol import PromptTooLong

    tokenizer = embedded[3]
    backend = LocalBackend(EngineOptions(dtype="float32", context_policy=policy), default_model=tiny_chat_model)
    long = Message("user", "word " * 600)

    async def run():
        try:
            with pytest.raises(PromptTooLong) as error:
                await ask(backend, "c", [*history(2), long])
        finally:
            await backend.close()
        return str(error.value)

    text = asyncio.run(run())
    assert text.startswith(f"This message is {len(template_ids(tokenizer, [SYSTEM, long])):,} tokens long")
    assert f"holds {LIMIT} tokens a conversation" in text


def test_the_refuse_policy_answers_a_history_too_long_with_the_engines_refusal(tiny_chat_model, embedded):
    from tuichat.backends.protocol import PromptTooLong

    backend = LocalBackend(EngineOptions(dtype="float32", context_policy="refuse"), default_model=tiny_chat_model)
    messages = [*history(8), Message("user", "And now?")]

    async def run():
        try:
            with pytest.raises(PromptTooLong) as error:
                await ask(backend, "c", messages)
        finally:
            await backend.close()
        return str(error.value)

    assert asyncio.run(run()) == (f"The prompt is {len(template_ids(embedded[3], messages))} tokens long; "
                                  f"{tiny_chat_model} takes at most {LIMIT}.")


def test_a_prefill_while_typing_makes_no_summary(tiny_chat_model):
    """Under the summarise policy, a prefill ahead of a turn that needs a new summary does nothing: the summary
    is a request of the foreground's priority, made for the turn itself."""
    backend = LocalBackend(EngineOptions(dtype="float32", context_policy="summarise"), default_model=tiny_chat_model)
    messages = [*history(8), Message("user", "And now?")]

    async def run():
        prepared = await backend.prefill("c", messages)
        engine = backend._loaded[tiny_chat_model].engine
        admitted = engine.scheduler.admitted_prompt_tokens
        await backend.close()
        return prepared, admitted

    assert asyncio.run(run()) == (0, 0)
