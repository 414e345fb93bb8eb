"""Tensor parallelism on CPU ranks (gloo): the same text as one rank, the cache and batching unchanged,
clear errors, and no hang or orphan when a worker dies."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.helpers import hf_greedy, make_tiny, wait_until
from tuichat.backends.protocol import SamplingParams, TuichatError
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
        engine.submit([1, 2, 3], GREEDY, outputs.append)
        # The death is noticed, not waited out: the reply ends well inside the bounded wait below, whose limit
        # is far under the all-reduce timeout a missed death would run into.
        wait_until(lambda: outputs and outputs[-1].finished, "the request to fail")
        assert "worker 1 died" in outputs[-1].error
    finally:
        engine.close()


def test_tp_size_must_divide_the_heads(tiny_source):
    source, _ = tiny_source
    with pytest.raises(TuichatError, match="--tp 3 does not divide this model: 4 attention heads"):
        Engine(load_tiny(source), config=EngineConfig(num_blocks=8, tp=3), source=source)


def test_tp_larger_than_the_visible_gpus_is_refused(monkeypatch):
    from tuichat.engine import parallel

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(TuichatError, match="--tp 2 needs 2 GPUs, but 1 are visible"):
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


def test_a_device_map_over_two_places_keeps_each_layers_kv_where_it_computes(tiny_source, tmp_path):
    """The CPU stand-in for layers on several GPUs: accelerate keeps layer 1 on disk and brings its weights in
    when it runs. Its KV must live where it computes (here the CPU), and the text must stay generate's."""
    from transformers import AutoModelForCausalLM

    source, reference = tiny_source
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "cpu"}
    spread = AutoModelForCausalLM.from_pretrained(source.source, dtype=torch.float32, device_map=device_map,
                                                  offload_folder=tmp_path).eval()
    assert set(spread.hf_device_map.values()) == {"cpu", "disk"}
    assert spread.model.layers[1].self_attn.q_proj.weight.device.type == "meta"  # really offloaded
    engine = Engine(spread, config=EngineConfig(num_blocks=32))
    assert [k.device.type for k in engine.kv.k] == ["cpu", "cpu"]
    prompts = [list(range(7, 30)), list(range(50, 90))]
    for prompt, seq in zip(prompts, engine.generate(prompts, GREEDY)):
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


def test_a_rank_0_failure_mid_forward_stops_the_workers_and_later_submits_fail_fast(tiny_source, monkeypatch):
    """Rank 0 raising between two all-reduces leaves the worker inside one that will never be matched: the
    request fails within seconds, the workers are stopped, and the engine says to load the model again."""
    source, _ = tiny_source
    engine = Engine(load_tiny(source), config=EngineConfig(num_blocks=64, tp=2), source=source)
    engine.start()
    try:
        mlp = engine.model.model.layers[1].mlp
        monkeypatch.setattr(mlp, "forward", lambda x: (_ for _ in ()).throw(RuntimeError("injected on rank 0")))
        outputs = []
        engine.submit([1, 2, 3], GREEDY, outputs.append)
        wait_until(lambda: outputs and outputs[-1].finished, "the failed request to end")
        assert "rank 0 failed mid-step: RuntimeError: injected on rank 0" in outputs[-1].error
        assert "load the model again" in outputs[-1].error
        assert not any(p.is_alive() for p in engine.runner.workers)
        with pytest.raises(TuichatError, match="load the model again"):
            engine.submit([1, 2, 3], GREEDY)
    finally:
        engine.close()


def test_a_worker_failure_mid_forward_is_reported_with_the_workers_own_error(tiny_source, monkeypatch):
    """A plan only a worker fails on (rank 0's own forward is held back until the worker is gone): rank 0
    names the worker and what it said."""
    from tuichat.engine.runner import ModelRunner, RunnerBroken

    source, _ = tiny_source
    engine = Engine(load_tiny(source), config=EngineConfig(num_blocks=64, tp=2), source=source)
    (worker,) = engine.runner.workers
    try:
        def rank_0_waits(self, chunks):
            worker.join(30)
            raise RuntimeError("peer closed the connection")

        monkeypatch.setattr(ModelRunner, "execute", rank_0_waits)
        with pytest.raises(RunnerBroken, match=r"tensor-parallel worker 1 died \(exit code 1\): .*index"):
            engine.runner.execute([StepChunk([1], 0, [10**6], True)])  # a block far outside the worker's pool
    finally:
        engine.close()
    assert not worker.is_alive()


def test_after_a_worker_dies_mid_reply_the_backend_restarts_the_workers(tmp_path):
    """The whole path a user sees: a reply in flight ends with an error naming the dead worker, and the next
    message loads the model again with fresh workers and gets generate's answer."""
    import asyncio

    from test_prompts import build_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from tuichat.backends.protocol import EngineOptions, Message
    from tuichat.bench.backend import BenchBackend

    tokenizer = build_tokenizer("byte-level BPE, ChatML (SmolLM2, Qwen)")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(5)
    reference = LlamaForCausalLM(config).eval()
    reference.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    backend = BenchBackend(EngineOptions(dtype="float32", tp=2), default_model=str(tmp_path))
    question = [Message("user", "the cat sat on a mat?")]

    async def reply(conversation: str, params: SamplingParams, on_event=None):
        events = []
        async for event in backend.stream(conversation, question, params):
            events.append(event)
            if on_event:
                on_event(event)
        return events

    async def scenario():
        killed = []

        def kill_once(event):
            if not killed and event.text:
                (worker,) = backend._loaded[str(tmp_path)].engine.runner.workers
                os.kill(worker.pid, signal.SIGKILL)
                killed.append(worker)

        first = await asyncio.wait_for(reply("a", SamplingParams(max_tokens=400), kill_once), 60)
        assert killed and "tensor-parallel worker 1 died" in first[-1].error
        second = await asyncio.wait_for(reply("b", SamplingParams(max_tokens=10)), 120)
        prompt = backend.cached_token_ids("b")[: second[-1].usage.prompt_tokens]
        await backend.close()
        return second, prompt, backend.cached_token_ids("b")[len(prompt):]

    second, prompt, completion = asyncio.run(scenario())
    assert second[-1].error is None
    assert completion == hf_greedy(reference, prompt, 10)
