"""llama.cpp's `llama-server` on the same .gguf, in its own process on loopback (never a dependency)."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tuichat.backend import BackendError
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


class LlamaServerPeer:
    """The same GGUF through llama.cpp's own `llama-server`, a separate process on loopback: loaded next to
    torch, llama.cpp segfaults here. It runs the file's quantized weights with `slots` parallel slots of
    `slot_ctx` tokens each (-c is split across them). Every request streams from the native /completion
    endpoint on its own connection, greedy, stopping at the model's EOS tokens like the other peers."""

    def __init__(self, binary: str, gguf: str, threads: int, slots: int, slot_ctx: int, warmup: list[int],
                 gpu: bool = False, ready_timeout_s: float = 120.0) -> None:
        with socket.socket() as probe:  # a free port; the server binds it a moment later
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        folder = str(Path(binary).resolve().parent)  # its own shared libraries sit beside it in a build
        env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [folder, os.environ.get("LD_LIBRARY_PATH")]))}
        self.command = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
                        "-np", str(slots), "-c", str(slots * slot_ctx), "-ngl", "999" if gpu else "0", "--no-webui"]
        self.log = tempfile.TemporaryFile()  # not a pipe: an unread pipe fills and stalls the server
        self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=self.log,
                                        stderr=subprocess.STDOUT, env=env)
        try:
            self.build = self._wait_ready(ready_timeout_s)
            self.generate(warmup, 4)  # like every other system's warm-up
        except BaseException:
            self.close()
            raise

    def _log_tail(self, lines: int = 5) -> str:
        self.log.seek(0)
        return " | ".join(self.log.read().decode(errors="replace").strip().splitlines()[-lines:])

    def _request(self, method: str, path: str, body: dict | None = None) -> http.client.HTTPResponse:
        # A fresh connection per request: the server closes one after a streamed reply.
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        connection.request(method, path, None if body is None else json.dumps(body),
                           {"Content-Type": "application/json"})
        return connection.getresponse()

    def _wait_ready(self, timeout_s: float) -> str:
        """Poll /health until the model is loaded; the server's build from /props."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BackendError(f"llama-server exited with status {self.process.returncode}: {self._log_tail()}")
            try:
                with self._request("GET", "/health") as response:
                    if response.status == 200:
                        break
            except OSError:
                pass  # not listening yet
            time.sleep(0.1)
        else:
            raise BackendError(f"llama-server was not ready after {timeout_s:.0f} s: {self._log_tail()}")
        with self._request("GET", "/props") as response:
            return json.loads(response.read()).get("build_info", "")

    def generate(self, prompt: list[int], max_tokens: int, cache_prompt: bool = False, slot: int = -1) -> RequestResult:
        """One streamed reply. Each token arrives as its own SSE event (the EOS token too, with empty content):
        their arrival times give TTFT and ITL on the client side. cache_prompt=False computes the whole prompt;
        slot -1 is any idle slot."""
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "stream": True,
                "cache_prompt": cache_prompt, "id_slot": slot}
        result = RequestResult(submitted=time.perf_counter(), prompt_tokens=len(prompt))
        times, chunks, final = [], [], None
        with self._request("POST", "/completion", body) as response:
            if response.status != 200:
                raise BackendError(f"llama-server answered {response.status}: {response.read()[:300]!r}")
            for line in response:
                if line.startswith(b"error:"):
                    raise BackendError(f"llama-server: {line[6:].decode(errors='replace').strip()}")
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
            raise BackendError("llama-server ended a reply without its final event")
        result.set_token_times(times)
        result.tokens = final["tokens_predicted"]  # EOS included, as for every system
        result.cached_tokens = final["timings"]["cache_n"]
        result.finish_reason = {"eos": "stop", "limit": "length"}.get(final["stop_type"], final["stop_type"])
        result.text = "".join(chunks)
        return result

    def prefill(self, prompt: list[int], slot: int) -> None:
        """Put `prompt` into a slot's cache without generating (n_predict 0)."""
        body = {"prompt": prompt, "n_predict": 0, "cache_prompt": True, "id_slot": slot}
        with self._request("POST", "/completion", body) as response:
            if response.status != 200:
                raise BackendError(f"llama-server answered {response.status}: {response.read()[:300]!r}")
            response.read()

    def tabs(self, prompts: list[list[int]], max_tokens: int, stagger_s: float) -> tuple[list[RequestResult], float]:
        """Prompt i sent at i * stagger_s, each on its own thread and connection, so the server's parallel slots
        batch them as they arrive (the other batching peers get the same arrivals)."""
        start = time.perf_counter()

        def send(i: int) -> RequestResult:
            time.sleep(max(0.0, start + i * stagger_s - time.perf_counter()))
            return self.generate(prompts[i], max_tokens, cache_prompt=True)  # tuichat's tabs run with its cache on

        with ThreadPoolExecutor(len(prompts), thread_name_prefix="tuichat-bench-llama") as pool:
            results = list(pool.map(send, range(len(prompts))))
        return results, max(r.finished for r in results) - start

    def close(self) -> None:
        """Stop the server (and wait for it): after every run, an error or Ctrl-C."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
