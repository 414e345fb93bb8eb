"""The data dir shared by every tuichat of a user: exports as private as the history (test_store checks the
history itself)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from conftest import mode
from fake_backend import FakeBackend
from tuichat.config import Config
from tuichat.store import Store
from tuichat.ui.app import TuichatApp

SIZE = (110, 36)


@pytest.fixture
def data(tmp_path) -> Path:
    return tmp_path / "data"  # TUICHAT_DATA_DIR (conftest)


def make_app() -> TuichatApp:
    backend = FakeBackend()
    app = TuichatApp(lambda: backend, Config(), Store())
    app.animation_level = "none"
    return app


def notifications(app) -> str:
    return "\n".join(n.message for n in app._notifications)


async def until(condition, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def conversations(*specs: tuple[str, str]) -> list[str]:
    """Open conversations (title, one user message) in the default history, as an earlier run left them."""
    store = Store()
    ids = []
    for title, text in specs:
        ids.append(store.create_conversation(title, "smollm2-135m"))
        store.add_message(ids[-1], "user", text)
    store.close()
    return ids


async def test_exports_are_private_and_an_older_readable_one_is_tightened(data, permissive_umask):
    diary, notes = conversations(("Diary", "a secret"), ("Notes", "another secret"))
    exports = data / "exports"
    exports.mkdir(parents=True)  # as an older tuichat left them: readable by everyone
    older = exports / f"Diary-{diary[:8]}.md"
    older.write_text("old export")
    assert mode(exports) == 0o755 and mode(older) == 0o644

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        for _ in (diary, notes):
            await pilot.press("ctrl+s")
            await pilot.press("ctrl+pagedown")
        new = exports / f"Notes-{notes[:8]}.md"
        await until(lambda: new.exists() and "another secret" in new.read_text(), "the second export")
        assert "a secret" in older.read_text()
        assert mode(exports) == 0o700
        assert (mode(older), mode(new)) == (0o600, 0o600)
