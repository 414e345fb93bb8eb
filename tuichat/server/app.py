"""The FastAPI app of `tuichat serve`: the OpenAI API's chat completions, completions and models, health and
Prometheus metrics, over any Backend. Every HTTP client's request goes to the one backend, so they are batched
together and share its prefix cache, as tabs do.

The contract is published: request and response bodies are schema.py's pydantic models, which FastAPI
validates (a malformed request is a 400 in OpenAI's error shape, never FastAPI's 422), and /openapi.json
(contract.py) describes them, the streamed events included. /openapi.json is public, like /health and
/metrics, while /v1/ asks for the API key: it describes tuichat's code, not the deployment (no model, path,
key or setting of this server is in it), the same for every `tuichat serve` of a version; the tools that read
a contract (client generators, schemathesis, an editor's plugin) fetch it before they are configured with a
key; and it says itself that /v1/ needs a bearer key. vLLM serves its /openapi.json outside its key check
too. No /docs page: Swagger UI's would load its scripts from a CDN.

Models are named by the id GET /v1/models lists (the model the server was started with first): the name the
backend gave the model it loaded (a .gguf's file name), or any spec `--model` takes. An id the server gave a
loaded model wins over a file of that name in the server's working directory."""

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
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tuichat.backends.protocol import Backend, TuichatError, ModelNotFound, PromptTooLong, StreamEvent, Usage, chat_sampling
from tuichat.server import contract, schema
from tuichat.server.metrics import ServerMetrics

log = logging.getLogger("tuichat.serve")


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.body = status, schema.error_body(message, kind, param, code)


def _error(exc: TuichatError) -> ApiError:
    if isinstance(exc, ModelNotFound):
        return ApiError(404, str(exc), "model", "model_not_found")
    if isinstance(exc, PromptTooLong):  # OpenAI's code for it, which clients look for to trim a history
        return ApiError(400, str(exc), "messages", "context_length_exceeded")
    return ApiError(400, str(exc))


class _Models:
    """The models requests name. Each id the backend gave a model it loaded maps to the spec it was loaded by,
    so that a request may name a model by the id its replies and GET /v1/models carry (a .gguf given as
    DIR/chat-model.gguf is `chat-model.gguf`) as well as by its spec; the backend is always handed the spec."""

    def __init__(self, backend: Backend, default: str) -> None:
        self.backend, self.default = backend, default
        self.specs: dict[str, str] = {}

    async def load(self, requested: str | None = None) -> tuple[str, str]:
        """(the model's id, its spec), loading it if need be."""
        spec = self.specs.get(requested, requested) if requested else self.default
        try:
            name = await self.backend.load(spec)
        except ModelNotFound as exc:
            raise ApiError(404, str(exc), "model", "model_not_found") from None
        except TuichatError as exc:  # a folder that holds no model, a family tuichat cannot run, ...
            raise ApiError(400, str(exc), "model") from None
        self.specs.setdefault(name, spec)  # the first spec to give an id keeps it: the served model's
        return name, spec


_LABELS = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic's labels of a union's members


def _param(loc) -> str | None:
    """The request field a validation error is at, dotted (messages.0.role): the body's own location, without
    the label pydantic adds after a field of a union for each member (`str`, `list[str]`)."""
    names = []
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(part, str) and (not part.isidentifier() or part in _LABELS):
            break
        names.append(str(part))
    return ".".join(names) or None


