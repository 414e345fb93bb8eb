"""Tensor parallelism on CPU ranks (gloo): the same text as one rank, the cache and batching unchanged,
clear errors, and no hang or orphan when a worker dies."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from conftest import hf_greedy, make_tiny
from tuichat.backend import BackendError, SamplingParams
from tuichat.catalog import resolve
from tuichat.engine.engine import Engine, EngineConfig
from tuichat.engine.runner import StepChunk

GREEDY = SamplingParams(max_tokens=10)


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    _, reference = make_tiny()
    folder = tmp_path_factory.mktemp("tiny-llama")
    reference.save_pretrained(folder)
    return resolve(str(folder)), reference


def load_tiny(source):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(source.source, dtype=torch.float32).eval()


def test_tp2_logits_and_text_match_one_rank(tiny_source):
    source, reference = tiny_source
    single = Engine(load_tiny(source), config=EngineConfig(num_blocks=64))
    sharded = Engine(load_tiny(source), config=EngineConfig(num_blocks=64, tp=2), source=source)
    try:
        plan = [StepChunk(list(range(3, 40)), 0, [0, 1, 2], True)]
        assert torch.allclose(single.runner.execute(plan), sharded.runner.execute(plan), atol=1e-5)
        prompts = [list(range(5, 25)), list(range(100, 140)), list(range(5, 25)) + [7, 8, 9]]
        # Concurrent requests; the third shares the first one's prefix and must hit the cache.
        first = sharded.generate(prompts[:2], GREEDY)
        (third,) = sharded.generate(prompts[2:], GREEDY)
        assert third.num_cached_tokens == 16
        for prompt, seq in zip(prompts, first + [third]):
            assert seq.completion_ids == hf_greedy(reference, prompt, 10)
    finally:
        sharded.close()
    assert not any(p.is_alive() for p in sharded.runner.workers)  # no orphans


def test_killed_worker_fails_the_request_within_seconds(tiny_source):
    source, _ = tiny_source
    engine = Engine(load_tiny(source), config=EngineConfig(num_blocks=64, tp=2), source=source)
    engine.start()
    try:
        (worker,) = engine.runner.workers
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(5)
        outputs = []
        started = time.monotonic()
        engine.submit([1, 2, 3], GREEDY, outputs.append)
        while not (outputs and outputs[-1].finished) and time.monotonic() - started < 20:
            time.sleep(0.05)
        assert outputs and outputs[-1].finished
        assert "worker 1 died" in outputs[-1].error
        assert time.monotonic() - started < 10
    finally:
        engine.close()


def test_tp_size_must_divide_the_heads(tiny_source):
    source, _ = tiny_source
    with pytest.raises(BackendError, match="--tp 3 does not divide this model: 4 attention heads"):
        Engine(load_tiny(source), config=EngineConfig(num_blocks=8, tp=3), source=source)


def test_tp_larger_than_the_visible_gpus_is_refused(monkeypatch):
    from tuichat.engine import parallel

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(BackendError, match="--tp 2 needs 2 GPUs, but 1 are visible"):
        parallel.start_workers(dict(resolved=None, device="cuda", dtype="float32", world=2, num_blocks=1,
                                    block_size=16, kv_heads=2, head_dim=16, num_layers=1))


def test_embedded_model_tp3_gives_the_same_greedy_text(embedded):
    resolved, model, reference, tokenizer = embedded
    from tuichat.engine import loader

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the tallest mountain?"}], add_generation_prompt=True, tokenize=True
    )
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    sharded_model, _ = loader.load(resolved, torch.device("cpu"), torch.float32, with_tokenizer=False)
    engine = Engine(sharded_model, tokenizer, EngineConfig(num_blocks=32, tp=3), source=resolved)
    try:
        (seq,) = engine.generate([prompt], SamplingParams(max_tokens=20))
    finally:
        engine.close()
    assert seq.completion_ids == hf_greedy(reference, prompt, 20, eos_token_id=tokenizer.eos_token_id)


def test_device_map_auto_loads_and_matches_generate(tiny_source):
    from transformers import AutoModelForCausalLM

    source, reference = tiny_source
    spread = AutoModelForCausalLM.from_pretrained(source.source, dtype=torch.float32, device_map="auto").eval()
    engine = Engine(spread, config=EngineConfig(num_blocks=32))
    prompt = list(range(7, 30))
    (seq,) = engine.generate([prompt], GREEDY)
    assert seq.completion_ids == hf_greedy(reference, prompt, 10)


def test_tp2_preemption_and_cancel_work_unchanged(tiny_source):
    source, reference = tiny_source
    engine = Engine(load_tiny(source), config=EngineConfig(num_blocks=6, tp=2), source=source)
    try:
        prompts = [list(range(40, 80)), list(range(90, 131))]
        seqs = engine.generate(prompts, SamplingParams(max_tokens=30))
        assert engine.scheduler.num_preemptions > 0
        for prompt, seq in zip(prompts, seqs):
            assert seq.completion_ids == hf_greedy(reference, prompt, 30)
        victim = engine.submit(list(range(5, 25)), SamplingParams(max_tokens=50))
        for _ in range(3):
            engine.step()
        engine.cancel(victim.id)
        engine.step()
        assert victim.finish_reason == "cancelled" and engine.blocks.num_used == 0
    finally:
        engine.close()
