"""Engine fidelity and accounting on tiny random-weight models (float32): whatever the batching, chunking,
caching or preemption, greedy output must equal transformers' `generate` token for token."""

from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest

from tests.helpers import finished, hf_greedy, make_tiny, step_until, stepping
from tuichat.backends.protocol import SamplingParams, TuichatError
from tuichat.engine.engine import Engine, EngineConfig
from tuichat.engine.request import Status

GREEDY = SamplingParams(max_tokens=12)
BLOCK = 16


def prompts_of(lengths, seed=1, vocab=320):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def assert_free(engine: Engine) -> None:
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert all(b.ref_count == 0 for b in engine.blocks.blocks)
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_single_request_matches_generate(arch):
    model, reference = make_tiny(arch)
    engine = Engine(model, config=EngineConfig(num_blocks=32))
    prompt = prompts_of([23])[0]
    (seq,) = engine.generate([prompt], GREEDY)
    assert seq.completion_ids == hf_greedy(reference, prompt, 12)
    assert seq.finish_reason == "length"
    assert_free(engine)


def test_requests_joining_at_different_steps_match_generate():
    model, reference = make_tiny()
    engine = Engine(model, config=EngineConfig(num_blocks=128, max_batched_tokens=48))
    prompts = prompts_of([3, 40, 17, 1, 64, 9, 33, 16], seed=2)
    seqs = []
    for prompt in prompts:  # a new request every two steps, while the others decode
        seqs.append(engine.submit(prompt, GREEDY))
        engine.step()
        engine.step()
    batch_sizes = [engine.last_batch_size for _ in stepping(engine, lambda: finished(seqs), "the replies")]
    assert max(batch_sizes) >= 4  # they really shared steps
    for prompt, seq in zip(prompts, seqs):
        assert seq.completion_ids == hf_greedy(reference, prompt, 12)
    assert_free(engine)


def test_chunked_prefill_matches_and_lets_decodes_run():
    model, reference = make_tiny()
    # One token a step, to count them (speculation has its own chunked-prefill test).
    engine = Engine(model, config=EngineConfig(num_blocks=64, max_batched_tokens=8, speculate="off"))
    short, long = prompts_of([4, 150], seed=3)
    first = engine.submit(short, SamplingParams(max_tokens=30))
    engine.step()
    second = engine.submit(long, GREEDY)
    tokens_before = len(first.token_ids)
    for _ in range(5):  # the long prompt needs ~19 chunks of 8; the short one keeps decoding meanwhile
        engine.step()
    assert len(first.token_ids) == tokens_before + 5
    assert 0 < second.num_computed < len(long)
    step_until(engine, lambda: finished([first, second]), "both replies")
    assert second.completion_ids == hf_greedy(reference, long, 12)
    assert first.completion_ids == hf_greedy(reference, short, 30)


def test_preemption_under_a_tiny_pool_keeps_outputs():
    model, reference = make_tiny()
    # 6 blocks of 16 tokens: two 40-token requests growing by 30 tokens cannot both stay.
    engine = Engine(model, config=EngineConfig(num_blocks=6))
    prompts = prompts_of([40, 41], seed=4)
    params = SamplingParams(max_tokens=30)
    seqs = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for prompt, seq in zip(prompts, seqs):
        assert seq.completion_ids == hf_greedy(reference, prompt, 30)
    assert_free(engine)


def test_stress_32_requests_through_a_pool_too_small_for_four():
    model, reference = make_tiny()
    lengths = [random.Random(i).randrange(20, 60) for i in range(32)]
    prompts = prompts_of(lengths, seed=5)
    # Each request needs up to 5 blocks (60 + 16 tokens); 14 blocks cannot hold four at once.
    engine = Engine(model, config=EngineConfig(num_blocks=14, max_batched_tokens=64))
    params = SamplingParams(max_tokens=16)
    seqs = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert all(s.finish_reason == "length" for s in seqs)
    for prompt, seq in list(zip(prompts, seqs))[::4]:  # a sample against generate keeps the test fast
        assert seq.completion_ids == hf_greedy(reference, prompt, 16)
    assert_free(engine)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_prefix_cache_on_and_off_give_the_same_text(prefix_cache):
    model, reference = make_tiny()
    engine = Engine(model, config=EngineConfig(num_blocks=64, prefix_cache=prefix_cache))
    system = prompts_of([50], seed=6)[0]
    prompts = [system + tail for tail in prompts_of([5, 9, 13], seed=7)]
    first = engine.generate(prompts[:1], GREEDY)[0]
    rest = engine.generate(prompts[1:], GREEDY)
    for prompt, seq in zip(prompts, [first] + rest):
        assert seq.completion_ids == hf_greedy(reference, prompt, 12)
    cached = [s.num_cached_tokens for s in rest]
    assert cached == ([48, 48] if prefix_cache else [0, 0])  # 3 full blocks of the shared 50 tokens
    assert_free(engine)


