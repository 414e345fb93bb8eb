"""tuichat in a real pseudo-terminal: the terminal driver, signals and the exit, which pilot tests (a headless
driver) never reach. The app runs `run_tui` over FakeBackend in a child process (tests/tui_with_fake_backend.py)."""

from __future__ import annotations

import fcntl
import os
import sqlite3
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENTER, CTRL_Q = b"\r", b"\x11"


class Terminal:
    """A pseudo-terminal of 100 × 30 with tuichat in it: bytes typed in, everything it wrote kept."""

    def __init__(self, data_dir: Path, *args: str) -> None:
        self.data_dir = data_dir
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
        env = {**os.environ, "TERM": "xterm-256color", "TUICHAT_DATA_DIR": str(data_dir),
               "TUICHAT_CONFIG_DIR": str(data_dir.parent / "config")}
        self.process = subprocess.Popen([sys.executable, "-m", "tests.tui_with_fake_backend", *args], cwd=ROOT,
                                        env=env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
        os.close(slave)
        self.master = master
        self.output = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        # Always drained, so the app never blocks writing a frame; EIO once the app has closed the terminal.
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            self.output += data

    def type(self, data: bytes) -> None:
        os.write(self.master, data)

    def wait_for(self, condition, what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.process.poll() is not None and not condition():
                raise AssertionError(f"tuichat exited ({self.process.returncode}) before {what}:\n{self.text()[-3000:]}")
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{self.text()[-3000:]}"
            time.sleep(0.02)

    def shows(self, text: str) -> bool:
        return text.encode() in self.output

    def text(self) -> str:
        return self.output.decode("utf-8", "replace")

    def messages(self) -> list[tuple[str, str, str]]:
        """(role, content, status) of every stored message, read as another process would."""
        try:
            with sqlite3.connect(f"file:{self.data_dir / 'history.sqlite3'}?mode=ro", uri=True) as db:
                return db.execute("SELECT role, content, status FROM messages ORDER BY id").fetchall()
        except sqlite3.OperationalError:  # not created yet
            return []

    def exit_code(self, timeout: float) -> int:
        code = self.process.wait(timeout)
        self._reader.join(5)
        return code

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._reader.join(5)
        os.close(self.master)


@pytest.fixture
def terminal(tmp_path):
    started: list[Terminal] = []

    def start(*args: str) -> Terminal:
        started.append(Terminal(tmp_path / "data", *args))
        started[-1].wait_for(lambda: started[-1].shows("Enter sends"), "the first frame")
        return started[-1]

    yield start
    for term in started:
        term.close()


def test_an_invalid_byte_typed_keeps_the_app_and_the_prompt(terminal):
    term = terminal()
    term.type(b"abc")
    term.wait_for(lambda: term.shows("abc"), "abc in the prompt")
    term.type(b"\xff")  # not UTF-8: Textual's strict decoder would end the app here
    term.type(b"def")
    term.wait_for(lambda: term.shows("abc\ufffddef"), "the rest of the prompt")
    term.type(ENTER)
    term.wait_for(lambda: ("user", "abc\ufffddef", "done") in term.messages(), "the message sent")
    term.wait_for(lambda: [m[2] for m in term.messages()] == ["done", "done"], "the reply")
    term.type(CTRL_Q)
    assert term.exit_code(timeout=20) == 0
    assert "Traceback" not in term.text()
