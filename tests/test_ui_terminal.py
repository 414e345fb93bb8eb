"""tuichat in a real pseudo-terminal: the terminal driver, signals and the exit, which pilot tests (a headless
driver) never reach. The app runs `run_tui` over FakeBackend in a child process (tests/tui_with_fake_backend.py)."""

from __future__ import annotations

import fcntl
import os
import select
import signal
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
IN_ITS_OWN_TERMINAL = ("import os, runpy; os.login_tty(0); "
                       "runpy.run_module('tests.tui_with_fake_backend', run_name='__main__', alter_sys=True)")


class Terminal:
    """A pseudo-terminal of 100 × 30 with tuichat in it: bytes typed in, everything it wrote kept."""

    def __init__(self, data_dir: Path, *args: str) -> None:
        self.data_dir = data_dir
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
        env = {**os.environ, "TERM": "xterm-256color", "TUICHAT_DATA_DIR": str(data_dir),
               "TUICHAT_CONFIG_DIR": str(data_dir.parent / "config")}
        # The pty becomes the app's controlling terminal, as a terminal window's is: closing the master then
        # hangs it up as the kernel does (SIGHUP and SIGCONT, reads at EOF, writes failing).
        self.process = subprocess.Popen([sys.executable, "-c", IN_ITS_OWN_TERMINAL, *args], cwd=ROOT, env=env,
                                        stdin=slave, stdout=slave, stderr=slave)
        os.close(slave)
        self.master: int | None = master
        self.output = bytearray()
        self._stop_reading = threading.Event()
        self._reader = threading.Thread(target=self._read, args=(master,), daemon=True)
        self._reader.start()

    def _read(self, master: int) -> None:
        # Always drained, so the app never blocks writing a frame; EIO once the app has closed the terminal.
        while not self._stop_reading.is_set():
            if select.select([master], [], [], 0.05)[0]:
                try:
                    data = os.read(master, 65536)
                except OSError:
                    return
                if not data:
                    return
                self.output += data

    def type(self, data: bytes) -> None:
        os.write(self.master, data)

    def flood(self, data: bytes, timeout: float = 60) -> None:
        """`data` typed as fast as the terminal takes it: one key event a byte, not a bracketed paste."""
        deadline = time.monotonic() + timeout
        rest = memoryview(data)
        while rest:
            assert time.monotonic() < deadline, f"tuichat stopped reading its terminal, {len(rest)} bytes to go"
            if select.select([], [self.master], [], 0.05)[1]:
                rest = rest[os.write(self.master, rest[:256]) :]

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

    def hang_up(self) -> None:
        """The terminal goes away (its window closed): the kernel sends the app SIGHUP and SIGCONT, its reads
        end and every later write fails."""
        self._stop_reading.set()
        self._reader.join(5)
        os.close(self.master)
        self.master = None

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._reader.join(5)
        if self.master is not None:
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


def last(output: bytes, sequence: bytes) -> int:
    return output.rfind(sequence)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_while_a_reply_streams_saves_it_as_stopped_and_restores_the_terminal(terminal, signum):
    reply = " ".join(f"word{index}" for index in range(400))  # 40 s at 0.1 s a token: still streaming at the end
    term = terminal("--token-s", "0.1", "--reply", reply)
    term.type(b"hello" + ENTER)
    term.wait_for(lambda: term.shows("word3"), "tokens streaming")
    assert term.messages()[-1][2] == "streaming"
    os.kill(term.process.pid, signum)
    assert term.exit_code(timeout=10) == 128 + signum  # promptly, and saying which signal ended it
    output = bytes(term.output)
    # Restored: the last word on each mode is the one that turns it back.
    assert last(output, b"\x1b[?1049l") > last(output, b"\x1b[?1049h") >= 0  # left the alternate screen
    assert last(output, b"\x1b[?1000l") > last(output, b"\x1b[?1000h") >= 0  # mouse reporting off
    assert last(output, b"\x1b[?1003l") > last(output, b"\x1b[?1003h") >= 0
    assert last(output, b"\x1b[?25h") > last(output, b"\x1b[?25l") >= 0  # cursor shown
    assert len(output) - last(output, b"\x1b[?1049l") < 100  # and that is the end of it
    assert "Traceback" not in term.text()
    role, content, status = term.messages()[-1]
    assert (role, status) == ("assistant", "stopped")
    assert content.startswith("word0 word1 word2 word3") and len(content) < len(reply)


