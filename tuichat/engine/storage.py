"""Where the engine keeps what it makes once and reuses: compiled CPU kernels (kernels/), quantized weights
(quantized/). The front ends keep their converted models beside them (tuichat.paths takes this root)."""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_cache_dir

CACHE_ENV = "TUICHAT_CACHE_DIR"  # tests point it at a temporary folder; users can move it


def cache_location() -> Path:
    """The cache folder, without creating it."""
    return Path(os.environ.get(CACHE_ENV) or user_cache_dir("tuichat"))


def cache_dir() -> Path:
    path = cache_location()
    path.mkdir(parents=True, exist_ok=True)
    return path
