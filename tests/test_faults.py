"""An engine that cannot hang: a failure injected at each place of a step ends only the requests it belongs
to (with an error event), leaves the engine serving the rest, and frees every block; a failure that belongs to
no one request ends them all and the engine goes on from a clean slate; closing and evicting never leave a
stream waiting. Every wait here is bounded, so a hang fails the test instead of stalling the suite."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.helpers import hf_greedy, make_tiny, step_until
from tuichat.backends.protocol import EngineOptions, Message, SamplingParams, TuichatError
from tuichat.engine import engine as engine_module
from tuichat.engine.engine import Engine, EngineConfig
from tuichat.engine.scheduler import MAX_OVERTAKES

GREEDY = SamplingParams(max_tokens=8)
WAIT_S = 60  # far above any of these steps on a loaded 2-core machine; reached only by a hang


class Stream:
    """One request's events, collected from the engine thread."""

    def __init__(self) -> None:
        self.events = []
        self.done = threading.Event()

    def __call__(self, out) -> None:
        self.events.append(out)
        if out.finished:
            self.done.set()

    @property
    def final(self):
        assert self.done.wait(WAIT_S), "a stream never ended"
        return self.events[-1]

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.events for t in e.new_token_ids]


def prompts(n: int, length: int = 12) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 300 + 5 for j in range(length)] for i in range(n)]


def wait_idle(engine: Engine) -> None:
    deadline = time.monotonic() + WAIT_S
    while engine.has_work() or engine.blocks.num_used:
        assert time.monotonic() < deadline, "the engine never went idle"
        time.sleep(0.02)


@pytest.fixture
def served():
    """A tiny model served on its engine thread, with its reference for `generate`."""
    model, reference = make_tiny()
    engine = Engine(model, config=EngineConfig(num_blocks=64))
    engine.start()
    yield engine, reference
    engine.close()


def run(engine: Engine, batch: list[list[int]], params: SamplingParams = GREEDY) -> list[Stream]:
    streams = [Stream() for _ in batch]
    for prompt, stream in zip(batch, streams):
        engine.submit(prompt, params, stream)
    for stream in streams:
        assert stream.final.finished
    return streams


def assert_serves(engine: Engine, reference) -> None:
    """Every block free, and a new request answered exactly."""
    wait_idle(engine)
    assert engine.blocks.num_free == engine.blocks.num_blocks
    (stream,) = run(engine, prompts(1, 20))
    assert stream.final.error is None and stream.tokens == hf_greedy(reference, prompts(1, 20)[0], 8)


