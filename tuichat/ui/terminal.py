"""The terminal under the app: Textual's Linux driver, made to end with its terminal.

When the terminal goes away (its window closed, its tmux session killed), Textual's driver keeps the process
alive: its input thread reads EOF and spins; the SIGCONT the kernel sends along with the SIGHUP makes it start
application mode again on the dead terminal, with a second input thread and a new writer thread; that writer
dies of its first failed write, and the app's later writes block for good on the dead thread's full queue. The
event loop then freezes: no signal handler runs again, and the process keeps its history open and its
conversations locked. Here, output to a gone terminal goes nowhere, EOF or an error reading it ends the app as
a hangup does, and a hangup's SIGCONT resumes nothing.

Input is decoded leniently too: Textual's strict UTF-8 decoder lets one invalid byte (a paste from a Latin-1
terminal, line noise) end its input thread and the app with it, the unsent prompt too (Textual issue 6456);
replacing such bytes with U+FFFD, as Textual's proposed fix does, keeps both.
"""

from __future__ import annotations

import codecs
import os
import selectors
import signal
from typing import TextIO

from textual._xterm_parser import XTermParser
from textual.drivers.linux_driver import LinuxDriver
from textual.message import Message


class _Output:
    """The driver's output file, as its writer thread sees it: output that cannot be written is dropped."""

    def __init__(self, file: TextIO) -> None:
        self._file = file

    def write(self, text: str) -> None:
        try:
            self._file.write(text)
        except OSError:
            pass

    def flush(self) -> None:
        try:
            self._file.flush()
        except OSError:
            pass

    def fileno(self) -> int:
        return self._file.fileno()


class TerminalDriver(LinuxDriver):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._file = _Output(self._file)
        self._input_ended = False

    def end_input(self) -> None:
        """The app is ending: input from now on goes nowhere. Only sets a flag, so a signal handler may call it."""
        self._input_ended = True

    def _sigcont_application(self, *args) -> None:
        # After a hangup the terminal answers no ioctl: there is nothing to resume on.
        if os.isatty(self.fileno):
            super()._sigcont_application(*args)

    def run_input_thread(self) -> None:
        parser = XTermParser(self._debug)
        decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        with selectors.SelectSelector() as selector:  # as Textual's: macOS's kqueue has not always taken ttys
            selector.register(self.fileno, selectors.EVENT_READ)
            while not (self.exit_event.is_set() or self._input_ended):
                if selector.select(0.1):
                    try:
                        data = os.read(self.fileno, 4096)
                    except OSError:  # EIO
                        data = b""
                    if not data:
                        # The terminal is gone (or the input ended): a hangup, also when the kernel's SIGHUP
                        # went to another process (a shell in between) or to none (not our controlling tty).
                        os.kill(os.getpid(), signal.SIGHUP)
                        return
                    for event in parser.feed(decode(data)):
                        self.process_message(event)
                for event in parser.tick():
                    self.process_message(event)

    def send_message(self, message: Message) -> None:
        # A callback where Textual's makes a task, and one that drops the message once the app is ending: a
        # flood of keys leaves thousands in the loop's queue.
        self._loop.call_soon_threadsafe(self._deliver, message)

    def _deliver(self, message: Message) -> None:
        if not self._input_ended:
            self._app.post_message(message)
