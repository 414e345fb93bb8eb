"""LocalBackend over a tiny random model with the embedded tokenizer: asyncio streaming, batching of
concurrent conversations, cancel, a crash mid-reply, and bad input."""

from __future__ import annotations

import asyncio

import pytest

from tuichat.backends.local import LocalBackend
from tuichat.backends.protocol import EngineOptions, Message, SamplingParams, TuichatError, chat_sampling
from tuichat.ui.measure import until

LONG = SamplingParams(max_tokens=40)


def user(text: str) -> list[Message]:
    return [Message("user", text)]


async def collect(stream):
    return [event async for event in stream]


def test_concurrent_conversations_share_engine_steps(tiny_chat_model):
    backend = LocalBackend(EngineOptions(dtype="float32"), default_model=tiny_chat_model)

    async def run():
        await backend.load()
        engine = backend._loaded[tiny_chat_model].engine
        sizes = []
        original = engine.step

        def recording_step():
            original()
            sizes.append(engine.last_batch_size)

        engine.step = recording_step
        results = await asyncio.gather(*(collect(backend.stream(f"c{i}", user(f"Tab {i}"), LONG)) for i in range(3)))
        stats = backend.stats()
        await backend.close()
        return results, sizes, stats

    results, sizes, stats = asyncio.run(run())
    assert all(r[-1].finished and r[-1].usage.completion_tokens == 40 for r in results)
    assert max(sizes) == 3  # all three conversations were in one forward at least once
    assert stats.kv_blocks_used == 0 and stats.running == 0 and stats.kv_blocks_total > 0
    assert stats.matmul == "torch"  # the AMX kernel serves bf16 only; this model runs in float32
    assert stats.layers == "transformers"


def test_a_models_recommended_sampling_is_the_default_under_the_users(tiny_chat_model, tmp_path):
    import shutil

    from transformers import GenerationConfig

    folder = tmp_path / "recommends"
    shutil.copytree(tiny_chat_model, folder)
    GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.1).save_pretrained(folder)
    backend = LocalBackend(EngineOptions(dtype="float32"), default_model=tiny_chat_model)

    async def run():
        try:
            plain, recommends = await backend.load(tiny_chat_model), await backend.load(str(folder))
            return backend.sampling_defaults(plain), backend.sampling_defaults(recommends)
        finally:
            await backend.close()

    plain, recommended = asyncio.run(run())
    shipped = GenerationConfig.from_pretrained(folder)  # transformers' reading of the file
    assert recommended == {"temperature": shipped.temperature, "top_p": shipped.top_p, "top_k": shipped.top_k}
    assert plain == {} and backend.sampling_defaults("never-loaded") == {}
    # The user's settings lie over the model's; with none, tuichat's default; temperature 0 is exact greedy,
    # with only the penalties the user set.
    assert chat_sampling(recommended, {"max_tokens": 9}) == SamplingParams(temperature=0.6, top_p=0.95, top_k=20, max_tokens=9)
    assert chat_sampling(plain, {}) == SamplingParams(temperature=0.2, top_p=0.9, frequency_penalty=0.5)
    assert chat_sampling(recommended, {"temperature": 0}) == chat_sampling(plain, {"temperature": 0}) == SamplingParams()
    assert chat_sampling(plain, {"temperature": 0, "presence_penalty": 0.3}) == SamplingParams(presence_penalty=0.3)
    with pytest.raises(TuichatError, match="top_p must be"):
        chat_sampling(recommended, {"top_p": 0})


def test_no_thread_that_ran_torch_outlives_its_work(tiny_chat_model, monkeypatch):
    """libgomp keeps an OpenMP pool for every live thread that ran a parallel region, and with more pool threads
    than cores stops spinning between regions (every decode step then waits on futex wakes). So the load runs
    on a thread that ends with it, not on the event loop's lasting executor, and an idle engine thread ends."""
    import threading

    from tuichat.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "IDLE_EXIT_S", 0.2)
    backend = LocalBackend(EngineOptions(dtype="float32"), default_model=tiny_chat_model)
    ran = {"load": [], "step": []}
    original_load = backend.load_sync

    def recording_load(*args):
        ran["load"].append(threading.current_thread())
        return original_load(*args)

    backend.load_sync = recording_load

    async def run():
        await backend.load()
        engine = backend._loaded[tiny_chat_model].engine
        original_step = engine.step

        def recording_step():
            ran["step"].append(threading.current_thread())
            original_step()

        engine.step = recording_step
        await until(lambda: not ran["load"][0].is_alive(), "the loading thread to end", timeout=30)
        replies = []
        for turn in range(2):
            replies.append(await collect(backend.stream(f"c{turn}", user("Hello"), SamplingParams(max_tokens=4))))
            await until(lambda: not ran["step"][-1].is_alive(), "the idle engine thread to end", timeout=30)
        await backend.close()
        return replies

    replies = asyncio.run(run())
    assert all(r[-1].finished and r[-1].usage.completion_tokens == 4 for r in replies)
    assert ran["load"][0] is not threading.main_thread()
    assert ran["step"][0] is not ran["step"][-1]  # the second reply was served by a new engine thread


