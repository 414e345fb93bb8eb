"""Where tuichat keeps its files: platformdirs locations, each overridable by an environment variable
(tests point them at temporary folders; users can move them)."""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_cache_dir, user_config_dir, user_data_dir

APP = "tuichat"


def _dir(env: str, default: str) -> Path:
    path = Path(os.environ.get(env) or default)
    path.mkdir(parents=True, exist_ok=True)
    return path


def config_dir() -> Path:
    """config.toml and the user's themes/ folder."""
    return _dir("TUICHAT_CONFIG_DIR", user_config_dir(APP))


def data_dir() -> Path:
    """history.sqlite3."""
    return _dir("TUICHAT_DATA_DIR", user_data_dir(APP))


def cache_dir() -> Path:
    """Converted models (models/)."""
    return _dir("TUICHAT_CACHE_DIR", user_cache_dir(APP))
