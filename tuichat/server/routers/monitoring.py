"""GET /health and GET /metrics: public, for load balancers and Prometheus."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from tuichat.server import schema
from tuichat.server.dependencies import Served

router = APIRouter()


@router.get("/health", response_model=schema.Health, summary="200 once the model is loaded (no key needed)")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics, under vLLM's names")
async def prometheus(server: Served) -> PlainTextResponse:
    return PlainTextResponse(server.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")
