"""GET /v1/models: the models requests may name."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from tuichat.server import schema
from tuichat.server.dependencies import Served

router = APIRouter()


@router.get("/v1/models", response_model=schema.ListModelsResponse,
            summary="The model the server was started with, first; then the others it can load")
async def list_models(server: Served) -> dict:
    served, _ = await server.models.load()
    listed = await asyncio.to_thread(server.backend.list_models)
    ids = dict.fromkeys([served, *(m.spec for m in listed)])
    return {"object": "list", "data": [schema.model_card(i) for i in ids]}
