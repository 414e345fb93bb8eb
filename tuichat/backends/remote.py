"""RemoteBackend: the Backend protocol over one OpenAI-compatible server (vLLM, SGLang, llama.cpp's server,
Ollama, another `tuichat serve`), on httpx.

httpx rather than the `openai` package: a reply has to tell apart failures that the openai client folds
together or lets through raw mid-stream (refused, DNS, TLS, no first byte, a cut stream, malformed SSE), retry
only before the first byte, and drop `stream_options` for a server that rejects it; that is a small SSE reader
over httpx's own exceptions. Imported only when a spec names an endpoint, so the TUI starts without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import ssl
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tuichat.backends.endpoints import Endpoint
from tuichat.backends.protocol import (
    Message,
    ModelInfo,
    ProgressCallback,
    RemoteStats,
    SamplingParams,
    StreamEvent,
    TuichatError,
    Usage,
)

RETRY_BACKOFF_S = (0.2, 0.5)  # a connection that fails before any reply arrived is tried again after these
LIST_TIMEOUT_S = 3.0  # GET /v1/models for the picker: an unreachable server must not keep it waiting
METRICS_TIMEOUT_S = 2.0
METRICS_EVERY_S = 0.5
# Prometheus names of the same facts: vLLM's (tuichat serve uses them under its own prefix), SGLang's, llama.cpp's.
_RUNNING = ("vllm:num_requests_running", "tuichat:num_requests_running", "sglang:num_running_reqs",
            "llamacpp:requests_processing")
_WAITING = ("vllm:num_requests_waiting", "tuichat:num_requests_waiting", "sglang:num_queue_reqs",
            "llamacpp:requests_deferred")
_KV = ("vllm:kv_cache_usage_perc", "tuichat:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
       "llamacpp:kv_cache_usage_ratio")
_PREFIX_COUNTERS = ("vllm:prefix_cache", "tuichat:prefix_cache")  # _hits_total / _queries_total
_HIT_RATE = ("sglang:cache_hit_rate",)


def _body(messages: Sequence[Message] | None, prompt: str | None, params: SamplingParams, model: str) -> dict:
    """The request's JSON: the OpenAI fields, plus top_k where set (vLLM, SGLang, llama.cpp and Ollama take it;
    OpenAI's own API does not, so it is sent only when asked for)."""
    body: dict = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                  "temperature": params.temperature, "max_tokens": params.max_tokens}
    if messages is not None:
        body["messages"] = [{"role": m.role, "content": m.content} for m in messages]
    else:
        body["prompt"] = prompt
    optional = {"top_p": (params.top_p, 1.0), "top_k": (params.top_k, 0), "seed": (params.seed, None),
                "presence_penalty": (params.presence_penalty, 0.0), "frequency_penalty": (params.frequency_penalty, 0.0)}
    body.update({name: value for name, (value, unset) in optional.items() if value != unset})
    if params.stop:
        body["stop"] = list(params.stop)
    return body


async def _sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The data of each complete server-sent event (the WHATWG rules: data lines joined by newlines; comments
    and other fields skipped; an event not ended by a blank line when the stream ends is dropped)."""
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)


def _stop(reader: asyncio.Task) -> None:
    """Cancel the exchange once: a second cancel would land in httpx's closing of the response (its shield is
    anyio's, which a plain task.cancel() passes through) and leave the connection open, the request running."""
    if not reader.cancelling():
        reader.cancel()


