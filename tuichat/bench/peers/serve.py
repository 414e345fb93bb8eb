"""tuichat's own engine behind `tuichat serve`, in its own process on loopback: the same model and engine
options as the in-process runs, the tabs as concurrent HTTP clients (each its own thread and connection,
streaming /v1/chat/completions, parsing each SSE line with json.loads as vLLM's serving benchmark does), so
the tabs table shows what the HTTP layer costs against the same engine in process."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import fields

from tuichat.backends.protocol import EngineOptions, Message, TuichatError
from tuichat.bench.peers.loopback import LoopbackServer
from tuichat.bench.stats import RequestResult

# The engine options the command line takes; the others come from the config.toml the server reads, as the
# bench's did.
_FLAGS = ("device", "dtype", "kv_cache_mb", "batching", "prefix_cache", "tp", "device_map", "quant", "speculate")


def engine_flags(options: EngineOptions) -> list[str]:
    """`options` as `tuichat serve`'s engine flags (those left at their defaults are left out)."""
    flags = []
    for field in fields(EngineOptions):
        value = getattr(options, field.name)
        if field.name not in _FLAGS or value is None or value == field.default:
            continue
        flag = "--" + field.name.replace("_", "-")
        flags += [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, str(value)]
    return flags


class ServePeer(LoopbackServer):
    name = "tuichat serve"

    def __init__(self, model: str, options: EngineOptions, warmup: Sequence[Message], clients: int = 1,
                 ready_timeout_s: float = 300.0) -> None:
        self.model = model
        env = {k: v for k, v in os.environ.items() if k != "TUICHAT_API_KEY"}
        super().__init__(lambda port: [sys.executable, "-m", "tuichat", "serve", "--port", str(port), "--model", model,
                                       "--log-level", "warning", *engine_flags(options)], env, ready_timeout_s)
        try:
            # Like every other system's warm-up, but as `clients` at once: a fresh server process has not yet run
            # a batch (the in-process engine's process has, in the scenarios before).
            self.concurrently(lambda i: self.generate(warmup, 4), clients, 0.0)
        except BaseException:
            self.close()
            raise

    def generate(self, messages: Sequence[Message], max_tokens: int, model: str | None = None) -> RequestResult:
        """One streamed greedy reply (from `model`, else the served one); the usage chunk gives the tokens (EOS
        included) and the cache hit."""
        body = {"model": model or self.model, "messages": [{"role": m.role, "content": m.content} for m in messages],
                "temperature": 0, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
        result = RequestResult(submitted=time.perf_counter())
        times, pieces, usage, finish = [], [], None, None
        with self._post("/v1/chat/completions", body) as response:
            for line in response:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise TuichatError(f"tuichat serve: {chunk['error'].get('message')}")
                for choice in chunk["choices"]:
                    if text := choice["delta"].get("content"):
                        times.append(time.perf_counter())
                        pieces.append(text)
                    finish = choice.get("finish_reason") or finish
                usage = chunk.get("usage") or usage
        result.finished = time.perf_counter()
        if usage is None:
            raise TuichatError("tuichat serve ended a reply without its usage chunk")
        result.set_token_times(times)
        result.tokens = usage["completion_tokens"]
        result.prompt_tokens = usage["prompt_tokens"]
        result.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
        result.finish_reason = finish
        result.text = "".join(pieces)
        return result

    def tabs(self, conversations: Sequence[Sequence[Message]], max_tokens: int,
             stagger_s: float) -> tuple[list[RequestResult], float]:
        return self.concurrently(lambda i: self.generate(conversations[i], max_tokens), len(conversations), stagger_s)
