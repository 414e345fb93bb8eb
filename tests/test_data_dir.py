"""The data dir shared by every tuichat of a user: exports as private as the history (test_store checks the
history itself), and conversations held by one running tuichat at a time (tuichat.locks), tested with real
other processes and separate holders in this one."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

import pytest
from fake_backend import FakeBackend

from tests.helpers import mode
from tuichat import locks as locks_module
from tuichat.config import Config
from tuichat.locks import ConversationLocks, Owner
from tuichat.store import Store
from tuichat.ui.app import TuichatApp
from tuichat.ui.measure import until
from tuichat.ui.screens import SearchScreen

REPO = Path(__file__).resolve().parent.parent
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


HOLDER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from tuichat.locks import ConversationLocks
    locks = ConversationLocks(Path(sys.argv[1]))
    for conversation_id in sys.argv[2:]:
        assert locks.claim(conversation_id) is None, conversation_id
    print("held", flush=True)
    sys.stdin.read()  # until the test kills it
    """
)


@contextmanager
def other_tuichat(folder: Path, *conversation_ids: str):
    """Another process holding these conversations as a tuichat with them open would."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder), *conversation_ids],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
    )
    try:
        ready, _, _ = select.select([process.stdout], [], [], 60)  # readline alone would wait for ever on a hang
        assert ready and process.stdout.readline() == "held\n", "the other tuichat never held its conversations"
        yield process
    finally:
        process.kill()
        process.wait(timeout=30)


ME = Owner(os.getpid(), socket.gethostname())


def test_two_holders_in_one_process_exclude_each_other_until_a_release(tmp_path, permissive_umask):
    folder = tmp_path / "locks"
    a, b = ConversationLocks(folder), ConversationLocks(folder)
    assert a.claim("c1") is None and a.claim("c1") is None  # claiming again what it holds is fine
    assert b.claim("c1") == ME  # separate open file descriptions conflict, even in one process
    assert b.claim("c2") is None  # conversations are independent
    assert mode(folder) == 0o700 and mode(folder / "c1.lock") == 0o600
    a.release("c1")
    assert not (folder / "c1.lock").exists()
    assert b.claim("c1") is None and a.claim("c1") == ME
    b.release_all()
    assert a.claim("c2") is None and a.claim("c1") is None
    a.release_all()


def test_a_killed_owner_gives_its_conversations_up(tmp_path):
    folder = tmp_path / "locks"
    mine = ConversationLocks(folder)
    with other_tuichat(folder, "c1", "c2") as other:
        assert mine.claim("c1") == mine.claim("c2") == Owner(other.pid, socket.gethostname())
        assert str(mine.claim("c1")) == f"tuichat process {other.pid}"
        other.kill()  # SIGKILL: nothing of tuichat runs on the way out
        other.wait(timeout=30)
        assert mine.claim("c1") is None and mine.claim("c2") is None  # the stale files do not matter
    mine.release_all()


def test_a_file_removed_between_open_and_lock_is_not_taken_for_the_lock(tmp_path, monkeypatch):
    """The holder releases (removes the file, then unlocks) just after a claimer opened the file: the claimer
    then locks a file nobody else can find, and must lock the one now at the path instead."""
    folder = tmp_path / "locks"
    first, second, third = (ConversationLocks(folder) for _ in range(3))
    assert first.claim("c") is None
    real_flock = locks_module.fcntl.flock

    def flock_after_a_release(fd, operation):
        first.release("c")
        return real_flock(fd, operation)

    monkeypatch.setattr(locks_module.fcntl, "flock", flock_after_a_release)
    assert second.claim("c") is None
    monkeypatch.setattr(locks_module.fcntl, "flock", real_flock)
    assert third.claim("c") == ME  # only one holder at a time
    second.release_all()


async def search_and_open(pilot, word: str) -> None:
    app = pilot.app
    await pilot.press("ctrl+f")
    assert isinstance(app.screen, SearchScreen)
    await pilot.press(*word)
    await until(lambda: app.screen.query_one("OptionList").option_count > 0, "search hits")
    await pilot.press("enter")
    await until(lambda: not isinstance(app.screen, SearchScreen), "the search closed")


async def test_a_second_instance_keeps_off_the_first_ones_tabs_and_names_it(data):
    theirs, mine = conversations(("Their plan", "zanzibar trip"), ("Mine", "hello"))
    locks = data / "locks"
    with other_tuichat(locks, theirs) as other:
        app = make_app()
        async with app.run_test(size=SIZE) as pilot:
            assert [tab.conversation_id for tab in app.tabs()] == [mine]
            assert f'Open in tuichat process {other.pid}, so not here: "Their plan"' in notifications(app)

            # From search: refused, naming the process, and no tab for it.
            await search_and_open(pilot, "zanzib")
            refused = f'"Their plan" is open in tuichat process {other.pid}'
            await until(lambda: refused in notifications(app), "the refusal")
            assert [tab.conversation_id for tab in app.tabs()] == [mine]

            # The other one dies without closing anything: the kernel drops its lock, and the tab opens here.
            other.kill()
            other.wait(timeout=30)
            await search_and_open(pilot, "zanzib")
            await until(lambda: app.active_tab.conversation_id == theirs, "the conversation opened here")
            # Now this instance holds both, as a third holder sees.
            third = ConversationLocks(locks)
            assert (third.claim(theirs), third.claim(mine)) == (ME, ME)
            await pilot.press("alt+w")  # closing a tab gives its conversation up at once
            await until(lambda: len(app.tabs()) == 1, "the tab closed")
            assert third.claim(theirs) is None
            third.release_all()
        assert ConversationLocks(locks).claim(mine) is None  # and quitting gives up the rest


async def test_when_every_open_tab_is_held_elsewhere_a_new_conversation_starts(data):
    held = conversations(("One", "first"), ("Two", "second"))
    with other_tuichat(data / "locks", *held) as other:
        app = make_app()
        async with app.run_test(size=SIZE) as pilot:
            [tab] = app.tabs()
            assert tab.conversation_id not in held and tab.title == "New chat"
            assert f'tuichat process {other.pid}, so not here: "One", "Two"' in notifications(app)
            await pilot.press("ctrl+t")  # new tabs are this instance's own
            assert len(app.tabs()) == 2
        # Both instances' conversations are still open tabs for whoever starts next.
        assert len(Store().conversations(open_only=True)) == 4


@pytest.mark.parametrize("why", ["no lock folder", "no flock"])
async def test_where_nothing_can_be_locked_it_says_so_once_and_goes_on(data, monkeypatch, why):
    Store().close()
    if why == "no flock":  # as on Windows
        monkeypatch.setattr(locks_module, "fcntl", None)
    else:
        (data / "locks").write_text("a file where the lock folder should be")
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+t")
        assert len(app.tabs()) == 2
        assert notifications(app).count("Conversations cannot be locked") == 1
