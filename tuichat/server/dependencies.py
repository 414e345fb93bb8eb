"""What the routes share: create_app keeps it on app.state, and FastAPI hands it to each route that names
`Served` (a dependency, as FastAPI's "Bigger Applications" shares a database)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request

from tuichat.backends.protocol import Backend, ModelNotFound, TuichatError
from tuichat.server.errors import ApiError
from tuichat.server.metrics import ServerMetrics


class Models:
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


@dataclass
class Server:
    """`sampling`: the user's config, which a request's own fields override."""

    backend: Backend
    models: Models
    metrics: ServerMetrics
    sampling: dict[str, Any]


def _server(request: Request) -> Server:
    return request.app.state.server


Served = Annotated[Server, Depends(_server)]
