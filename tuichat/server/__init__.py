"""`tuichat serve`: the engine behind an OpenAI-compatible HTTP API (app.py), on uvicorn. It talks to the
engine through a Backend, as the TUI, `ask` and `bench` do."""

from __future__ import annotations

import ipaddress
import logging
import sys
from collections.abc import Mapping
from typing import Any

from tuichat.backends.protocol import Backend


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False


def serve(backend: Backend, model: str, host: str, port: int, api_key: str | None,
          sampling: Mapping[str, Any],
          log_level: str = "info") -> None:
    import uvicorn

    from tuichat.server.app import create_app

    logging.basicConfig(stream=sys.stderr, format="[tuichat] %(message)s")
    logging.getLogger("tuichat.serve").setLevel(log_level.upper())
    app = create_app(backend, model, sampling, api_key)
    # uvicorn's own access log would repeat ours, without the tokens and timings.
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)
