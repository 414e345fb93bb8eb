"""What tests share besides fixtures (conftest.py): waiting for a condition, tiny models, reference decodes,
the packed engines' prompts and measures. Imported as `from tests.helpers import ...`, the one way."""

from __future__ import annotations

import contextlib
import copy
import random
import socket
import stat
import threading
import time
from pathlib import Path


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def wait_until(condition, what: str = "condition", *, timeout: float = 30.0) -> None:
    """until() for a test that waits on other threads or processes outside an event loop."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def stepping(engine, done, what: str, *, limit: int = 1000):
    """Step `engine` on this thread until `done()`, yielding after each step; fail naming `what` after `limit`
    steps: a count, not a time, so an engine that stops making progress fails by name however slow the machine."""
    for _ in range(limit):
        if done():
            return
        engine.step()
        yield
    assert done(), f"{what}: not done after {limit} engine steps"


def step_until(engine, done, what: str, *, limit: int = 1000) -> None:
    for _ in stepping(engine, done, what, limit=limit):
        pass


def finished(seqs) -> bool:
    from tuichat.engine.request import Status

    return all(s.status is Status.FINISHED for s in seqs)


SERVE_KEY = "sk-tuichat-test"  # the API key of conftest's `tuichat serve`


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def loopback_server(app):
    """An ASGI app served by uvicorn on a thread, on 127.0.0.1 at a free port; its base URL, and always stopped
    (requests still open are cut after a second)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, name="loopback-server")
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), "the loopback server to start", timeout=30)
        assert server.started, "the loopback server did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextlib.contextmanager
def server_process(argv: list[str], port: int, log: Path, env: dict[str, str], what: str, timeout: float = 180):
    """A server started as its own process on 127.0.0.1:`port`, ready once its /health answers 200; its root
    URL. Always stopped; its output goes to `log`, and is shown if it exits early."""
    import subprocess

    import httpx

    base = f"http://127.0.0.1:{port}"
    with open(log, "w+") as out:
        process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)

        def ready() -> bool:
            assert process.poll() is None, f"{what} exited:\n{log.read_text()[-3000:]}"
            try:
                return httpx.get(f"{base}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_until(ready, f"{what} to load its model", timeout=timeout)
            yield base
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


# tuichat's CPU kernels as built for this CPU, for Zen 4-like CPUs (AVX-512 with BF16, no AMX) and for most
# laptops (AVX2): each -march value with the CPU flags it needs to run here.
CPU_BUILDS = {"native": set(), "cooperlake": {"avx512f", "avx512_bf16"}, "haswell": {"avx2", "fma"}}

# The machine kinds CI (.ci/run) lands on: the Zen 4 kind (AVX512-BF16 and VNNI, no AMX), the Ice Lake kind
# (AVX-512 VNNI, no BF16) and the Intel Xeon with AMX. What a skip here says runs it.
RUNS_ON = {
    "native": "every machine kind, in its own instruction set",
    "cooperlake": "the Zen 4 kind and the Intel Xeon with AMX (the Ice Lake kind has no AVX512-BF16)",
    "haswell": "every machine kind",
    "amx": "the Intel Xeon with AMX alone (arch/x86/amx.c and decoder.c's AMX branches)",
    "kernels": "every machine kind, with the C compiler its image has",
    "llama-server": "no machine kind as CI sets it up: by hand, on any kind, with TUICHAT_LLAMA_SERVER set",
}


def cannot_run(build: str, flags: set[str]) -> str:
    """The skip reason of a CPU build this CPU lacks the flags for."""
    return f"this CPU lacks {', '.join(sorted(CPU_BUILDS[build] - flags))} for a {build} build: runs on {RUNS_ON[build]}"


def no_kernels(why: str) -> str:
    return f"no kernels here ({why}): they build and run on {RUNS_ON['kernels']}"


TINY = {
    "llama": dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
    "qwen2": dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
}


def make_tiny(arch: str = "llama", seed: int = 0):
    """A random-weight model (float32, eval) plus an identical twin with its own config object: the engine
    switches its model to paged attention, and models built from one config object would share that."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    config = config_cls(**TINY[arch], eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    reference = model_cls(copy.deepcopy(config)).eval()
    model = model_cls(copy.deepcopy(config)).eval()
    model.load_state_dict(reference.state_dict())
    return model, reference


def echoing_prompts(count: int, seed: int = 3) -> list[list[int]]:
    """Prompts that repeat a phrase of their own, as chat quotes its context: tiny random models keep repeating
    it, so drafts are proposed, and some rejected."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        phrase = [rng.randrange(320) for _ in range(rng.randrange(3, 9))]
        prompts.append([rng.randrange(320) for _ in range(i % 4)] + phrase * rng.randrange(2, 5))
    return prompts


def cache_contents(cache: Path):
    """(metadata, {name: tensor}) of a packed-weights cache file (quant.packed_weights')."""
    from safetensors import safe_open

    with safe_open(str(cache), "pt") as file:  # clone: get_tensor gives views of the mapped file
        return file.metadata(), {name: file.get_tensor(name).clone() for name in file.keys()}


# Token prompts for the packed-weights engines (test_gguf_engine, test_dense_quant): a long, a short, a third
# that is a prefix of the first and the second's end.
PROMPTS = [[(7 * i + 3) % 300 + 5 for i in range(40)], [200, 7, 7, 31, 90, 4, 18], list(range(100, 121))]


def greedy(engine, prompts: list[list[int]], tokens: int = 10) -> list[list[int]]:
    from tuichat.backends.protocol import SamplingParams

    seqs = engine.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0))
    return [s.token_ids[len(p):] for s, p in zip(seqs, prompts)]


