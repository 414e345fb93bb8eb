"""OpenAI's error shape for all that `tuichat serve` refuses or fails at: ApiError, which the routes raise, and
the handlers of what FastAPI and Starlette raise themselves (a malformed request is a 400, never FastAPI's 422)."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tuichat.backends.protocol import ModelNotFound, PromptTooLong, TuichatError
from tuichat.server import schema


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.body = status, schema.error_body(message, kind, param, code)


def refusal(exc: TuichatError) -> ApiError:
    """The response to what the backend refused."""
    if isinstance(exc, ModelNotFound):
        return ApiError(404, str(exc), "model", "model_not_found")
    if isinstance(exc, PromptTooLong):  # OpenAI's code for it, which clients look for to trim a history
        return ApiError(400, str(exc), "messages", "context_length_exceeded")
    return ApiError(400, str(exc))


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


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body, exc.status)


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
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


async def _failed(request: Request, exc: Exception) -> JSONResponse:
    # What nothing above expected: still OpenAI's shape (Starlette then re-raises it, for the log).
    return JSONResponse(schema.error_body(f"The server failed: {type(exc).__name__}", "server_error"), 500)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # The headers too: a 405 names the methods the path takes in Allow.
    return JSONResponse(schema.error_body(str(exc.detail), code=str(exc.status_code)), exc.status_code,
                        headers=exc.headers)


HANDLERS = {ApiError: _api_error, RequestValidationError: _invalid, Exception: _failed,
            StarletteHTTPException: _http_error}
