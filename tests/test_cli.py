"""The command line without a model: help says where the files are without importing the engine or the UI;
paths prints each location."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent


def run(*args, **env):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env={**os.environ, **env},
                          timeout=60)


def test_help_names_the_real_file_locations(tmp_path):
    result = run("-m", "tuichat", "--help", TUICHAT_DATA_DIR=str(tmp_path / "hist"),
                 TUICHAT_CONFIG_DIR=str(tmp_path / "conf"))
    assert result.returncode == 0
    assert f"{tmp_path / 'hist'}/history.sqlite3" in result.stdout
    assert f"{tmp_path / 'conf'}/config.toml" in result.stdout


def test_help_stays_light():
    code = (
        "import sys\nfrom tuichat.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(name for name in ('torch', 'transformers', 'textual') if name in sys.modules))"
    )
    result = run("-c", code)
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == "[]"


def test_paths_prints_every_location(tmp_path):
    result = run("-m", "tuichat", "paths", TUICHAT_CONFIG_DIR=str(tmp_path / "conf"),
                 TUICHAT_DATA_DIR=str(tmp_path / "hist"), TUICHAT_CACHE_DIR=str(tmp_path / "c"))
    assert result.returncode == 0
    printed = dict(line.split(":", 1) for line in result.stdout.splitlines())
    assert {name: value.strip() for name, value in printed.items()} == {
        "config": str(tmp_path / "conf" / "config.toml"),
        "themes": str(tmp_path / "conf" / "themes"),
        "bundled": str(CHECKOUT / "themes"),
        "history": str(tmp_path / "hist" / "history.sqlite3"),
        "cache": str(tmp_path / "c"),
    }