def _chain(exc: BaseException) -> list[BaseException]:
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def _server_said(response: httpx.Response) -> str:
    """The error message of an error response, in OpenAI's shape or the other servers'."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:300] or response.reason_phrase
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        error = error.get("message") or error.get("detail") or json.dumps(error)
    return str(error)[:300]


class RemoteBackend:
    """One endpoint. Model names here are the server's own ids (the router adds and strips `NAME:`)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.who = f"{endpoint.name} ({endpoint.base_url})"
        self._http: httpx.AsyncClient | None = None
        self._http_loop: asyncio.AbstractEventLoop | None = None
        self._include_usage = True  # until the server rejects stream_options
        self._in_flight: dict[str, tuple[asyncio.Task, asyncio.Queue]] = {}
        self._stats = RemoteStats(device=endpoint.base_url, note="reading /metrics…")
        self._metrics_task: asyncio.Task | None = None
        self._polled = 0.0

    # -- plumbing -----------------------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        headers = dict(self.endpoint.headers)
        key = os.environ.get(self.endpoint.api_key_env or "", "")
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _client(self) -> httpx.AsyncClient:
        # One per event loop: `tuichat bench` runs each scenario in its own asyncio.run, and a pooled connection
        # belongs to the loop that opened it.
        loop = asyncio.get_running_loop()
        if self._http is None or self._http_loop is not loop:
            self._http = httpx.AsyncClient(timeout=self.endpoint.timeout)
            self._http_loop = loop
        return self._http

    def _refused(self, response: httpx.Response, model: str) -> str:
        status, said = response.status_code, _server_said(response)
        if status in (401, 403):
            env = self.endpoint.api_key_env
            if env is None:
                hint = "no key was sent: name the environment variable that holds it in the endpoint's api_key_env"
            elif not os.environ.get(env):
                hint = f"no key was sent: ${env} is not set"
            else:
                hint = f"check the key in ${env}"
            return f"{self.who} refused the request ({status}): {said} — {hint}."
        if status == 404:
            return (f"{self.who} answered 404 for model '{model}': {said} — check the model id (the model picker "
                    "lists the server's) and that base_url ends in /v1.")
        if status == 429:
            after = response.headers.get("retry-after", "").strip()
            when = f"retry after {after} s" if after.isdigit() else f"retry after {after}" if after else "retry later"
            return f"{self.who} is rate-limiting requests (429), {when}: {said}"
        if status >= 500:
            return f"{self.who} failed with a server error ({status}): {said}"
        return f"{self.who} rejected the request ({status}): {said}"

    def _unreachable(self, exc: httpx.HTTPError, received: bool = False) -> str:
        """What went wrong with the connection, in words, from the OS error under httpx's."""
        url = httpx.URL(self.endpoint.base_url)
        for cause in _chain(exc):
            if isinstance(cause, ssl.SSLError):
                return f"{self.who}: TLS failed: {cause.reason or cause}."
            if isinstance(cause, socket.gaierror):
                return f"{self.who}: cannot resolve {url.host} (DNS: {cause.strerror or cause})."
            if isinstance(cause, ConnectionRefusedError):
                return f"{self.who}: connection refused: nothing listens at {url.host}:{url.port} — is the server running?"
        if isinstance(exc, httpx.ConnectTimeout):
            return f"{self.who}: could not connect within {self.endpoint.timeout:g} s."
        if isinstance(exc, httpx.TimeoutException):
            if received:
                return f"{self.who}: the reply stalled: nothing arrived for {self.endpoint.timeout:g} s."
            return f"{self.who}: no reply within {self.endpoint.timeout:g} s (timeout in the endpoint's config)."
        if received:
            return f"{self.who}: the connection was cut mid-reply ({exc or type(exc).__name__})."
        return f"{self.who}: the connection failed before a reply ({exc or type(exc).__name__})."

    # -- models -------------------------------------------------------------------------------------------
    def model_ids(self) -> list[str]:
        """The server's models (GET /v1/models), with a short timeout. Blocking: call it off the UI loop."""
        try:
            response = httpx.get(self.endpoint.base_url + "/models", headers=self._headers(), timeout=LIST_TIMEOUT_S)
        except httpx.HTTPError as exc:
            raise TuichatError(self._unreachable(exc)) from None
        if response.status_code == 404:
            raise TuichatError(f"{self.who}: no /models here (404) — base_url should end in /v1.")
        if response.status_code >= 400:
            raise TuichatError(self._refused(response, ""))
        try:
            return [str(model["id"]) for model in response.json()["data"]]
        except (ValueError, KeyError, TypeError):
            raise TuichatError(f"{self.who}: /models is not an OpenAI model list: {response.text[:120]!r}") from None

    def list_models(self) -> list[ModelInfo]:
        return [ModelInfo(model, "remote", self.who) for model in self.model_ids()]

    async def load(self, model: str | None = None, progress: ProgressCallback | None = None) -> str:
        """Nothing to load: the server has it. No model named: the server's first."""
        if model:
            return model
        models = await asyncio.to_thread(self.model_ids)
        if not models:
            raise TuichatError(f"{self.who} lists no models.")
        return models[0]

    def sampling_defaults(self, model: str) -> dict:
        return {}  # the server applies its own where a request leaves a field out

    # -- streaming ----------------------------------------------------------------------------------------
    def stream(self, conversation_id: str, messages: Sequence[Message], params: SamplingParams,
               model: str | None = None) -> AsyncIterator[StreamEvent]:
        return self._events(conversation_id, "/chat/completions", _body(messages, None, params, model or ""))

    def complete(self, request_id: str, prompt: str, params: SamplingParams,
                 model: str | None = None) -> AsyncIterator[StreamEvent]:
        return self._events(request_id, "/completions", _body(None, prompt, params, model or ""))

    async def prefill(self, conversation_id: str, messages: Sequence[Message], model: str | None = None) -> int:
        """Nothing: a server prefills what it is sent, when it is sent."""
        return 0

    def cancel(self, conversation_id: str) -> None:
        """Closes the stream: the server sees the client go and aborts the request."""
        entry = self._in_flight.get(conversation_id)
        if entry is not None:
            reader, queue = entry
            _stop(reader)
            queue.put_nowait(("cancelled", time.monotonic(), None))

    async def _events(self, conversation_id: str, path: str, body: dict) -> AsyncIterator[StreamEvent]:
        """The reply's events. The HTTP exchange runs in its own task so that `cancel` can end it at any await."""
        self.cancel(conversation_id)  # one reply per conversation at a time
        submitted = time.monotonic()
        queue: asyncio.Queue = asyncio.Queue()
        reader = asyncio.create_task(self._pump(path, body, queue))
        self._in_flight[conversation_id] = (reader, queue)
        usage, last, error, finish, reported = Usage(), None, None, None, None
        try:
            while True:
                kind, t, value = await queue.get()
                if kind == "chunk":
                    text, reason, chunk_usage, error = self._read_chunk(value)
                    finish = reason or finish
                    reported = chunk_usage or reported
                    if error:
                        break
                    if text:
                        if last is None:
                            usage.ttft_ms = (t - submitted) * 1000
                        else:
                            usage.itl_ms.append((t - last) * 1000)
                        last = t
                        usage.completion_tokens += 1
                        yield StreamEvent(text, t, Usage(completion_tokens=usage.completion_tokens))
                    continue
                if kind == "error":
                    error = value
                elif kind == "cancelled":
                    finish = "cancelled"
                elif not value and finish is None:  # "end" without [DONE] or a finish_reason
                    error = f"{self.who}: the stream ended mid-reply (no finish_reason, no [DONE])."
                break
        finally:
            _stop(reader)
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            if self._in_flight.get(conversation_id, (None,))[0] is reader:
                del self._in_flight[conversation_id]
        now = time.monotonic()
        if reported:
            usage.prompt_tokens = reported.get("prompt_tokens") or 0
            usage.completion_tokens = reported.get("completion_tokens") or usage.completion_tokens
            usage.cached_tokens = (reported.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        usage.e2e_ms = (now - submitted) * 1000
        usage.finish_reason = "error" if error else finish if finish in ("length", "cancelled") else "stop"
        yield StreamEvent("", now, usage, finished=True, error=error)

    def _read_chunk(self, data: str) -> tuple[str, str | None, dict | None, str | None]:
        """(text, finish_reason, usage, error) of one SSE event's data."""
        try:
            chunk = json.loads(data)
            if "error" in chunk:  # a failure after the response started (tuichat serve, vLLM)
                error = chunk["error"]
                return "", None, None, f"{self.who}: {error.get('message', error) if isinstance(error, dict) else error}"
            text, finish = [], None
            for choice in chunk.get("choices") or ():
                piece = choice["text"] if "text" in choice else (choice.get("delta") or {}).get("content")
                text.append(piece or "")
                finish = choice.get("finish_reason") or finish
            return "".join(text), finish, chunk.get("usage"), None
        except (ValueError, TypeError, AttributeError, KeyError):
            shown = data if len(data) <= 80 else data[:79] + "…"
            return "", None, None, f"{self.who} sent a malformed event: {shown!r}"

    async def _pump(self, path: str, body: dict, queue: asyncio.Queue) -> None:
        """The exchange, as queue items (kind, arrival time, value): "chunk" (an event's data), "end" (whether
        [DONE] came), "error" (what went wrong, in words)."""
        try:
            async for kind, value in self._post(path, body):
                queue.put_nowait((kind, time.monotonic(), value))
        except TuichatError as exc:
            queue.put_nowait(("error", time.monotonic(), str(exc)))
        except Exception as exc:  # a bug here must end the reply with its reason, never leave it waiting
            queue.put_nowait(("error", time.monotonic(), f"{self.who}: {type(exc).__name__}: {exc}"))

    async def _post(self, path: str, body: dict) -> AsyncIterator[tuple[str, object]]:
        client, backoff = self._client(), list(RETRY_BACKOFF_S)
        while True:
            sent = body if self._include_usage else {k: v for k, v in body.items() if k != "stream_options"}
            received = False
            try:
                async with client.stream("POST", self.endpoint.base_url + path, json=sent,
                                         headers=self._headers()) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        if response.status_code in (400, 422) and "stream_options" in sent and \
                                "stream_options" in response.text:
                            self._include_usage = False  # an older server: usage then comes from counting
                            continue
                        raise TuichatError(self._refused(response, body["model"]))
                    async for data in _sse_data(response.aiter_lines()):
                        received = True
                        if data.strip() == "[DONE]":
                            yield "end", True
                            return
                        yield "chunk", data
                    yield "end", False
                    return
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
                deterministic = any(isinstance(c, (ssl.SSLError, socket.gaierror)) for c in _chain(exc))
                if not received and backoff and not deterministic:
                    await asyncio.sleep(backoff.pop(0))
                    continue
                raise TuichatError(self._unreachable(exc, received)) from None
            except httpx.HTTPError as exc:
                raise TuichatError(self._unreachable(exc, received)) from None

    # -- metrics ------------------------------------------------------------------------------------------
    def stats(self, model: str | None = None) -> RemoteStats:
        """The last /metrics read; each call (the engine panel polls while it is open) reads it again in the
        background, so this never waits on the network."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        idle = self._metrics_task is None or self._metrics_task.done()
        if loop is not None and idle and time.monotonic() - self._polled >= METRICS_EVERY_S:
            self._polled = time.monotonic()
            self._metrics_task = loop.create_task(self._read_metrics())
        return replace(self._stats, model=model or "")

    async def _read_metrics(self) -> None:
        base = RemoteStats(device=self.endpoint.base_url)
        try:
            response = await self._client().get(self.endpoint.root + "/metrics", headers=self._headers(),
                                                timeout=METRICS_TIMEOUT_S)
        except httpx.HTTPError as exc:
            self._stats = replace(base, note=f"not reported: {self._unreachable(exc).removeprefix(self.who + ': ')}")
            return
        if response.status_code != 200:
            self._stats = replace(base, note=f"not reported (/metrics answered {response.status_code})")
            return
        values: dict[str, list[float]] = {}
        try:
            for family in text_string_to_metric_families(response.text):
                for sample in family.samples:
                    values.setdefault(sample.name, []).append(sample.value)
        except ValueError as exc:
            self._stats = replace(base, note=f"not reported (/metrics is not Prometheus text: {exc})")
            return

        def first(names, combine=sum):
            return next((combine(values[n]) for n in names if n in values), None)

        rate = first(_HIT_RATE)
        for prefix in _PREFIX_COUNTERS:
            if f"{prefix}_queries_total" in values:
                queries = sum(values[f"{prefix}_queries_total"])
                rate = sum(values.get(f"{prefix}_hits_total", [0])) / queries if queries else 0.0
        running, waiting = first(_RUNNING), first(_WAITING)
        self._stats = replace(base, running=None if running is None else int(running),
                              waiting=None if waiting is None else int(waiting), kv_fraction=first(_KV, max),
                              prefix_hit_rate=rate)
        if (running, waiting, self._stats.kv_fraction, rate) == (None,) * 4:
            self._stats = replace(base, note="not reported (/metrics has none of vLLM's, SGLang's or llama.cpp's names)")

    async def close(self) -> None:
        for reader, _ in list(self._in_flight.values()):
            _stop(reader)
        if self._metrics_task is not None:
            self._metrics_task.cancel()
        http, self._http = self._http, None
        if http is not None and self._http_loop is asyncio.get_running_loop():
            await http.aclose()
