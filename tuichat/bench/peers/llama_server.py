"""llama.cpp's `llama-server` on the same .gguf, in its own process on loopback (never a dependency)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from tuichat.backends.protocol import TuichatError
from tuichat.bench.peers.loopback import LoopbackServer
from tuichat.bench.stats import RequestResult

LLAMA_SERVER_HINT = (
    "build it from llama.cpp with `cmake -B build -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF && "
    "cmake --build build --target llama-server` (a native AMX build segfaults on prompt batches), then pass "
    "--llama-server PATH or set TUICHAT_LLAMA_SERVER; llama.cpp is never a tuichat dependency"
)


def find_llama_server(given: str | None, resolved) -> tuple[str | None, str | None]:
    """(the llama-server binary, None), or (None, why the llama.cpp peer cannot run): --llama-server, else
    $TUICHAT_LLAMA_SERVER, else llama-server on PATH."""
    if resolved.kind != "gguf":
        return None, (f"llama.cpp needs a .gguf model; {resolved.name} is a transformers folder "
                      "(llama.cpp's convert_hf_to_gguf.py makes one)")
    given = given or os.environ.get("TUICHAT_LLAMA_SERVER")
    found = shutil.which(given or "llama-server")
    if found is None:
        where = f"no executable llama-server at {given}" if given else "no llama-server on PATH"
        return None, f"{where}: {LLAMA_SERVER_HINT}"
    return found, None


class LlamaServerPeer(LoopbackServer):
    """The same GGUF through llama.cpp's own `llama-server`, a separate process on loopback: loaded next to
    torch, llama.cpp segfaults here. It runs the file's quantized weights with `slots` parallel slots of
    `slot_ctx` tokens each (-c is split across them). Every request streams from the native /completion
    endpoint on its own connection, greedy, stopping at the model's EOS tokens like the other peers."""

    name = "llama-server"

    def __init__(self, binary: str, gguf: str, threads: int, slots: int, slot_ctx: int, warmup: list[int],
                 gpu: bool = False, ready_timeout_s: float = 120.0) -> None:
        folder = str(Path(binary).resolve().parent)  # its own shared libraries sit beside it in a build
        env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [folder, os.environ.get("LD_LIBRARY_PATH")]))}
        super().__init__(lambda port: [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
                                       "-np", str(slots), "-c", str(slots * slot_ctx), "-ngl", "999" if gpu else "0",
                                       "--no-webui"], env, ready_timeout_s)
        try:
            with self._request("GET", "/props") as response:
                self.build = json.loads(response.read()).get("build_info", "")
            self.generate(warmup, 4)  # like every other system's warm-up
        except BaseException:
            self.close()
            raise

    def generate(self, prompt: list[int], max_tokens: int, cache_prompt: bool = False, slot: int = -1) -> RequestResult:
        """One streamed reply. Each token arrives as its own SSE event (the EOS token too, with empty content):
        their arrival times give TTFT and ITL on the client side. cache_prompt=False computes the whole prompt;
        slot -1 is any idle slot."""
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "stream": True,
                "cache_prompt": cache_prompt, "id_slot": slot}
        result = RequestResult(submitted=time.perf_counter(), prompt_tokens=len(prompt))
        times, chunks, final = [], [], None
        with self._post("/completion", body) as response:
            for line in response:
                if line.startswith(b"error:"):
                    raise TuichatError(f"llama-server: {line[6:].decode(errors='replace').strip()}")
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:])
                if event.get("tokens"):
                    times.append(time.perf_counter())
                    chunks.append(event["content"])
                if event.get("stop"):
                    final = event
        result.finished = time.perf_counter()
        if final is None:
            raise TuichatError("llama-server ended a reply without its final event")
        result.set_token_times(times)
        result.tokens = final["tokens_predicted"]  # EOS included, as for every system
        result.cached_tokens = final["timings"]["cache_n"]
        result.finish_reason = {"eos": "stop", "limit": "length"}.get(final["stop_type"], final["stop_type"])
        result.text = "".join(chunks)
        return result

    def prefill(self, prompt: list[int], slot: int) -> None:
        """Put `prompt` into a slot's cache without generating (n_predict 0)."""
        body = {"prompt": prompt, "n_predict": 0, "cache_prompt": True, "id_slot": slot}
        with self._post("/completion", body) as response:
            response.read()

    def tabs(self, prompts: list[list[int]], max_tokens: int, stagger_s: float) -> tuple[list[RequestResult], float]:
        # tuichat's tabs run with its cache on.
        return self.concurrently(lambda i: self.generate(prompts[i], max_tokens, cache_prompt=True), len(prompts), stagger_s)