def test_cancel_stops_the_reply_and_frees_its_blocks(tiny_chat_model):
    backend = LocalBackend(EngineOptions(dtype="float32"), default_model=tiny_chat_model)

    async def run():
        events = []
        async for event in backend.stream("c", user("Go on and on"), SamplingParams(max_tokens=400)):
            events.append(event)
            if len(events) == 3:
                backend.cancel("c")
        stats = backend.stats()  # at once: the engine frees the blocks before it sends the final event
        await backend.close()
        return events, stats

    events, stats = asyncio.run(run())
    assert events[-1].finished and events[-1].usage.finish_reason == "cancelled"
    assert events[-1].usage.completion_tokens < 400
    assert stats.kv_blocks_used == 0


def test_closing_the_stream_early_cancels_the_request(tiny_chat_model):
    backend = LocalBackend(EngineOptions(dtype="float32"), default_model=tiny_chat_model)

    async def run():
        stream = backend.stream("c", user("Hello"), SamplingParams(max_tokens=400))
        await stream.__anext__()
        await stream.aclose()
        engine = backend._loaded[tiny_chat_model].engine
        # The cancel reaches the engine thread through its inbox, after aclose returns.
        await until(lambda: not engine.scheduler.has_work() and engine.blocks.num_used == 0, "the request's end")
        await backend.close()

    asyncio.run(run())



def test_a_consumer_that_falls_behind_gets_what_piled_up_in_one_event(tiny_chat_model):
    """Read the first event, then nothing until the engine has finished the reply: the rest comes as one event
    (fewer for a slow client to handle), and the text is the same as read token by token. The KV's disk tier off:
    what it holds depends on the tests before this one, and once the late reply, its first block read back from
    disk, ended after 15 tokens where the steady one ran to 30 (a random model's replies hang on near-ties)."""
    backend = LocalBackend(EngineOptions(dtype="float32", kv_disk_mb=0), default_model=tiny_chat_model)
    greedy = SamplingParams(temperature=0, max_tokens=30)

    async def run():
        await backend.load()
        engine = backend._loaded[tiny_chat_model].engine
        steady = [event async for event in backend.stream("steady", user("Count on"), greedy)]
        stream = aiter(backend.stream("late", user("Count on"), greedy))
        late = [await anext(stream)]
        await until(lambda: not engine.scheduler.has_work(), "the reply's end")
        late += [event async for event in stream]
        await backend.close()
        return steady, late

    steady, late = asyncio.run(run())
    assert len(late) <= 2 < len(steady) and late[-1].finished
    assert "".join(e.text for e in late) == "".join(e.text for e in steady)
    assert late[-1].usage.completion_tokens == steady[-1].usage.completion_tokens == 30

def test_a_crash_mid_reply_reports_an_error_and_the_engine_goes_on(tiny_chat_model):
    backend = LocalBackend(EngineOptions(dtype="float32"), default_model=tiny_chat_model)

    async def run():
        await backend.load()
        runner = backend._loaded[tiny_chat_model].engine.runner
        original, calls = runner.execute, []

        def flaky(chunks):
            calls.append(1)
            if len(calls) == 5:
                raise RuntimeError("simulated device failure")
            return original(chunks)

        runner.execute = flaky
        broken = await collect(backend.stream("a", user("Hi"), LONG))
        healthy = await collect(backend.stream("b", user("Hi again"), SamplingParams(max_tokens=5)))
        await backend.close()
        return broken, healthy

    broken, healthy = asyncio.run(run())
    assert "simulated device failure" in broken[-1].error and broken[-1].usage.finish_reason == "error"
    assert "".join(e.text for e in broken)  # what streamed before the crash was delivered
    assert healthy[-1].error is None and healthy[-1].usage.completion_tokens == 5


def test_over_long_and_empty_prompts_raise_clear_errors(tiny_chat_model):
    backend = LocalBackend(EngineOptions(dtype="float32"), default_model=tiny_chat_model)

    async def run():
        with pytest.raises(TuichatError, match=r"This message is [\d,]+ tokens long .* holds 511 tokens a conversation"):
            await collect(backend.stream("c", user("word " * 600), LONG))
        with pytest.raises(TuichatError, match="empty"):
            await collect(backend.stream("c", user("  "), LONG))
        ok = await collect(backend.stream("c", user("fine"), SamplingParams(max_tokens=3)))
        await backend.close()
        return ok

    assert asyncio.run(run())[-1].usage.completion_tokens == 3


def test_unknown_model_is_a_backend_error():
    backend = LocalBackend()
    with pytest.raises(TuichatError, match="Unknown model 'nonsense'"):
        asyncio.run(backend.load("nonsense"))


def test_a_loaded_model_stays_out_of_the_collectors_walks_until_it_is_evicted(
    tiny_chat_model, tmp_path, monkeypatch
):
    import gc
    import shutil
    import weakref

    from tuichat.backends import local

    monkeypatch.setattr(local, "MAX_LOADED_MODELS", 1)
    second = str(shutil.copytree(tiny_chat_model, tmp_path / "second"))
    backend = LocalBackend(EngineOptions(dtype="float32"), default_model=tiny_chat_model)

    async def run():
        await backend.load()
        model = backend._loaded[tiny_chat_model].engine.model
        # Frozen: a full collection (all that gc.get_objects lists) does not walk the model.
        walked = not all(obj is not model for obj in gc.get_objects())
        # A reference cycle through the model (as hooks make): once evicted, only the collector frees it.
        model.__dict__["_cycle"] = [model]
        gone = weakref.ref(model)
        del model
        await backend.load(second)
        alive = gone() is not None
        await backend.close()
        return walked, alive

    walked, alive = asyncio.run(run())
    assert not walked
    assert not alive