def test_multi_turn_hits_the_cache_for_the_whole_history():
    model, reference = make_tiny()
    engine = Engine(model, config=EngineConfig(num_blocks=128))
    history: list[int] = []
    for turn, user in enumerate(prompts_of([7, 11, 5, 20], seed=8)):
        prompt = history + user
        (seq,) = engine.generate([prompt], GREEDY)
        assert seq.completion_ids == hf_greedy(reference, prompt, 12)
        if turn:
            # Everything before this turn was computed last turn: at most one partial block is missed.
            assert seq.num_cached_tokens >= len(history) - engine.blocks.block_size
        history = list(seq.token_ids)
    assert engine.prefix_hit_rate > 0.5


def test_full_prefix_hit_still_computes_the_last_token():
    model, reference = make_tiny()
    engine = Engine(model, config=EngineConfig(num_blocks=32))
    prompt = prompts_of([32], seed=9)[0]  # exactly two blocks
    engine.generate([prompt], GREEDY)
    (again,) = engine.generate([prompt], GREEDY)
    assert again.num_cached_tokens == 16  # the block with the last token is recomputed
    assert again.completion_ids == hf_greedy(reference, prompt, 12)


def test_cancel_stops_within_a_step_and_frees_blocks():
    model, _ = make_tiny()
    engine = Engine(model, config=EngineConfig(num_blocks=32))
    outputs = []
    seq = engine.submit(prompts_of([20])[0], SamplingParams(max_tokens=100), outputs.append)
    for _ in range(3):
        engine.step()
    assert engine.blocks.num_used > 0
    engine.cancel(seq.id)
    engine.step()
    assert seq.finish_reason == "cancelled" and outputs[-1].finished
    assert len(seq.completion_ids) == 3
    assert_free(engine)


def test_requests_that_can_never_run_fail_at_once():
    model, _ = make_tiny()
    engine = Engine(model, config=EngineConfig(num_blocks=4))
    with pytest.raises(TuichatError, match="KV cache holds 64"):
        engine.submit(list(range(100)), GREEDY)
    with pytest.raises(TuichatError, match="empty"):
        engine.submit([], GREEDY)
    big = Engine(make_tiny()[0], config=EngineConfig(num_blocks=200))
    with pytest.raises(TuichatError, match="at most 1023"):
        big.submit([1] * 1024, GREEDY)
    assert not engine.has_work() and not big.has_work()


def test_a_sequence_that_outgrows_the_pool_ends_with_length():
    model, _ = make_tiny()
    engine = Engine(model, config=EngineConfig(num_blocks=2))
    (seq,) = engine.generate([prompts_of([20])[0]], SamplingParams(max_tokens=100))
    assert seq.finish_reason == "length" and len(seq) == 32
    assert_free(engine)


def test_seed_gives_the_same_sample_whatever_shares_the_batch():
    model, _ = make_tiny()
    engine = Engine(model, config=EngineConfig(num_blocks=64))
    prompt = prompts_of([10])[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=15)
    alone = engine.generate([prompt], params)[0].completion_ids
    crowded = engine.generate([prompt] + prompts_of([5, 30], seed=10), params)[0].completion_ids
    other_seed = engine.generate([prompt], replace(params, seed=99))[0]
    assert alone == crowded
    assert other_seed.completion_ids != alone


def test_top_k_one_is_greedy():
    model, reference = make_tiny()
    engine = Engine(model, config=EngineConfig(num_blocks=64))
    prompt = prompts_of([12])[0]
    (seq,) = engine.generate([prompt], SamplingParams(temperature=0.8, top_k=1, max_tokens=12))
    assert seq.completion_ids == hf_greedy(reference, prompt, 12)