def create_app(backend: Backend, default_model: str, sampling: Mapping[str, Any] | None = None,
               api_key: str | None = None) -> FastAPI:
    """`sampling`: the user's config, which a request's own fields override; what neither sets comes from
    the model's recommendation (backend.chat_sampling), as in `tuichat ask` and the TUI."""
    sampling = dict(sampling or {})
    metrics = ServerMetrics(lambda: backend.stats())
    models = _Models(backend, default_model)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await models.load()  # ready before the first request: /health then means it
        try:
            yield
        finally:
            await backend.close()

    app = FastAPI(title="tuichat", version=contract.version(), lifespan=lifespan, docs_url=None, redoc_url=None,
                  summary="The OpenAI API over tuichat's engine: chat completions, completions, models.")

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = contract.document(app, secured=api_key is not None)
        return app.openapi_schema

    app.openapi = openapi

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body, exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors() or [{"loc": (), "msg": "invalid request", "type": ""}]
        first, param = errors[0], _param(errors[0]["loc"])
        if first["type"] == "json_invalid":
            param, message = None, f"The body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
        elif first["type"] == "value_error":  # schema.py's own checks, whose messages name their field
            message = str(first["ctx"]["error"])
        else:  # each member of a union says why the value is not one of it: all of them, once each
            said = dict.fromkeys(e["msg"] for e in errors if _param(e["loc"]) == param)
            message = f"{param or 'request'}: {', or '.join(said)}"
        return JSONResponse(schema.error_body(message, param=param), 400)

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        # What nothing above expected: still OpenAI's shape (Starlette then re-raises it, for the log).
        return JSONResponse(schema.error_body(f"The server failed: {type(exc).__name__}", "server_error"), 500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # The headers too: a 405 names the methods the path takes in Allow.
        return JSONResponse(schema.error_body(str(exc.detail), code=str(exc.status_code)), exc.status_code,
                            headers=exc.headers)

    app.add_middleware(_Guard, api_key=api_key)

    @app.get("/health", response_model=schema.Health, summary="200 once the model is loaded (no key needed)")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics, under vLLM's names")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", response_model=schema.ListModelsResponse,
             summary="The model the server was started with, first; then the others it can load")
    async def list_models() -> dict:
        served, _ = await models.load()
        listed = await asyncio.to_thread(backend.list_models)
        ids = dict.fromkeys([served, *(m.spec for m in listed)])
        return {"object": "list", "data": [schema.model_card(i) for i in ids]}

    def chosen_of(body: schema.Sampling, max_tokens: int | None) -> dict[str, Any]:
        """The request's sampling fields over the config's, checked together before the model loads."""
        seed = None if body.seed is None else body.seed % 2**64
        given = {"temperature": body.temperature, "top_p": body.top_p, "seed": seed, "max_tokens": max_tokens,
                 "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
                 "stop": (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()) or None}
        chosen = {**sampling, **{k: v for k, v in given.items() if v is not None}}
        try:
            chat_sampling({}, chosen)
        except TuichatError as exc:
            raise ApiError(400, str(exc)) from None
        return chosen

    async def reply(body: schema.Sampling, chosen: dict[str, Any], start, request_id: str, path: str, shape):
        """The response to a completion request: `start(spec, params)` opens the backend's stream of events;
        `shape` is schema's chat or plain-text builders."""
        started = time.monotonic()
        model, spec = await models.load(body.model)
        params = chat_sampling(backend.sampling_defaults(model), chosen)
        events = aiter(start(spec, params))
        try:  # the first event, before any byte is sent: a bad prompt is an error status, not a broken stream
            first = await anext(events)
        except TuichatError as exc:
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
        include_usage = body.stream_options is not None and bool(body.stream_options.include_usage)
        return StreamingResponse(_sse(shape, request_id, model, first, events, include_usage, done),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    streamed = {"description": "The reply: one JSON object, or with `stream: true`, server-sent events."}

    @app.post("/v1/chat/completions", response_model=schema.CreateChatCompletionResponse,
              responses={200: streamed, **contract.errors(400, 404, 500)},
              summary="The assistant's reply to a conversation, in the model's chat template")
    async def chat(body: schema.CreateChatCompletionRequest):
        chosen = chosen_of(body, body.max_completion_tokens or body.max_tokens)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        messages = [m.message() for m in body.messages]
        # A stateless API: every request is its own conversation; LocalBackend finds the turn it continues.
        return await reply(body, chosen, lambda spec, p: backend.stream(request_id, messages, p, spec), request_id,
                           "/v1/chat/completions", _CHAT)

    @app.post("/v1/completions", response_model=schema.CreateCompletionResponse,
              responses={200: streamed, **contract.errors(400, 404, 500)},
              summary="The prompt continued as plain text, with no chat template")
    async def completions(body: schema.CreateCompletionRequest):
        # Left out, max_tokens is the config's, else OpenAI's default for plain completions: 16.
        chosen = {"max_tokens": 16, **chosen_of(body, body.max_tokens)}
        prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        return await reply(body, chosen, lambda spec, p: backend.complete(request_id, prompt, p, spec),
                           request_id, "/v1/completions", _TEXT)

    return app


class _Guard:
    """The API key on /v1/, a completion's body read as JSON, and the log line of the requests that are not
    completions (those log when their reply ends), as plain ASGI: Starlette's BaseHTTPMiddleware would carry
    every streamed chunk through a queue and another task."""

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
            # The body is JSON whatever Content-Type says (`curl -d` sends a form's); FastAPI reads JSON only
            # under a JSON type.
            headers = [h for h in scope["headers"] if h[0] != b"content-type"]
            await self.app({**scope, "headers": [*headers, (b"content-type", b"application/json")]}, receive, send)
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
