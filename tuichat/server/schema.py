"""The OpenAI API's request and response bodies that `tuichat serve` speaks, as pydantic models under OpenAI's
own names: FastAPI validates requests with them and publishes them in /openapi.json (contract.py); the
builders below write the responses field for field as the models describe them (tests/test_openapi.py holds
them to it).

Requests are validated strictly, as their JSON Schema reads (a number is not a string, `true` is not 1) and
within the bounds tuichat honours, which are OpenAI's where tuichat has the feature at all; a field tuichat
cannot honour is accepted only at the value that means "off". Fields the models do not name are ignored."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

from tuichat.backends.protocol import Message, Usage

# -- requests ----------------------------------------------------------------------------------------------------

_Number = Annotated[float, Field(allow_inf_nan=False)]


def _integral(value: Any) -> Any:
    return int(value) if type(value) is float and value.is_integer() else value


def _int(**bounds: int) -> Any:
    """JSON Schema's integer within `bounds`: 2.0 is one too (strict pydantic would take only 2); true and "2"
    are not."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# A validator's ValueError is the request's error message as it stands (app.py): each names its field.

def _refuse(name: str) -> ValueError:
    return ValueError(f"{name} is not supported: leave it out.")


class ChatCompletionRequestMessageContentPartText(_Request):
    type: Literal["text"]
    text: str


