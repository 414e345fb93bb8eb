"""The OpenAI API's request and response shapes that `tuichat serve` speaks, as pydantic models (FastAPI
validates requests with them) and builders for the responses, field for field as OpenAI names them."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tuichat.backend import Message, Usage


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id... are accepted and unused

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def message(self) -> Message:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or ())
        # "developer" is the newer name OpenAI gives the system role.
        return Message("system" if self.role == "developer" else self.role, text)


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """The sampling fields chat and plain completions share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(Sampling):
    """What /v1/completions accepts: one prompt of plain text (a list holding one is the same)."""

    prompt: str | list[str]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None


class ChatRequest(Sampling):
    """What /v1/chat/completions accepts. Fields the engine has no way to honour are taken only at the value
    that means "off" (see app.py); the rest of the OpenAI API's optional fields are accepted and unused."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


def usage_body(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def finish_reason(usage: Usage) -> str:
    """OpenAI's reasons are stop and length; a cancelled reply (the server stopping) reads as stop."""
    return "length" if usage.finish_reason == "length" else "stop"


def completion(request_id: str, model: str, text: str, usage: Usage, created: int | None = None) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": finish_reason(usage)}],
        "usage": usage_body(usage),
    }


def text_completion(request_id: str, model: str, text: str, usage: Usage) -> dict:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(usage)}],
            "usage": usage_body(usage)}


def _streamed(kind: str, field: str, request_id: str, model: str, created: int, value, finish: str | None,
              usage: Usage | None) -> dict:
    """One streamed object of `kind`: a choice with `field` = value, or (value None) the usage chunk, whose
    choices are empty."""
    body = {"id": request_id, "object": kind, "created": created, "model": model,
            "choices": [] if value is None else [{"index": 0, field: value, "logprobs": None, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage_body(usage)
    return body


def text_chunk(request_id: str, model: str, created: int, text: str | None, finish: str | None = None,
               usage: Usage | None = None) -> dict:
    """One streamed piece of a plain completion."""
    return _streamed("text_completion", "text", request_id, model, created, text, finish, usage)


def chunk(request_id: str, model: str, created: int, delta: dict | None, finish: str | None = None,
          usage: Usage | None = None) -> dict:
    """One `chat.completion.chunk`: a delta, or (delta None) the usage chunk."""
    return _streamed("chat.completion.chunk", "delta", request_id, model, created, delta, finish, usage)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
