"""Which running tuichat owns a conversation, so that two of them on one data dir never interleave their turns
in the same one.

Decision: a lock per *open conversation*, not per instance. A tab holds an exclusive `flock` on
`<data dir>/locks/<conversation id>.lock` from when it opens until it closes; the kernel drops it when the
process ends, however it ends (a crash or `kill -9` leaves no stale lock, so there is no pid to check or to
clean up). A second tuichat stays fully usable: it restores only the open tabs nobody holds and says which
ones stay in which other process; its new tabs are its own; opening a conversation another instance holds
(from search) is refused with that process named, and works as soon as that instance closes the tab or
quits. Read-only viewing was left out: the view would go stale while the owner writes on.

`flock`, not `fcntl`/`lockf` record locks: record locks belong to the process, and closing any descriptor of
the file drops them all; a flock belongs to its open file description, so two holders conflict even in one
process. The holder writes "pid host" into the file for the other's message. The file is removed on
release, while still locked; a claimer that opened it just before checks after locking that the path still
names the file it locked. Without flock (Windows), claim() raises OSError: the app then runs unguarded and
says so.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from tuichat import paths

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None


@dataclass(frozen=True)
class Owner:
    """The other process holding a conversation, as it wrote itself into the lock file."""

    pid: int | None  # None when the file could not be read back (the owner had not written it yet)
    host: str = ""

    def __str__(self) -> str:
        if self.pid is None:
            return "another tuichat"
        here = not self.host or self.host == socket.gethostname()
        return f"tuichat process {self.pid}" + ("" if here else f" on {self.host}")


def _read_owner(fd: int) -> Owner:
    pid, _, host = os.pread(fd, 256, 0).decode(errors="replace").strip().partition(" ")
    return Owner(int(pid), host) if pid.isdigit() else Owner(None)


class ConversationLocks:
    """The conversations this instance holds, as lock files in `folder`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._held: dict[str, int] = {}  # conversation id -> the locked descriptor

    def _path(self, conversation_id: str) -> Path:
        return self.folder / f"{conversation_id}.lock"

    def claim(self, conversation_id: str) -> Owner | None:
        """Hold `conversation_id` for this instance: None when it is ours (now or already), else who holds it.
        OSError when the folder cannot be used or the file system has no locks."""
        if conversation_id in self._held:
            return None
        if fcntl is None:
            raise OSError("this system has no flock")
        paths.private_dir(self.folder)
        path = self._path(conversation_id)
        while True:
            fd = paths.open_private(path, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read_owner(fd)
                os.close(fd)
                return owner
            except BaseException:
                os.close(fd)
                raise
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # the holder removed this file between our open and our lock: take the path's new one
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self._held[conversation_id] = fd
        return None

    def release(self, conversation_id: str) -> None:
        fd = self._held.pop(conversation_id, None)
        if fd is None:
            return
        try:
            self._path(conversation_id).unlink(missing_ok=True)  # before unlocking, so nobody locks a dying file
        finally:
            os.close(fd)

    def release_all(self) -> None:
        for conversation_id in list(self._held):
            self.release(conversation_id)