@pytest.mark.parametrize("mode", ["static", "off"])
def test_static_and_off_batching_give_the_same_text(mode):
    model, reference = make_tiny()
    engine = Engine(model, config=EngineConfig(num_blocks=64, batching=mode))
    prompts = prompts_of([5, 17, 9], seed=11)
    seqs = [engine.submit(p, GREEDY) for p in prompts[:2]]
    engine.step()
    seqs.append(engine.submit(prompts[2], GREEDY))
    running_counts = [len(engine.scheduler.running) for _ in stepping(engine, lambda: finished(seqs), "the replies")]
    if mode == "off":
        assert max(running_counts) == 1
    else:  # the late request waits for the first batch to finish: nobody joins a static batch
        assert seqs[2].first_scheduled > max(seqs[0].first_scheduled, seqs[1].first_scheduled)
        assert running_counts.count(3) == 0
    for prompt, seq in zip(prompts, seqs):
        assert seq.completion_ids == hf_greedy(reference, prompt, 12)


def test_eos_token_finishes_with_stop():
    model, reference = make_tiny()
    prompt = prompts_of([8])[0]
    expected = hf_greedy(reference, prompt, 12)
    model.generation_config.eos_token_id = expected[4]
    engine = Engine(model, config=EngineConfig(num_blocks=32))
    (seq,) = engine.generate([prompt], GREEDY)
    assert seq.finish_reason == "stop"
    assert seq.completion_ids == expected[: expected.index(expected[4]) + 1]


def test_an_idle_engine_thread_ends_and_the_next_submit_is_served(monkeypatch):
    """The engine thread ends when idle (its OpenMP pool with it; see Engine.start). With no idle time at
    all, every submit races a thread that is ending: each reply must still come, whole and right."""
    import threading

    from tuichat.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "IDLE_EXIT_S", 0.0)
    model, reference = make_tiny()
    engine = Engine(model, config=EngineConfig(num_blocks=64))
    engine.start()
    params = SamplingParams(max_tokens=3)
    prompts = prompts_of([5 + i % 7 for i in range(40)], seed=3)
    expected = {tuple(p): hf_greedy(reference, p, 3) for p in prompts}
    served_by = set()
    try:
        for pair in range(0, len(prompts), 2):  # two at a time, from two threads
            results, done = {}, threading.Semaphore(0)

            def send(prompt):
                tokens = []

                def on_output(out):
                    served_by.add(threading.current_thread())  # the object: an ident may be reused
                    tokens.extend(out.new_token_ids)
                    if out.finished:
                        results[tuple(prompt)] = tokens
                        done.release()
                engine.submit(prompt, params, on_output)

            senders = [threading.Thread(target=send, args=(p,)) for p in prompts[pair:pair + 2]]
            for sender in senders:
                sender.start()
            for _ in senders:
                assert done.acquire(timeout=30), "a submit was lost to an ending engine thread"
            assert all(results[tuple(p)] == expected[tuple(p)] for p in prompts[pair:pair + 2])
            deadline = time.monotonic() + 30
            while engine._thread is not None:  # idle: the thread ends (the next submit starts another)
                assert time.monotonic() < deadline, "the idle engine thread did not end"
                time.sleep(0.005)
    finally:
        engine.close()
    assert len(served_by) > 1  # replies came from more than one engine thread: they did end in between
    assert_free(engine)


def test_engine_thread_serves_requests_and_reports_metrics():
    model, reference = make_tiny()
    engine = Engine(model, config=EngineConfig(num_blocks=64))
    engine.start()
    try:
        import threading

        done = threading.Event()
        outputs = []

        def collect(out):
            outputs.append(out)
            if out.finished:
                done.set()

        prompt = prompts_of([9])[0]
        engine.submit(prompt, GREEDY, collect)
        assert done.wait(30)
        usage = outputs[-1].usage
        assert usage.prompt_tokens == 9 and usage.completion_tokens == 12 and usage.finish_reason == "length"
        assert [t for o in outputs for t in o.new_token_ids] == hf_greedy(reference, prompt, 12)
        assert usage.queue_ms is not None and usage.e2e_ms >= usage.queue_ms
        assert engine.tokens_per_s() > 0
    finally:
        engine.close()
    assert_free(engine)


def test_prefix_hit_rate_is_live_while_requests_still_run():
    model, _ = make_tiny()
    engine = Engine(model, config=EngineConfig(num_blocks=64))
    system = prompts_of([40], seed=12)[0]
    engine.generate([system + [1]], GREEDY)
    second = engine.submit(system + [2], SamplingParams(max_tokens=50))
    engine.step()
    assert second.status is Status.RUNNING
    assert engine.prefix_hit_rate == pytest.approx(32 / (41 + 41))