def poison(monkeypatch, target, name: str, when) -> list[int]:
    """Make `target.name` raise when `when(*args)` holds; returns a list counting the raises."""
    original = getattr(target, name)
    raised = []

    def wrapped(*args, **kwargs):
        if when(*args, **kwargs):
            raised.append(1)
            raise RuntimeError(f"injected {name} failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, wrapped)
    return raised


POISONED = 299  # a token id only the poisoned prompt has


def test_a_forward_failure_of_one_request_fails_only_that_request(served, monkeypatch):
    engine, reference = served
    runner = engine.runner
    raised = poison(monkeypatch, runner, "execute",
                    lambda chunks: any(POISONED in c.token_ids for c in chunks))
    batch = prompts(3) + [[POISONED] * 10]
    streams = run(engine, batch)
    assert raised
    assert "injected execute failure" in streams[3].final.error and streams[3].final.usage.finish_reason == "error"
    for prompt, stream in zip(batch[:3], streams[:3]):  # retried alone, the others were unharmed
        assert stream.final.error is None and stream.tokens == hf_greedy(reference, prompt, 8)
    assert_serves(engine, reference)


def test_a_sampler_failure_on_one_requests_parameters_fails_only_that_request(served, monkeypatch):
    engine, reference = served
    poison(monkeypatch, engine_module, "sample", lambda logits, params, *rest: any(p.seed == 666 for p in params))
    bad = SamplingParams(temperature=0.7, seed=666, max_tokens=8)
    streams = [Stream() for _ in range(3)]
    batch = prompts(3)
    engine.submit(batch[0], GREEDY, streams[0])
    engine.submit(batch[1], bad, streams[1])
    engine.submit(batch[2], GREEDY, streams[2])
    assert "injected sample failure" in streams[1].final.error
    for i in (0, 2):
        assert streams[i].final.error is None and streams[i].tokens == hf_greedy(reference, batch[i], 8)
    assert_serves(engine, reference)


def test_a_detokenizer_failure_fails_only_that_request(served, monkeypatch):
    engine, reference = served

    class Detok:  # engines without a tokenizer have none; give every request one, broken for one request
        def __init__(self, tokenizer, prompt_ids):
            self.broken = prompt_ids[0] == POISONED

        def add(self, token):
            if self.broken:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return "x"

    engine.tokenizer = object()
    monkeypatch.setattr(engine_module, "IncrementalDetokenizer", Detok)
    batch = prompts(2) + [[POISONED] * 10]
    streams = run(engine, batch)
    assert "UnicodeDecodeError" in streams[2].final.error
    assert [s.final.error for s in streams[:2]] == [None, None]
    assert all(s.tokens == hf_greedy(reference, p, 8) for s, p in zip(streams[:2], batch))
    engine.tokenizer = None
    assert_serves(engine, reference)


def test_a_consumer_that_went_away_cancels_its_request(served):
    """A callback that raises (the stream's event loop closed, say) ends that request and nothing else."""
    engine, reference = served
    gone = threading.Event()

    def closed_loop(out):
        gone.set()
        raise RuntimeError("Event loop is closed")

    engine.submit(prompts(1, 30)[0], SamplingParams(max_tokens=200), closed_loop)
    (other,) = run(engine, prompts(1))
    assert gone.is_set() and other.final.error is None
    assert_serves(engine, reference)  # the orphan was cancelled: its blocks are free


def test_a_scheduler_failure_ends_every_request_and_the_engine_goes_on(served, monkeypatch):
    engine, reference = served
    raised = poison(monkeypatch, engine.scheduler, "schedule", lambda: not raised)
    streams = run(engine, prompts(3))
    assert raised
    assert all("internal error" in s.final.error and "injected schedule failure" in s.final.error for s in streams)
    assert engine.broken is None
    assert_serves(engine, reference)


def test_an_engine_failing_every_step_stops_and_later_submits_fail_at_once(served, monkeypatch):
    engine, _ = served
    monkeypatch.setattr(Engine, "step", lambda self: (self._drain_inbox(), 1 / 0))
    for _ in range(3):
        run(engine, prompts(1))
    deadline = time.monotonic() + WAIT_S
    while engine.broken is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert "failed three steps in a row" in engine.broken
    with pytest.raises(TuichatError, match="failed three steps in a row"):
        engine.submit(prompts(1)[0], GREEDY)


def test_submit_to_a_closed_engine_raises_and_close_ends_the_inbox():
    model, _ = make_tiny()
    engine = Engine(model, config=EngineConfig(num_blocks=16))  # no thread: nothing drains the inbox but close
    queued = Stream()
    engine.submit(prompts(1)[0], GREEDY, queued)
    engine.close()
    assert queued.final.error == "The engine was shut down." and queued.final.usage.finish_reason == "error"
    with pytest.raises(TuichatError, match="shut down"):
        engine.submit(prompts(1)[0], GREEDY)


def test_close_during_a_step_leaves_the_step_alone_and_ends_its_requests(monkeypatch):
    model, _ = make_tiny()
    engine = Engine(model, config=EngineConfig(num_blocks=16))
    in_step, release = threading.Event(), threading.Event()
    original = engine.runner.execute

    def slow(chunks):
        in_step.set()
        release.wait(WAIT_S)
        return original(chunks)

    monkeypatch.setattr(engine.runner, "execute", slow)
    engine.start()
    stream = Stream()
    engine.submit(prompts(1)[0], SamplingParams(max_tokens=50), stream)
    assert in_step.wait(WAIT_S)
    # Once close() joins the engine thread it has done all it does before the step ends: by then it must not
    # have touched the scheduler.
    thread, joining = engine._thread, threading.Event()
    join = thread.join
    thread.join = lambda timeout=None: (joining.set(), join(timeout))
    closer = threading.Thread(target=engine.close)
    closer.start()
    assert joining.wait(WAIT_S), "close() never waited for the engine thread"
    assert not stream.done.is_set() and engine.scheduler.running
    release.set()
    closer.join(WAIT_S)
    assert stream.final.error == "The engine was shut down."


def test_the_token_budget_covers_every_sequence_it_may_run():
    model, reference = make_tiny()
    engine = Engine(model, config=EngineConfig(num_blocks=64, max_batched_tokens=4, max_num_seqs=16))
    assert engine.scheduler.max_num_seqs == 4
    batch = prompts(6, 5)
    seqs = engine.generate(batch, GREEDY)
    for prompt, seq in zip(batch, seqs):
        assert seq.completion_ids == hf_greedy(reference, prompt, 8)


def test_a_request_that_does_not_fit_lets_smaller_ones_pass_but_not_for_ever():
    model, reference = make_tiny()
    # 8 blocks of 16: a running 60-token request holds 4 and grows to 7, so a 70-token newcomer (5 blocks)
    # waits until it ends, while requests of one block could go in beside it.
    engine = Engine(model, config=EngineConfig(num_blocks=8))
    first = engine.submit(prompts(1, 60)[0], SamplingParams(max_tokens=40))
    engine.step()
    big = engine.submit(prompts(2, 70)[1], SamplingParams(max_tokens=4))
    small = [engine.submit(p, SamplingParams(max_tokens=2)) for p in prompts(MAX_OVERTAKES + 4, 3)]
    engine.step()
    assert big.num_cached_tokens is None  # still waiting
    admitted = [s for s in small if s.num_cached_tokens is not None]
    assert admitted, "the small requests waited behind the big one"
    step_until(engine, lambda: big.num_cached_tokens is not None, "the big request admitted", limit=200)
    # Passed at most MAX_OVERTAKES times, the big one went before every request behind it still waiting.
    ahead = sum(s.first_scheduled is not None and s.first_scheduled < big.first_scheduled for s in small)
    assert 1 <= ahead <= MAX_OVERTAKES and len(small) - ahead >= 4
    step_until(engine, lambda: not engine.has_work(), "every reply")
    assert big.completion_ids == hf_greedy(reference, prompts(2, 70)[1], 4)
    assert first.completion_ids == hf_greedy(reference, prompts(1, 60)[0], 40)


def test_eviction_never_closes_an_engine_a_stream_is_using(tmp_path, monkeypatch):
    """Three models, two slots: tabs sending to all three at once, over and over, must all get their replies."""
    from tuichat.backends import local
    from tuichat.backends.local import LocalBackend

    folders = []
    for seed in range(3):
        _, reference = make_tiny(seed=seed)
        folder = tmp_path / f"model-{seed}"
        reference.save_pretrained(folder)
        folders.append(str(folder))
    assert local.MAX_LOADED_MODELS == 2
    backend = LocalBackend(EngineOptions(dtype="float32", kv_cache_mb=1))
    closed = []
    original_drop = LocalBackend._drop
    monkeypatch.setattr(LocalBackend, "_drop", lambda self, name: closed.append(name) or original_drop(self, name))

    class Tokens:  # the tiny models have no tokenizer: a stand-in chat template of ids
        eos_token_id = None

        def apply_chat_template(self, messages, **kwargs):
            return " ".join(m["content"] for m in messages)

        def __call__(self, text, **kwargs):
            ids = [ord(c) % 300 for c in text]
            return {"input_ids": ids, "offset_mapping": [(i, i + 1) for i in range(len(ids))]}

        def decode(self, ids, **kwargs):
            return ""

    from tuichat.engine import loader

    original_load = loader.load
    monkeypatch.setattr(loader, "load", lambda *a, **k: (original_load(*a, **{**k, "with_tokenizer": False})[0], Tokens()))

    async def tab(i: int, model: str):
        events = [e async for e in backend.stream(f"tab-{i}", [Message("user", f"hello {i}")],
                                                  SamplingParams(max_tokens=6), model=model)]
        return events[-1]

    async def rounds():
        finals = []
        for r in range(3):
            finals += await asyncio.wait_for(asyncio.gather(*(tab(3 * r + i, folders[i]) for i in range(3))), WAIT_S)
        await backend.close()
        return finals

    finals = asyncio.run(rounds())
    assert closed, "no model was ever evicted: the test did not exercise eviction"
    assert all(f.error is None and f.usage.completion_tokens == 6 for f in finals)