def test_a_hangup_after_the_terminal_is_gone_still_saves_the_reply_as_stopped(terminal):
    term = terminal("--token-s", "0.1", "--reply", " ".join(f"word{index}" for index in range(400)))
    term.type(b"hello" + ENTER)
    term.wait_for(lambda: term.shows("word3"), "tokens streaming")
    term.hang_up()
    os.kill(term.process.pid, signal.SIGHUP)
    assert term.exit_code(timeout=10) == 128 + signal.SIGHUP
    role, content, status = term.messages()[-1]
    assert (role, status) == ("assistant", "stopped") and content.startswith("word0 word1 word2 word3")


# Thousands of keys, no Enter among them: handled one by one, they would keep the prompt busy long after the
# test ends the app.
FLOOD = " ".join(f"typed{index}" for index in range(7000)).encode()


@pytest.mark.parametrize("end", ["hangup", "sigterm"])
def test_the_app_ends_at_once_whatever_input_is_queued(terminal, end):
    reply = " ".join(f"word{index}" for index in range(400))
    term = terminal("--token-s", "0.1", "--reply", reply)
    term.type(b"hello" + ENTER)
    term.wait_for(lambda: term.shows("word3"), "tokens streaming")
    term.flood(FLOOD)
    if end == "hangup":
        term.hang_up()
        signum = signal.SIGHUP  # the kernel's, to the process whose controlling terminal it was
    else:
        os.kill(term.process.pid, signal.SIGTERM)
        signum = signal.SIGTERM
    # Not after the queued keys: those would take the prompt many seconds (or, with the terminal gone, forever).
    assert term.exit_code(timeout=10) == 128 + signum
    if end == "sigterm":
        output = bytes(term.output)
        assert last(output, b"\x1b[?1049l") > last(output, b"\x1b[?1049h") >= 0  # the terminal restored
        assert "Traceback" not in term.text()
    role, content, status = term.messages()[-1]
    assert (role, status) == ("assistant", "stopped") and content.startswith("word0 word1 word2 word3")
    # Its tab is free: a second tuichat on the same history restores the conversation.
    again = terminal()
    again.wait_for(lambda: again.shows("word3"), "the conversation restored in a second tuichat")
    assert not again.shows("Another tuichat")
    again.type(CTRL_Q)
    assert again.exit_code(timeout=20) == 0



def test_a_reply_sent_as_the_app_ends_is_stored_as_stopped(terminal):
    """The terminal hung up (SIGTERM ends the app by the same path: the tests above send both)."""
    term = terminal("--first-token-s", "3600")  # the reply never gets its first token
    # Enter, then a paste's lines queued behind it: the turn is stored at once, but its widgets wait their turn
    # to mount (the lines after it, sent while it is under way, go back into the prompt).
    term.flood(b"hello" + ENTER + ENTER.join(FLOOD[start : start + 40] for start in range(0, len(FLOOD), 40)))
    term.wait_for(lambda: term.messages() == [("user", "hello", "done"), ("assistant", "", "streaming")],
                  "the reply started")
    term.hang_up()
    assert term.exit_code(timeout=10) == 128 + signal.SIGHUP
    # Read from the file as the app left it (a tuichat opening it would mend a reply left streaming).
    assert term.messages() == [("user", "hello", "done"), ("assistant", "", "stopped")]