@pytest.mark.parametrize("presence, frequency", [(0.0, 1.5), (1.0, 0.0), (-0.5, 0.7)])
def test_presence_and_frequency_penalties_are_openais_whatever_shares_the_batch(presence, frequency):
    """Each greedy token is the argmax of the plain model's logits less OpenAI's penalties over the reply so
    far, computed here from their definition; batched with an unpenalized row, which keeps its exact answer."""
    import torch

    model, reference = make_tiny("llama")
    engine = Engine(model, config=EngineConfig(num_blocks=64))
    prompt, other = prompts_of([9, 14])
    penalized = SamplingParams(max_tokens=20, presence_penalty=presence, frequency_penalty=frequency)
    seqs = [engine.submit(prompt, penalized), engine.submit(other, SamplingParams(max_tokens=20))]
    for _ in stepping(engine, lambda: finished(seqs), "both replies"):
        assert engine.last_batch_size == 2 or any(s.status is Status.FINISHED for s in seqs)
    reply = seqs[0].completion_ids
    with torch.inference_mode():
        for i, token in enumerate(reply):
            logits = reference(torch.tensor([prompt + reply[:i]])).logits[0, -1]
            counts = torch.bincount(torch.tensor(reply[:i], dtype=torch.long), minlength=logits.shape[0]).float()
            want = logits - frequency * counts - presence * (counts > 0).float()
            assert token == int(want.argmax()), f"token {i}"
    assert seqs[1].completion_ids == hf_greedy(reference, other, 20)
    assert reply != hf_greedy(reference, prompt, 20)  # the penalties did change the reply
    assert_free(engine)
    engine.close()


def test_penalties_out_of_openais_range_are_refused():
    for value in (2.5, -3, float("nan")):
        with pytest.raises(TuichatError, match="penalty"):
            SamplingParams(presence_penalty=value)


def test_a_background_prefill_runs_only_in_steps_with_nothing_else_to_do():
    """A prompt prefilled while its user types: no step that carries a running reply carries its tokens (so
    the reply's next token never waits on it), it runs once the engine is idle, and the turn sent later finds
    its blocks in the prefix cache."""
    model, reference = make_tiny()
    engine = Engine(model, config=EngineConfig(num_blocks=64, max_batched_tokens=64))
    streaming, typed = prompts_of([20, 100], seed=21)
    steps = []
    schedule = engine.scheduler.schedule

    def recording():
        chunks = schedule()
        steps.append({(c.seq.id, c.length) for c in chunks})
        return chunks

    engine.scheduler.schedule = recording
    reply = engine.submit(streaming, SamplingParams(max_tokens=30))
    engine.step()
    background = engine.submit(typed, SamplingParams(max_tokens=1), background=True)
    step_until(engine, lambda: finished([reply, background]), "the reply and the prefill")
    shared = [s for s in steps if {i for i, _ in s} == {reply.id, background.id}]
    assert not shared
    assert reply.completion_ids == hf_greedy(reference, streaming, 30)
    ran = [i for i, s in enumerate(steps) if background.id in {j for j, _ in s}]
    last_reply_step = max(i for i, s in enumerate(steps) if reply.id in {j for j, _ in s})
    assert ran and min(ran) > last_reply_step
    (turn,) = engine.generate([typed + [9, 8, 7]], GREEDY)
    assert turn.num_cached_tokens == len(typed) // BLOCK * BLOCK
    assert turn.completion_ids == hf_greedy(reference, typed + [9, 8, 7], 12)


def test_a_request_waiting_for_blocks_takes_them_from_a_background_prefill():
    model, reference = make_tiny()
    engine = Engine(model, config=EngineConfig(num_blocks=8, max_batched_tokens=32))
    background = engine.submit(prompts_of([100], seed=22)[0], SamplingParams(max_tokens=1), background=True)
    engine.step()  # admitted: it holds all eight blocks
    prompt = prompts_of([60], seed=23)[0]
    (seq,) = engine.generate([prompt], GREEDY)
    assert seq.completion_ids == hf_greedy(reference, prompt, 12)
    step_until(engine, lambda: finished([background]), "the prefill, afterwards")
