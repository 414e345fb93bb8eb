"""The FastAPI app of `tuichat serve`: the OpenAI API's chat completions, completions and models, health and
Prometheus metrics, over any Backend. Every HTTP client's request goes to the one backend, so they are batched
together and share its prefix cache, as tabs do. create_app assembles it: the routers (routers/), the state they
share (dependencies.py), OpenAI's error shape (errors.py), and the API key's guard.

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

import logging
import secrets
import time
from collections.abc import Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from tuichat.backends.protocol import Backend
from tuichat.server import contract, schema
from tuichat.server.dependencies import Models, Server
from tuichat.server.errors import HANDLERS
from tuichat.server.metrics import ServerMetrics
from tuichat.server.routers import completions, models, monitoring

log = logging.getLogger("tuichat.serve")


@asynccontextmanager
async def _lifespan(app: FastAPI):
    server: Server = app.state.server
    await server.models.load()  # ready before the first request: /health then means it
    try:
        yield
    finally:
        await server.backend.close()


def create_app(backend: Backend, default_model: str, sampling: Mapping[str, Any] | None = None,
               api_key: str | None = None) -> FastAPI:
    """`sampling`: the user's config, which a request's own fields override; what neither sets comes from
    the model's recommendation (backend.sampling_defaults), as in `tuichat ask` and the TUI."""
    app = FastAPI(title="tuichat", version=contract.version(), lifespan=_lifespan, docs_url=None, redoc_url=None,
                  summary="The OpenAI API over tuichat's engine: chat completions, completions, models.",
                  exception_handlers=HANDLERS)
    app.state.server = Server(backend, Models(backend, default_model), ServerMetrics(lambda: backend.stats()),
                              dict(sampling or {}))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = contract.document(app, secured=api_key is not None)
        return app.openapi_schema

    app.openapi = openapi
    app.add_middleware(_Guard, api_key=api_key)
    for router in (monitoring.router, models.router, completions.router):
        app.include_router(router)
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
