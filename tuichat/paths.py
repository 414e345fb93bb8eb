"""Where tuichat keeps its files: platformdirs locations, each overridable by an environment variable
(tests point them at temporary folders; users can move them).

The history is private data: the data dir is kept 0700 and the files in it 0600, as shells keep their
history, whatever the umask; files and folders an older tuichat made under the default umask are tightened
when they are opened.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from platformdirs import user_config_dir, user_data_dir

# The cache is the engine's (its kernels and quantized weights); converted models join it.
from tuichat.engine.storage import cache_dir, cache_location

__all__ = ["cache_dir", "config_dir", "data_dir", "location", "open_private", "private_dir", "write_private"]

APP = "tuichat"
PRIVATE_FILE = 0o600
_LOCATIONS = {
    "config": ("TUICHAT_CONFIG_DIR", user_config_dir),
    "data": ("TUICHAT_DATA_DIR", user_data_dir),
}


def location(kind: str) -> Path:
    """The folder for `kind` (config, data, cache), without creating it."""
    if kind == "cache":
        return cache_location()
    env, default = _LOCATIONS[kind]
    return Path(os.environ.get(env) or default(APP))


def _dir(kind: str) -> Path:
    path = location(kind)
    path.mkdir(parents=True, exist_ok=True)
    return path


def make_private(path: Path) -> None:
    """Take group and other permissions off `path` if it is ours. A folder someone else owns (a shared one
    named by TUICHAT_DATA_DIR) is left alone: the files tuichat writes in it are private anyway."""
    info = path.stat()
    if info.st_mode & 0o077 and info.st_uid == os.getuid():
        path.chmod(stat.S_IMODE(info.st_mode) & 0o700)


def private_dir(path: Path) -> Path:
    """`path`, created if missing, readable by its owner only."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)  # mode applies to the last folder only: the rest is not ours
    make_private(path)
    return path


def open_private(path: Path, flags: int) -> int:
    """os.open(path, flags | O_CREAT) with a new file made 0600 and an existing one tightened to it."""
    fd = os.open(path, flags | os.O_CREAT, PRIVATE_FILE)
    make_private(path)
    return fd


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` (UTF-8) as a private file."""
    with open(open_private(path, os.O_WRONLY | os.O_TRUNC), "w", encoding="utf-8") as file:
        file.write(text)


def config_dir() -> Path:
    """config.toml and the user's themes/ folder."""
    return _dir("config")


def data_dir() -> Path:
    """history.sqlite3, exports/ and locks/: private."""
    return private_dir(location("data"))

