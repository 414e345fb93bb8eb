"""What /openapi.json says of `tuichat serve`: FastAPI's document of its routes (schema.py's models), with what
FastAPI cannot infer from them: the streamed replies' events, OpenAI's error shape in place of FastAPI's 422,
and the API key where the server has one."""

from __future__ import annotations

from importlib import metadata
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from tuichat.server import schema

_REF = "#/components/schemas/{model}"

# Why each status is answered; every error body is schema.ErrorResponse.
_WHY = {
    400: "The request is malformed, out of bounds, or asks for what tuichat does not do (`param` names the field); "
         "`context_length_exceeded` for a prompt longer than the model's context.",
    401: "No API key, or the wrong one (`invalid_api_key`).",
    404: "No such model (`model_not_found`).",
    500: "The engine failed (`server_error`).",
}

# The operations that stream with `stream: true`, and the model of each event's data.
_STREAMS: dict[tuple[str, str], type[BaseModel]] = {
    ("/v1/chat/completions", "post"): schema.CreateChatCompletionStreamResponse,
    ("/v1/completions", "post"): schema.CreateCompletionStreamResponse,
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The `responses` of a route that answers these error statuses."""
    return {code: {"model": schema.ErrorResponse, "description": _WHY[code]} for code in codes}


def version() -> str:
    try:
        return metadata.version("tuichat")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0"


def _event_stream(model: type[BaseModel]) -> dict[str, Any]:
    """The text/event-stream media type of a streamed reply, as OpenAPI 3.2 describes one (itemSchema: each
    event; FastAPI writes the same for its own SSE routes): each event's data is a JSON `model`, or an
    ErrorResponse when the engine failed mid-reply, and the last is `[DONE]`."""
    data = {"type": "string",
            "if": {"const": "[DONE]"},
            "else": {"contentMediaType": "application/json",
                     "contentSchema": {"anyOf": [{"$ref": _REF.format(model=model.__name__)},
                                                 {"$ref": _REF.format(model=schema.ErrorResponse.__name__)}]}}}
    return {"itemSchema": {"type": "object", "required": ["data"],
                           "properties": {"data": data, "event": {"type": "string"}, "id": {"type": "string"},
                                          "retry": {"type": "integer", "minimum": 0}}}}


def document(app: FastAPI, secured: bool) -> dict[str, Any]:
    """The OpenAPI document of `app`; `secured`: /v1/ asks for the API key (a bearer token)."""
    doc = get_openapi(title=app.title, version=app.version, summary=app.summary, description=app.description,
                      routes=app.routes)
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    # The events' models, under the names FastAPI gives the rest (pydantic's own), beside them.
    _, streamed = models_json_schema([(m, "serialization") for m in _STREAMS.values()], ref_template=_REF)
    schemas.update(streamed.get("$defs", {}))
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            # A request FastAPI cannot validate is a 400 in OpenAI's shape (app.py), never FastAPI's own 422.
            responses.pop("422", None)
            if (model := _STREAMS.get((path, method))) is not None:
                responses["200"]["content"]["text/event-stream"] = _event_stream(model)
            if secured and path.startswith("/v1/"):
                operation["security"] = [{"bearer": []}]
                responses["401"] = {"description": _WHY[401], "content": {"application/json": {
                    "schema": {"$ref": _REF.format(model=schema.ErrorResponse.__name__)}}}}
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    if secured:
        components["securitySchemes"] = {"bearer": {
            "type": "http", "scheme": "bearer",
            "description": "The key `tuichat serve` was given (--api-key or TUICHAT_API_KEY)."}}
    return doc
