"""The command line without a model: help says where the files are; paths prints them."""

from __future__ import annotations

import os
import subprocess
import sys


def run(*args, **env):
    return subprocess.run([sys.executable, "-m", "tuichat", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60)


def test_help_names_the_real_file_locations(tmp_path):
    result = run("--help", TUICHAT_DATA_DIR=str(tmp_path / "hist"), TUICHAT_CONFIG_DIR=str(tmp_path / "conf"))
    assert result.returncode == 0
    assert f"{tmp_path / 'hist'}/history.sqlite3" in result.stdout
    assert f"{tmp_path / 'conf'}/config.toml" in result.stdout
    assert "torch" not in result.stderr  # --help stays light: no heavy import fails or warns


def test_paths_prints_every_location(tmp_path):
    result = run("paths", TUICHAT_CACHE_DIR=str(tmp_path / "c"))
    assert result.returncode == 0
    assert f"cache:   {tmp_path / 'c'}" in result.stdout
    for name in ("config:", "themes:", "history:"):
        assert name in result.stdout
