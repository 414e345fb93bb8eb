"""The FastAPI app of `tuichat serve`: the OpenAI API's chat completions, models, health and Prometheus metrics,
over any Backend. Every HTTP client's request goes to the one backend, so they are batched together and
share its prefix cache, as tabs do."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tuichat.backend import Backend, BackendError, ModelNotFound, PromptTooLong, StreamEvent, Usage, chat_sampling
from tuichat.server import schema
from tuichat.server.metrics import ServerMetrics

log = logging.getLogger("tuichat.serve")


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.body = status, schema.error_body(message, kind, param, code)


def _error(exc: BackendError) -> ApiError:
    if isinstance(exc, ModelNotFound):
        return ApiError(404, str(exc), "model", "model_not_found")
    if isinstance(exc, PromptTooLong):  # OpenAI's code for it, which clients look for to trim a history
        return ApiError(400, str(exc), "messages", "context_length_exceeded")
    return ApiError(400, str(exc))


def create_app(backend: Backend, default_model: str, sampling: Mapping[str, Any] | None = None,
               api_key: str | None = None) -> FastAPI:
    """`sampling`: the user's config, which a request's own fields override; what neither sets comes from
    the model's recommendation (backend.chat_sampling), as in `tuichat ask` and the TUI."""
    sampling = dict(sampling or {})
    metrics = ServerMetrics(lambda: backend.stats())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await backend.load(default_model)  # ready before the first request: /health then means it
        try:
            yield
        finally:
            await backend.close()

    app = FastAPI(title="tuichat", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body, exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = f"{'.'.join(where) or 'request'}: {first.get('msg', 'invalid request')}"
        if first.get("type") == "json_invalid":
            message = f"The body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
        return JSONResponse(schema.error_body(message, param=".".join(where) or None), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(schema.error_body(str(exc.detail), code=str(exc.status_code)), exc.status_code)

    app.add_middleware(_Guard, api_key=api_key)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict:
        listed = await asyncio.to_thread(backend.list_models)
        return {"object": "list", "data": [{"id": m.spec, "object": "model", "created": 0, "owned_by": "tuichat"}
                                           for m in listed]}

    def chosen_of(body: schema.Sampling, max_tokens: int | None) -> dict[str, Any]:
        """The request's sampling fields over the config's, checked before the model loads."""
        if body.n != 1:
            raise ApiError(400, f"n must be 1: tuichat writes one choice per request, not {body.n}.", "n")
        given = {"temperature": body.temperature, "top_p": body.top_p, "seed": body.seed, "max_tokens": max_tokens,
                 "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
                 "stop": (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()) or None}
        chosen = {**sampling, **{k: v for k, v in given.items() if v is not None}}
        try:
            chat_sampling({}, chosen)
        except BackendError as exc:
            raise ApiError(400, str(exc)) from None
        return chosen

    async def parsed(request: Request, kind: type[schema.Sampling]):
        try:  # JSON whatever the content type says (curl -d sends a form's), validated as OpenAI's request
            return kind.model_validate_json(await request.body())
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None

    async def reply(body: schema.Sampling, chosen: dict[str, Any], start, request_id: str, path: str, shape):
        """The response to a completion request: `start(model, params)` opens the backend's stream of events;
        `shape` is schema's chat or plain-text builders."""
        started = time.monotonic()
        try:
            model = await backend.load(body.model or default_model)
        except BackendError as exc:
            raise _error(exc) from None
        params = chat_sampling(backend.sampling_defaults(model), chosen)
        events = aiter(start(model, params))
        try:  # the first event, before any byte is sent: a bad prompt is an error status, not a broken stream
            first = await anext(events)
        except BackendError as exc:
            await events.aclose()
            raise _error(exc) from None

        def done(usage: Usage, status: int = 200) -> None:
            metrics.finished(model, usage)
            log.info("POST %s %d prompt %d cached %d completion %d ttft %s ms e2e %.0f ms", path, status,
                     usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens,
                     "-" if usage.ttft_ms is None else f"{usage.ttft_ms:.0f}", (time.monotonic() - started) * 1000)

        if not body.stream:
            text, event = [], first
            try:
                while True:
                    text.append(event.text)
                    if event.finished:
                        break
                    event = await anext(events)
            finally:
                await events.aclose()
            if event.error:
                done(event.usage, 500)
                raise ApiError(500, event.error, kind="server_error")
            done(event.usage)
            return shape.whole(request_id, model, "".join(text), event.usage)
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_sse(shape, request_id, model, first, events, include_usage, done),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await parsed(request, schema.ChatRequest)
        chosen = chosen_of(body, body.max_completion_tokens or body.max_tokens)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        messages = [m.message() for m in body.messages]
        # A stateless API: every request is its own conversation; LocalBackend finds the turn it continues.
        return await reply(body, chosen, lambda model, p: backend.stream(request_id, messages, p, model), request_id,
                           "/v1/chat/completions", _CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parsed(request, schema.CompletionRequest)
        # OpenAI's default for plain completions is 16 tokens.
        chosen = chosen_of(body, body.max_tokens or 16)
        for name, given in (("echo", body.echo), ("suffix", body.suffix is not None), ("logprobs", body.logprobs is not None)):
            if given:
                raise ApiError(400, f"{name} is not supported: leave it out.", name)
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1:
            raise ApiError(400, f"prompt must be one string, not a list of {len(prompts)}.", "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        return await reply(body, chosen, lambda model, p: backend.complete(request_id, prompts[0], p, model),
                           request_id, "/v1/completions", _TEXT)

    return app


class _Guard:
    """The API key on /v1/, and the log line of the requests that are not completions (those log when their
    reply ends), as plain ASGI: Starlette's BaseHTTPMiddleware would carry every streamed chunk through a
    queue and another task."""

    _COMPLETIONS = ("/v1/chat/completions", "/v1/completions")

    def __init__(self, app, api_key: str | None) -> None:
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, started = scope["path"], time.monotonic()
        if self.expected is not None and path.startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                refusal = JSONResponse(schema.error_body("Incorrect or missing API key: send Authorization: Bearer KEY.",
                                                         code="invalid_api_key"), 401)
                await refusal(scope, receive, send)
                return
        if path in self._COMPLETIONS:
            await self.app(scope, receive, send)
            return
        status = 500

        async def sending(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        await self.app(scope, receive, sending)
        log.info("%s %s %d %.0f ms", scope["method"], path, status, (time.monotonic() - started) * 1000)


class _Shape:
    """How one kind of completion is written: whole, or as the first, middle, finishing and usage chunks."""

    def __init__(self, whole, piece, opening=None) -> None:
        self.whole, self.piece, self.opening = whole, piece, opening


_CHAT = _Shape(schema.completion,
               lambda rid, model, created, text, finish=None, usage=None: schema.chunk(
                   rid, model, created, None if text is None else ({"content": text} if text else {}), finish, usage),
               opening=lambda rid, model, created: schema.chunk(rid, model, created, {"role": "assistant", "content": ""}))
_TEXT = _Shape(schema.text_completion, schema.text_chunk)


async def _sse(shape: _Shape, request_id: str, model: str, first: StreamEvent, events: AsyncIterator[StreamEvent],
               include_usage: bool, done) -> AsyncIterator[str]:
    """The reply as OpenAI streams it: (chat: a role chunk,) text deltas, a finish chunk, the usage chunk if
    asked for, [DONE]. A client gone mid-reply closes `events`, which cancels the request in the engine at once."""
    created = int(time.time())

    def data(body: dict) -> str:
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    try:
        if shape.opening is not None:
            yield data(shape.opening(request_id, model, created))
        event = first
        while True:
            if event.text:
                yield data(shape.piece(request_id, model, created, event.text))
            if event.finished:
                break
            event = await anext(events)
        if event.error:
            done(event.usage, 500)
            yield data(schema.error_body(event.error, "server_error"))
        else:
            done(event.usage)
            yield data(shape.piece(request_id, model, created, "", schema.finish_reason(event.usage)))
            if include_usage:
                yield data(shape.piece(request_id, model, created, None, usage=event.usage))
        yield "data: [DONE]\n\n"
    finally:
        await events.aclose()
