"""The garbage collector, the C heap and the long-lived objects of a loaded model (no torch here: the bench
imports it)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc


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


def settle_heap() -> None:
    """After a model comes or goes. The model's, torch's and transformers' objects live as long as the
    model; left in the collector's care, every full collection walks them all with the GIL held, a few times
    in a long reply, each a stall of the engine and the screen of hundreds of milliseconds. Frozen, they are
    not walked. Unfrozen first, so that what a model left behind in reference cycles is collected."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    release_free_memory()
