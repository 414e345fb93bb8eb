"""A peer that is a server in its own process on a free loopback port: started, polled until /health answers,
always stopped; the tabs workload as concurrent clients, each on its own thread and connection."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tuichat.backends.protocol import TuichatError
from tuichat.bench.stats import RequestResult
from tuichat.engine.heap import process_memory


class LoopbackServer:
    name = "server"

    def __init__(self, command: Callable[[int], list[str]], env: dict[str, str] | None, ready_timeout_s: float) -> None:
        with socket.socket() as probe:  # a free port; the server binds it a moment later
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.command = command(self.port)
        self.log = tempfile.TemporaryFile()  # not a pipe: an unread pipe fills and stalls the server
        started = time.monotonic()
        self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=self.log,
                                        stderr=subprocess.STDOUT, env=env or dict(os.environ))
        try:
            self._wait_ready(ready_timeout_s)
            self.ready_s = time.monotonic() - started  # from the process's start to its first healthy answer
        except BaseException:
            self.close()
            raise

    def memory(self) -> dict[str, float] | None:
        """The server process's resident memory now and its most so far, in MB (Linux's VmRSS and VmHWM: the pages
        of a mapped model file it read count), or None where /proc does not tell."""
        try:
            rss, peak = process_memory(self.process.pid)
        except OSError:
            return None
        return {"rss_mb": rss / 2**20, "peak_rss_mb": peak / 2**20}

    def _log_tail(self, lines: int = 5) -> str:
        self.log.seek(0)
        return " | ".join(self.log.read().decode(errors="replace").strip().splitlines()[-lines:])

    def _request(self, method: str, path: str, body: dict | None = None) -> http.client.HTTPResponse:
        # A fresh connection per request: llama-server closes one after a streamed reply.
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        connection.request(method, path, None if body is None else json.dumps(body),
                           {"Content-Type": "application/json"})
        return connection.getresponse()

    def _post(self, path: str, body: dict) -> http.client.HTTPResponse:
        response = self._request("POST", path, body)
        if response.status != 200:
            raise TuichatError(f"{self.name} answered {response.status}: {response.read()[:300]!r}")
        return response

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise TuichatError(f"{self.name} exited with status {self.process.returncode}: {self._log_tail()}")
            try:
                with self._request("GET", "/health") as response:
                    if response.status == 200:
                        return
            except OSError:
                pass  # not listening yet
            time.sleep(0.1)
        raise TuichatError(f"{self.name} was not ready after {timeout_s:.0f} s: {self._log_tail()}")

    def concurrently(self, send: Callable[[int], RequestResult], count: int,
                     stagger_s: float) -> tuple[list[RequestResult], float]:
        """send(i) at i * stagger_s, each on its own thread, so the server batches them as they arrive (the
        other batching peers get the same arrivals)."""
        start = time.perf_counter()

        def at(i: int) -> RequestResult:
            time.sleep(max(0.0, start + i * stagger_s - time.perf_counter()))
            return send(i)

        with ThreadPoolExecutor(count, thread_name_prefix=f"tuichat-bench-{self.name}") as pool:
            results = list(pool.map(at, range(count)))
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