class ChatCompletionRequestMessage(_Request):
    """One message of the conversation; a list of text parts is their concatenation. Only an assistant's
    message may leave its content out (OpenAI's rule). `name`, `tool_calls` and the like are ignored."""

    # As JSON Schema says it: content is required, and not null, unless the role is the assistant's.
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"role": {"const": "assistant"}}},
        "else": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}})

    role: Literal["system", "developer", "user", "assistant"] = Field(
        description='"developer" is OpenAI\'s newer name for "system".')
    content: str | list[ChatCompletionRequestMessageContentPartText] | None = Field(None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _said(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and info.data.get("role", "assistant") != "assistant":
            raise ValueError(f"content is required in a {info.data['role']} message.")
        return value

    def message(self) -> Message:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or ())
        return Message("system" if self.role == "developer" else self.role, text)


class ChatCompletionStreamOptions(_Request):
    include_usage: bool | None = Field(None, description="A last chunk, with no choices, carries the usage.")


class Sampling(_Request):
    """The fields chat and plain completions share. Left out (or null), a sampling field takes the server's
    config, then the model's recommendation."""

    model: str | None = Field(None, description="A model of GET /v1/models, or any spec `tuichat --model` takes; "
                                                "left out, the model the server was started with.")
    temperature: Annotated[_Number, Field(ge=0, le=2)] | None = Field(None, description="0 is greedy, exactly.")
    top_p: Annotated[_Number, Field(gt=0, le=1)] | None = None
    max_tokens: _int(ge=1) | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = Field(
        None, description="Up to 4 strings; the reply ends before the first of them, which it does not include.")
    # Unbounded, and taken modulo 2**64 (app.py): the engine's seeds are 64-bit, OpenAI's are signed (an int64's
    # bits read as unsigned give the same seed), and a bound that large would be read as a double by JSON
    # Schema validators, with no exact value left to draw the line at.
    seed: _int() | None = Field(None, description="Taken modulo 2**64. The same seed, request and model give the "
                                               "same reply.")
    n: _int(ge=1, le=1) | None = Field(1, description="tuichat writes one choice per request.")
    presence_penalty: Annotated[_Number, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[_Number, Field(ge=-2, le=2)] | None = None
    stream: bool | None = Field(False, description="Reply as server-sent events (text/event-stream), ending with "
                                                    "`data: [DONE]`.")
    stream_options: ChatCompletionStreamOptions | None = None

    @field_validator("n", mode="before")
    @classmethod
    def _one_choice(cls, value: Any) -> Any:
        if type(value) in (int, float) and value != 1:
            raise ValueError(f"n must be 1: tuichat writes one choice per request, not {value}.")
        return value


class CreateChatCompletionRequest(Sampling):
    """POST /v1/chat/completions. The last message is the user's: the reply is the assistant's next."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16},
        {"messages": [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Hi?"}],
         "temperature": 0, "stream": True, "stream_options": {"include_usage": True}},
    ]})

    messages: list[ChatCompletionRequestMessage] = Field(min_length=1)
    max_completion_tokens: _int(ge=1) | None = Field(
        None, description="OpenAI's newer name for max_tokens; it wins when both are given.")


class CreateCompletionRequest(Sampling):
    """POST /v1/completions: one prompt of plain text (a list holding one is the same), continued with no chat
    template. `echo`, `suffix` and `logprobs` are refused unless left at their "off" value."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "The three primary colours are", "max_tokens": 16, "temperature": 0},
        {"prompt": ["Once upon a time"], "stream": True, "stream_options": {"include_usage": True}},
    ]})

    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[str, Field(min_length=1)]],
                                                             Field(min_length=1, max_length=1)]
    max_tokens: _int(ge=1) | None = Field(None, description="Left out: the server's config, else 16 (OpenAI's).")
    echo: Literal[False] | None = None
    suffix: None = None
    logprobs: None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError(f"prompt must be one string, not a list of {len(value)}.")
        return value

    # Before their types are checked: a value that asks for the feature is refused by name, with what to do.
    @field_validator("echo", mode="before")
    @classmethod
    def _no_echo(cls, value: Any) -> Any:
        if value is True:
            raise _refuse("echo")
        if value is not False and value is not None:  # pydantic's Literal[False] would take 0 (0 == False)
            raise ValueError("echo must be false, or left out.")
        return value

    @field_validator("suffix", "logprobs", mode="before")
    @classmethod
    def _off(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise _refuse(info.field_name)
        return value


# -- responses ---------------------------------------------------------------------------------------------------

FinishReason = Literal["stop", "length"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens the prefix cache held.")


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatCompletionResponseMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatCompletionResponseMessage
    logprobs: None
    finish_reason: FinishReason


class CreateChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str = Field(description="The model's id, as GET /v1/models lists it.")
    choices: list[ChatCompletionChoice] = Field(min_length=1, max_length=1)
    usage: CompletionUsage


class ChatCompletionStreamResponseDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: ChatCompletionStreamResponseDelta
    logprobs: None
    finish_reason: FinishReason | None


class CreateChatCompletionStreamResponse(BaseModel):
    """One event of a streamed chat reply: the first has the role, then text deltas, then one with the finish
    reason and an empty delta; with `stream_options.include_usage`, a last one with no choices and the usage."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice] = Field(max_length=1)
    usage: CompletionUsage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None
    finish_reason: FinishReason


class CreateCompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice] = Field(min_length=1, max_length=1)
    usage: CompletionUsage


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: None
    finish_reason: FinishReason | None


class CreateCompletionStreamResponse(BaseModel):
    """One event of a streamed plain completion: text pieces, then one with the finish reason; with
    `stream_options.include_usage`, a last one with no choices and the usage."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionStreamChoice] = Field(max_length=1)
    usage: CompletionUsage | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ListModelsResponse(BaseModel):
    """The model the server was started with first, then the others it can load."""

    object: Literal["list"]
    data: list[Model] = Field(min_length=1)


class Error(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, or server_error when the engine failed.")
    param: str | None = Field(description="The request field at fault, dotted (messages.0.role).")
    code: str | None = Field(description="model_not_found, context_length_exceeded, invalid_api_key, ...")


class ErrorResponse(BaseModel):
    """Every error, in OpenAI's shape; also the last event of a stream the engine failed in mid-reply."""

    error: Error


class Health(BaseModel):
    status: Literal["ok"]


# -- response builders (dicts: a streamed reply writes one per piece) ---------------------------------------------

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


def model_card(model_id: str) -> dict:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "tuichat"}


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
