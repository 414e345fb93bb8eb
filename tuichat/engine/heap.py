"""The garbage collector, the C heap and the long-lived objects of a loaded model (no torch here: the bench
imports it)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import mmap
from pathlib import Path

import numpy as np


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None (another libc: musl, macOS)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None).malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the system. A model's load and unload free gigabytes of transient
    buffers (conversion, packing, the old model's weights), much of it in the malloc arenas of threads that have
    since ended; glibc keeps such pages for reuse, so without this the process's RSS climbed with every model
    switch while the memory in use stayed the same."""
    if (trim := _malloc_trim()) is not None:
        trim(0)


def process_memory(pid: int | str = "self") -> tuple[int, int]:
    """(resident bytes now, the most resident so far) of a process, this one by default: Linux's VmRSS and VmHWM.
    Pages of a mapped GGUF that were read count, as they do in llama.cpp's RSS. Where /proc does not tell: for
    this process getrusage's peak for both, for another OSError."""
    try:
        with open(f"/proc/{pid}/status") as status:
            fields = dict(line.split(":", 1) for line in status if line.startswith(("VmRSS", "VmHWM")))
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        if pid != "self":
            raise OSError(f"no memory figures for process {pid}") from None
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return peak, peak


@contextlib.contextmanager
def collector_paused():
    """The cyclic collector off while a model loads; the outermost pause settles the heap as it ends (on error
    too) and gives the collector back as it was. A load makes hundreds of thousands of objects that live as
    long as the model (the vocabulary's, transformers' modules, torch's imports); each allocation burst set off
    full collections that walked all of them again, much of a GGUF's load. Settled before the collector is
    back, because its first collection would otherwise walk everything made while it was off."""
    if not gc.isenabled():  # a caller's pause, which settles as it ends
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        try:
            settle_heap()
        finally:
            gc.enable()


def settle_heap() -> None:
    """After a model comes or goes. The model's, torch's and transformers' objects live as long as the
    model; left in the collector's care, every full collection walks them all with the GIL held, a few times
    in a long reply, each a stall of the engine and the screen of hundreds of milliseconds. Frozen, they are
    not walked. Unfrozen first, so that what a model left behind in reference cycles is collected."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    release_free_memory()


HUGE_PAGE = 2 << 20


@functools.cache
def huge_pages() -> bool:
    """Whether anonymous memory madvised MADV_HUGEPAGE gets 2 MB pages here: Linux with transparent huge pages
    not set to "never"."""
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode and hasattr(mmap, "MADV_HUGEPAGE")


class WeightArena:
    """Memory for the weight copies a step streams (tiles, re-cut blocks, reordered rows), in 2 MB pages where
    huge_pages() says so. A step reads every byte of its weights once; malloc's memory comes in 4 KB pages here
    (the THP mode is usually "madvise"), a TLB miss every 4 KB.

    Memory comes in chunks of anonymous maps, each aligned to 2 MB; a chunk is unmapped when the last array cut
    from it goes (the arrays keep their chunk alive)."""

    CHUNK = 64 << 20
    ALIGN = 64  # a cache line: the kernels' vector loads

    def __init__(self) -> None:
        self._chunk: np.ndarray | None = None
        self._used = 0

    def array(self, shape: tuple[int, ...], dtype=np.uint8) -> np.ndarray:
        """An uninitialised C-contiguous array, ALIGN-aligned."""
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if self._chunk is None or self._used + nbytes > len(self._chunk):
            self._chunk, self._used = self._map(max(self.CHUNK, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)), 0
        out = self._chunk[self._used:self._used + nbytes].view(dtype).reshape(shape)
        self._used += -(-nbytes // self.ALIGN) * self.ALIGN
        return out

    def copy(self, values: np.ndarray) -> np.ndarray:
        out = self.array(values.shape, values.dtype)
        np.copyto(out, values)
        return out

    @staticmethod
    def _map(size: int) -> np.ndarray:
        # 2 MB more than asked, so that an aligned range of `size` lies inside; the rest is never touched, so
        # never resident.
        chunk = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = np.frombuffer(chunk, dtype=np.uint8)
        skip = -whole.ctypes.data % HUGE_PAGE
        if huge_pages():
            chunk.madvise(mmap.MADV_HUGEPAGE, skip, size)
        return whole[skip:skip + size]