def float32_continuations(reference, tokens: int = 12, prompts=PROMPTS):
    """(each of `prompts` with the float32 model's greedy continuation, float32's logits along them), by a loop
    of full forwards (quicker than generate here)."""
    import torch

    sequences = []
    with torch.inference_mode():
        for sequence in map(list, prompts):
            for _ in range(tokens):
                sequence.append(int(reference(torch.tensor([sequence])).logits[0, -1].argmax()))
            sequences.append(sequence)
        want = torch.cat([reference(torch.tensor([s])).logits[0, len(p) - 1:-1] for s, p in zip(sequences, prompts)])
    return sequences, want


# Past decoder.c's attention split (every 256 positions): a row attends in parts merged afterwards.
LONG_PROMPTS = [[(11 * i) % 300 + 7 for i in range(600)], [(13 * i + 5) % 290 + 9 for i in range(250)]]


def teacher_forced_error(served, sequences, want, prompts=PROMPTS):
    """(per row, the engine's largest logit error as a share of float32's logit range; the share of rows whose
    argmax is float32's), the engine fed `sequences` as float32 wrote them: each prompt (its first of
    `prompts`' lengths) in one chunk, then one decode step per token."""
    import torch

    from tuichat.engine.runner import StepChunk

    rows = []
    for sequence, prompt in zip(sequences, prompts):
        start, table = len(prompt), list(range(served.blocks.blocks_for(len(sequence))))
        rows.append(served.runner.execute([StepChunk(sequence[:start], 0, table, True)]))
        rows += [served.runner.execute([StepChunk([sequence[i]], i, table, True)]) for i in range(start, len(sequence) - 1)]
    got = torch.cat(rows)
    spread = want.amax(dim=1) - want.amin(dim=1)
    return (got - want).abs().amax(dim=1) / spread, float((got.argmax(dim=1) == want.argmax(dim=1)).float().mean())


def whole_and_row_by_row(served):
    """The last logits of a 300-token prompt run in one step (decoder.c attends its consecutive rows together,
    in parts past 256, across a sliding window's start) and of the same prompt fed one row a step."""
    from tuichat.engine.runner import StepChunk

    prompt = [(7 * i + 3) % 300 + 5 for i in range(300)]
    whole = served.runner.execute([StepChunk(prompt, 0, list(range(19)), True)])
    for i, token in enumerate(prompt):
        alone = served.runner.execute([StepChunk([token], i, list(range(20, 39)), i == len(prompt) - 1)])
    return whole, alone


def replies_independent_of_batching(make_engine) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy replies, token for token, whether a prompt runs alone in chunks of 64, in chunks of a 10-token
    budget sharing steps with other prompts' decodes, or from the prefix cache. Returns (the prompts, their
    replies alone); the fourth prompt is 600 tokens long."""
    from tuichat.backends.protocol import SamplingParams

    long_prompt = [(11 * i) % 300 + 7 for i in range(600)]
    prompts = [PROMPTS[0] + PROMPTS[2], PROMPTS[1], PROMPTS[2], long_prompt]
    alone = make_engine(prefix_cache=False, max_batched_tokens=64)
    expected = [greedy(alone, [p])[0] for p in prompts]
    alone.close()

    busy = make_engine(max_batched_tokens=10)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    seqs = [busy.submit(prompts[0], params)]
    busy.step()
    seqs += [busy.submit(p, params) for p in prompts[1:3]]
    batch_sizes = [busy.last_batch_size for _ in stepping(busy, lambda: finished(seqs), "the replies")]
    assert max(batch_sizes) == 3
    assert [s.token_ids[len(p):] for s, p in zip(seqs, prompts)] == expected[:3]
    # The third prompt is a prefix of the first: served from the prefix cache, its reply is the same.
    cached = busy.generate([prompts[2]], params)[0]
    assert cached.num_cached_tokens > 0 and cached.token_ids[len(prompts[2]):] == expected[2]
    busy.close()
    return prompts, expected


CONVERSION_STAGES: list[tuple[str, float | None]] = []  # what the session's one GGUF conversion reported


def hf_greedy(reference, prompt_ids: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    """Plain transformers greedy decoding: the ground truth the engine must match token for token."""
    import torch

    out = reference.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )
    return out[0, len(prompt_ids):].tolist()


def template_ids(tokenizer, messages) -> list[int]:
    """transformers' own chat template, tokenized by transformers: what a plain `generate` user would run."""
    out = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                        add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)
