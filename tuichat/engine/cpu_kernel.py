"""tuichat's CPU kernels: the bf16 linear (amx_linear.c with AMX, vector_linear.c elsewhere) and the decoder
layers built on it (decoder.c, driven by native.py). Compiled on first use, on the machine that runs them
(-march=native), into the user cache dir, and loaded with ctypes.

Why kernels of our own: a decode step is bound by reading the weights once, and for a few rows torch's CPU
kernels (bf16 gemv, oneDNN's brgemm) read them at 9–13 GB/s on a 2-core Sapphire Rapids, where the AMX one,
prefetching the next weight rows while the tiles multiply, reads at ~21 GB/s (all of SmolLM2-135M's
linears: 12 ms at 8 rows against torch's 25); and the rest of a step through transformers' modules is some
1,600 small torch ops. Only the C compiler is needed, no torch headers: building takes a few seconds, once.
Without a compiler, or with TUICHAT_CPU_KERNELS=0, the engine keeps transformers' layers and torch's
kernels; TUICHAT_CPU_ARCH=haswell (any -march value) builds for another instruction set.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from tuichat.paths import cache_dir

MAX_ROWS = 512  # the CPU token budget: every step of the default scheduler fits
_SOURCES = [Path(__file__).with_name(name) for name in ("amx_linear.c", "vector_linear.c", "decoder.c")]
_HEADERS = [Path(__file__).with_name("kernels.h")]
_FLAGS = ["-O3", "-fno-math-errno", "-shared", "-fPIC", "-fopenmp"]
_NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((l for l in text.splitlines() if l.startswith("flags")), "")
    return set(line.partition(":")[2].split())


class CpuKernels:
    """The built library: `isa` says which instructions its linear uses ("amx", "avx512", "avx2", ...);
    calling it runs the linear."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library  # keeps the .so mapped; native.py finds decoder_forward in it
        library.kernel_isa.restype = ctypes.c_char_p
        self.isa: str = library.kernel_isa().decode()
        self._fn = library.cpu_linear
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_long] * 2 + [ctypes.c_int]

    @staticmethod
    def fits(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether a linear's parameters suit the kernel (checked once per layer, not per call)."""
        out_features, in_features = weight.shape
        return (
            weight.device.type == "cpu"
            and weight.dtype is torch.bfloat16
            and weight.is_contiguous()
            and in_features % 32 == 0
            and out_features % 16 == 0
            and (bias is None or (bias.dtype is torch.bfloat16 and bias.is_contiguous()))
        )

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] with at most MAX_ROWS rows, bf16; weight passed `fits`."""
        out_features, in_features = weight.shape
        rows = x.reshape(-1, in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        y = torch.empty(rows.shape[0], out_features, dtype=torch.bfloat16)
        status = self._fn(
            rows.data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else None, y.data_ptr(),
            rows.shape[0], out_features, in_features, rows.stride(0), out_features, torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"cpu_linear failed ({status}) for {tuple(rows.shape)} x {tuple(weight.shape)}")
        return y.view(*x.shape[:-1], out_features)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


@functools.cache  # a compiler run and the sources' text: once per process, not per lookup
def _build_key(compiler: str, flags: tuple[str, ...]) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    # -march=native means this CPU: a cache dir shared by two machines must not share the build.
    cpu = " ".join(sorted(cpu_flags()))
    key = hashlib.sha256("\0".join([*(f.read_text() for f in _SOURCES + _HEADERS), version, cpu, *flags]).encode())
    return key.hexdigest()[:16]


def _library_path(compiler: str, flags: list[str]) -> Path:
    return cache_dir() / "kernels" / _build_key(compiler, tuple(flags)) / "cpu_kernels.so"


def _build(compiler: str, flags: list[str]) -> Path:
    target = _library_path(compiler, flags)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # atomic: two processes may build at once
            built = Path(tmp) / target.name
            result = subprocess.run([compiler, *flags, *map(str, _SOURCES), "-o", str(built)], capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "compiler failed")
            os.replace(built, target)
    return target


def _switched_off() -> bool:
    return os.environ.get("TUICHAT_CPU_KERNELS", "1").lower() in ("0", "off", "false", "no")


def _flags() -> list[str]:
    return [*_FLAGS, f"-march={os.environ.get('TUICHAT_CPU_ARCH', 'native')}"]


def build_pending() -> bool:
    """Whether load() will compile first (several seconds, once per machine and version): show progress."""
    compiler = _compiler()
    if load.cache_info().currsize or _switched_off() or compiler is None:
        return False
    return not _library_path(compiler, _flags()).exists()


@functools.cache
def load() -> tuple[CpuKernels | None, str]:
    """(the kernels or None, a few words on why) — built at most once per process."""
    if _switched_off():
        return None, "off (TUICHAT_CPU_KERNELS)"
    compiler = _compiler()
    if compiler is None:
        return None, "torch (no C compiler to build tuichat's kernels)"
    flags = _flags()
    try:
        library = ctypes.CDLL(str(_build(compiler, flags)))
        if library.amx_enable() != 0:  # the CPU has AMX but the kernel won't hand it to this process
            library = ctypes.CDLL(str(_build(compiler, flags + _NO_AMX)))
    except (OSError, RuntimeError) as exc:
        return None, f"torch (kernel build failed: {exc})"
    kernels = CpuKernels(library)
    return kernels, kernels.isa
