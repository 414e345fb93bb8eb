"""The AMX matmul for decode steps and short prefills (amx_linear.c), and the decoder layers built on it
(decoder.c, driven by native.py): compiled on first use into the user cache dir, loaded with ctypes.

Why a kernel of our own: a decode step is bound by reading the weights once, and for a few rows torch's CPU
kernels (bf16 gemv, oneDNN's brgemm) read them at 9–13 GB/s on a 2-core Sapphire Rapids, where this one,
prefetching the next weight rows while AMX multiplies the current ones, reads at ~21 GB/s (all of
SmolLM2-135M's linears: 12 ms at 8 rows against torch's 25; 23 against 40 at 48 rows). Only the C compiler
is needed, no torch headers, so building takes under a second. Without AMX, a compiler, or with
TUICHAT_CPU_KERNELS=0, the engine keeps torch's kernels.
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
_SOURCES = [Path(__file__).with_name(name) for name in ("amx_linear.c", "decoder.c")]
_HEADERS = [Path(__file__).with_name("amx_common.h")]
_FLAGS = ["-O3", "-fno-math-errno", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16",
          "-mamx-tile", "-mamx-bf16"]


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((l for l in text.splitlines() if l.startswith("flags")), "")
    return set(line.partition(":")[2].split())


class AmxLinear:
    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library  # keeps the .so mapped; native.py finds decoder_forward in it
        self._fn = library.amx_linear
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
            raise RuntimeError(f"amx_linear failed ({status}) for {tuple(rows.shape)} x {tuple(weight.shape)}")
        return y.view(*x.shape[:-1], out_features)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([*(f.read_text() for f in _SOURCES + _HEADERS), version, *_FLAGS]).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / key / "cpu_kernels.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # atomic: two processes may build at once
            built = Path(tmp) / target.name
            result = subprocess.run([compiler, *_FLAGS, *map(str, _SOURCES), "-o", str(built)], capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "compiler failed")
            os.replace(built, target)
    return target


@functools.cache
def load() -> tuple[AmxLinear | None, str]:
    """(the kernel or None, a few words on why) — built at most once per process."""
    if os.environ.get("TUICHAT_CPU_KERNELS", "1").lower() in ("0", "off", "false", "no"):
        return None, "off (TUICHAT_CPU_KERNELS)"
    if not {"amx_bf16", "amx_tile", "avx512_bf16"} <= cpu_flags():
        return None, "torch (no AMX on this CPU)"
    compiler = _compiler()
    if compiler is None:
        return None, "torch (no C compiler to build the AMX kernel)"
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError) as exc:
        return None, f"torch (AMX kernel build failed: {exc})"
    if library.amx_enable() != 0:
        return None, "torch (the kernel refused AMX to this process)"
    return AmxLinear(library), "amx"
