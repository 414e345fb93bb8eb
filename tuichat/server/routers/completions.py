"""POST /v1/chat/completions and POST /v1/completions: a reply, whole or streamed as OpenAI streams it.
Every request is its own conversation (the API is stateless); LocalBackend finds the turn it continues."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from tuichat.backends.protocol import StreamEvent, TuichatError, Usage, chat_sampling
from tuichat.server import contract, schema
from tuichat.server.dependencies import Served, Server
from tuichat.server.errors import ApiError, refusal

log = logging.getLogger("tuichat.serve")
router = APIRouter()
_STREAMED = {"description": "The reply: one JSON object, or with `stream: true`, server-sent events."}


def _chosen(server: Server, body: schema.Sampling, max_tokens: int | None) -> dict[str, Any]:
    """The request's sampling fields over the config's, checked together before the model loads; what neither
    sets comes from the model's recommendation (backend.sampling_defaults), as in `tuichat ask` and the TUI."""
    seed = None if body.seed is None else body.seed % 2**64
    given = {"temperature": body.temperature, "top_p": body.top_p, "seed": seed, "max_tokens": max_tokens,
             "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
             "stop": (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()) or None}
    chosen = {**server.sampling, **{k: v for k, v in given.items() if v is not None}}
    try:
        chat_sampling({}, chosen)
    except TuichatError as exc:
        raise ApiError(400, str(exc)) from None
    return chosen


@router.post("/v1/chat/completions", response_model=schema.CreateChatCompletionResponse,
             responses={200: _STREAMED, **contract.errors(400, 404, 500)},
             summary="The assistant's reply to a conversation, in the model's chat template")
async def chat(body: schema.CreateChatCompletionRequest, server: Served):
    chosen = _chosen(server, body, body.max_completion_tokens or body.max_tokens)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    messages = [m.message() for m in body.messages]
    return await _reply(server, body, chosen, lambda spec, p: server.backend.stream(request_id, messages, p, spec),
                        request_id, "/v1/chat/completions", _CHAT)


@router.post("/v1/completions", response_model=schema.CreateCompletionResponse,
             responses={200: _STREAMED, **contract.errors(400, 404, 500)},
             summary="The prompt continued as plain text, with no chat template")
async def completions(body: schema.CreateCompletionRequest, server: Served):
    # Left out, max_tokens is the config's, else OpenAI's default for plain completions: 16.
    chosen = {"max_tokens": 16, **_chosen(server, body, body.max_tokens)}
    prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    return await _reply(server, body, chosen, lambda spec, p: server.backend.complete(request_id, prompt, p, spec),
                        request_id, "/v1/completions", _TEXT)


async def _reply(server: Server, body: schema.Sampling, chosen: dict[str, Any], start, request_id: str, path: str,
                 shape: _Shape):
    """The response to a completion request: `start(spec, params)` opens the backend's stream of events;
    `shape` is schema's chat or plain-text builders."""
    started = time.monotonic()
    model, spec = await server.models.load(body.model)
    params = chat_sampling(server.backend.sampling_defaults(model), chosen)
    events = aiter(start(spec, params))
    try:  # the first event, before any byte is sent: a bad prompt is an error status, not a broken stream
        first = await anext(events)
    except TuichatError as exc:
        await events.aclose()
        raise refusal(exc) from None

    def done(usage: Usage, status: int = 200) -> None:
        server.metrics.finished(model, usage)
        log.info("POST %s %d prompt %d cached %d completion %d ttft %s ms e2e %.0f ms%s%s", path, status,
                 usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens,
                 "-" if usage.ttft_ms is None else f"{usage.ttft_ms:.0f}", (time.monotonic() - started) * 1000,
                 f" · dropped {usage.dropped_messages} oldest messages" if usage.dropped_messages else "",
                 f" · cache miss: {usage.cache_miss}" if usage.cache_miss else "")

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
