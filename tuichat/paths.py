"""Where tuichat keeps its files: platformdirs locations, each overridable by an environment variable
(tests point them at temporary folders; users can move them)."""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_cache_dir, user_config_dir, user_data_dir

APP = "tuichat"
_LOCATIONS = {
    "config": ("TUICHAT_CONFIG_DIR", user_config_dir),
    "data": ("TUICHAT_DATA_DIR", user_data_dir),
    "cache": ("TUICHAT_CACHE_DIR", user_cache_dir),
}


def location(kind: str) -> Path:
    """The folder for `kind` (config, data, cache), without creating it."""
    env, default = _LOCATIONS[kind]
    return Path(os.environ.get(env) or default(APP))


def _dir(kind: str) -> Path:
    path = location(kind)
    path.mkdir(parents=True, exist_ok=True)
    return path


def config_dir() -> Path:
    """config.toml and the user's themes/ folder."""
    return _dir("config")


def data_dir() -> Path:
    """history.sqlite3."""
    return _dir("data")


def cache_dir() -> Path:
    """Converted models (models/)."""
    return _dir("cache")
