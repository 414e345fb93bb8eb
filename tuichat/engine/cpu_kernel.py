"""tuichat's CPU kernels: the bf16 linear (amx_linear.c with AMX, vector_linear.c elsewhere) and the decoder
layers built on it (decoder.c, driven by native.py). Compiled on first use, on the machine that runs them
(-march=native), into a private (0700) folder of the user cache dir, with the library's sha256 beside it,
and loaded with ctypes only if it is still those bytes, ours, and writable by no one else; else rebuilt.

Why kernels of our own: a decode step is bound by reading the weights once, and for a few rows torch's CPU
kernels (bf16 gemv, oneDNN's brgemm) read them at well under the memory's bandwidth, where ours, prefetching
the next weight rows while the tiles multiply, come close to it (README: `scripts/matmul_bench.py`); and the
rest of a step through transformers' modules is some 1,600 small torch ops. Only the C compiler is needed, no torch headers: building takes a few seconds, once.
Without a compiler, or with TUICHAT_CPU_KERNELS=0, the engine keeps transformers' layers and torch's
kernels; TUICHAT_CPU_ARCH=haswell (any -march value) builds for another instruction set.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from tuichat.engine.storage import cache_dir

MAX_ROWS = 512  # the CPU token budget: every step of the default scheduler fits
_SOURCES = [Path(__file__).with_name(name)
            for name in ("scratch.c", "amx_linear.c", "vector_linear.c", "decoder.c", "sampler.c")]
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
        self.library = library  # keeps the .so mapped; native.py finds decoder_step in it
        library.kernel_isa.restype = ctypes.c_char_p
        self.isa: str = library.kernel_isa().decode()
        self._fn = library.cpu_linear
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_long] * 2 + [ctypes.c_int]
        library.quant_math.restype = ctypes.c_char_p
        library.quant_math.argtypes = [ctypes.c_int, ctypes.c_int]
        library.pack_layout.restype = ctypes.c_char_p
        library.pack_layout.argtypes = [ctypes.c_int, ctypes.c_int]
        library.pack_blocks.restype = ctypes.c_int
        library.pack_blocks.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        self._draw = library.sample_row
        self._draw.restype = ctypes.c_int
        self._draw.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_float] * 4 + [
            ctypes.c_int, ctypes.c_double]
        self._any = library.any_linear
        self._any.restype = ctypes.c_int
        self._any.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 3 + [
            ctypes.c_long] * 2 + [ctypes.c_int] * 2
        library.kernel_abi.restype = ctypes.c_char_p
        self.abi: str = library.kernel_abi().decode()  # decoder.c's structs, for native.py to check against its own
        library.kernels_trim.restype = ctypes.c_long
        library.kernels_scratch_bytes.restype = ctypes.c_long

    def trim(self) -> int:
        """Free the scratch memory no call holds (scratch.c); the bytes freed. The next call allocates again."""
        return self.library.kernels_trim()

    @property
    def scratch_bytes(self) -> int:
        """Bytes of scratch the library keeps for its next calls."""
        return self.library.kernels_scratch_bytes()

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

    def quant_math(self, format: int, in_features: int) -> str:
        """How the kernels compute a GGUF format: "int8 VNNI" and the like (inputs quantized per block of 32, as
        llama.cpp does) or "fp32" (the weights dequantized in registers, the inputs as they are)."""
        return self.library.quant_math(format, in_features).decode()

    def layout(self, format: int, in_features: int) -> str:
        """How pack() lays out `format` with `in_features` inputs: "tiles", "pairs" or "rows"."""
        return self.library.pack_layout(format, in_features).decode()

    def pack(self, blocks, format: int, in_features: int) -> torch.Tensor:
        """GGUF blocks (a C-contiguous uint8 array [N, K / 32 * block bytes]) in the order the kernels read them."""
        out = torch.empty(blocks.shape, dtype=torch.uint8)
        if self.library.pack_blocks(blocks.ctypes.data, format, blocks.shape[0], in_features, out.data_ptr()) != 0:
            raise ValueError(f"the CPU kernels do not take format {format} with {in_features} inputs")
        return out

    def draw(self, row, params, u: float, reply: list[int] | None = None) -> int:
        """The token sampler.py's numpy path draws from `row` (a float32 numpy row of logits) with `params`
        and uniform `u`; `reply`: the reply's token ids so far, for params' penalties."""
        row = np.ascontiguousarray(row, dtype=np.float32)
        ids = np.asarray(reply if reply is not None else [], dtype=np.int64)
        token = self._draw(row.ctypes.data, row.shape[0], ids.ctypes.data, len(ids), params.frequency_penalty,
                           params.presence_penalty, params.temperature, params.top_p, params.top_k, u)
        if token < 0:
            raise MemoryError("sample_row could not allocate its scratch")
        return token

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] with at most MAX_ROWS rows times a quant.PackedWeight (bf16 or GGUF blocks): bf16 in, bf16
        out, or float32 in, float32 out (the quantized path's activations; see decoder.c)."""
        if x.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"the CPU linear takes bf16 or float32 inputs, not {x.dtype}")
        rows = x.reshape(-1, weight.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        y = torch.empty(rows.shape[0], weight.out_features, dtype=x.dtype)
        status = self._any(
            rows.data_ptr(), weight.data.data_ptr(), weight.format, bias.data_ptr() if bias is not None else None,
            y.data_ptr(), rows.shape[0], weight.out_features, weight.in_features, rows.stride(0), weight.out_features,
            torch.get_num_threads(), int(x.dtype is torch.float32),
        )
        if status != 0:
            raise RuntimeError(f"any_linear failed ({status}) for {tuple(rows.shape)} x {weight.format}")
        return y.view(*x.shape[:-1], weight.out_features)

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


BUILD_TIMEOUT_S = 600  # a compiler that hangs (a wedged ccache, a full disk's retries) must not hang the load


def _compiler() -> str | None:
    """The C compiler's path: $CC where set (a name on PATH or a path), else gcc or cc; None if there is none."""
    if named := os.environ.get("CC"):
        return shutil.which(named)
    return shutil.which("gcc") or shutil.which("cc")


def _no_compiler() -> str:
    """Why _compiler() found none."""
    if named := os.environ.get("CC"):
        return f"$CC is {named!r}, which is not an executable"
    return "no C compiler to build tuichat's kernels"


def _why(stderr: str) -> str:
    """What a failed compile says: its error lines (a few), else its last lines."""
    lines = [l for l in stderr.strip().splitlines() if l.strip()]
    errors = [l for l in lines if "error" in l.lower()]
    return " | ".join((errors or lines)[:4] if errors else lines[-4:]) or "the compiler failed without a message"


@functools.cache  # a compiler run and the sources' text: once per process, not per lookup
def _build_key(compiler: str, flags: tuple[str, ...]) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S).stdout
    # -march=native means this CPU: a cache dir shared by two machines must not share the build.
    cpu = " ".join(sorted(cpu_flags()))
    key = hashlib.sha256("\0".join([*(f.read_text() for f in _SOURCES + _HEADERS), version, cpu, *flags]).encode())
    return key.hexdigest()[:16]


def _library_path(compiler: str, flags: list[str]) -> Path:
    return cache_dir() / "kernels" / _build_key(compiler, tuple(flags)) / "cpu_kernels.so"


def _digest_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _sha256(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _trusted(library: Path) -> bool:
    """Whether `library` is the one we built: loading it runs its code in this process, so it, its folder
    and the kernels folder must be ours and writable by no one else, and its bytes those we recorded."""
    try:
        for path in (library.parent.parent, library.parent, library):
            info = path.lstat()
            if info.st_uid != os.getuid() or info.st_mode & 0o022 or stat.S_ISLNK(info.st_mode):
                return False
        return _digest_path(library).read_text().strip() == _sha256(library)
    except OSError:  # not built yet, or half removed
        return False


def _build(compiler: str, flags: list[str]) -> Path:
    target = _library_path(compiler, flags)
    if _trusted(target):
        return target
    root = target.parent.parent
    root.mkdir(mode=0o700, exist_ok=True)
    root.chmod(0o700)  # private whatever the umask (or an older tuichat) made it
    # Built in a folder of its own (mkdtemp: 0700), then swapped in whole: two processes may build at once,
    # and a half-written or untrusted folder is never loaded from.
    built = Path(tempfile.mkdtemp(dir=root))
    try:
        library = built / target.name
        try:
            result = subprocess.run([compiler, *flags, *map(str, _SOURCES), "-o", str(library)], capture_output=True,
                                    text=True, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{compiler} took over {BUILD_TIMEOUT_S} s") from None
        if result.returncode != 0:
            raise RuntimeError(_why(result.stderr))
        library.chmod(0o700)
        _digest_path(library).write_text(_sha256(library) + "\n")
        _digest_path(library).chmod(0o600)
        if os.path.lexists(target.parent):  # stale or untrusted: out of the way first (renaming needs only root)
            stale = built.with_name(built.name + ".stale")
            os.replace(target.parent, stale)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(built, target.parent)
        except OSError:  # another process swapped its build in meanwhile: use that one if it checks out
            if not _trusted(target):
                raise
    finally:
        shutil.rmtree(built, ignore_errors=True)
    return target


def _switched_off() -> bool:
    return os.environ.get("TUICHAT_CPU_KERNELS", "1").lower() in ("0", "off", "false", "no")


def _flags() -> list[str]:
    return [*_FLAGS, f"-march={os.environ.get('TUICHAT_CPU_ARCH', 'native')}"]


def available() -> bool:
    """Whether the kernels are built and loaded (building them first if need be): what decides the dtype, so
    a build that fails leaves the model in the dtype torch's own kernels run best."""
    return load()[0] is not None


def build_pending() -> bool:
    """Whether load() will compile first (several seconds, once per machine and version): show progress."""
    compiler = _compiler()
    if load.cache_info().currsize or _switched_off() or compiler is None:
        return False
    try:
        return not _trusted(_library_path(compiler, _flags()))
    except (OSError, subprocess.SubprocessError):  # the compiler would not even say its version: load() says why
        return False


@functools.cache
def load() -> tuple[CpuKernels | None, str]:
    """(the kernels or None, a few words on why) — built at most once per process."""
    if _switched_off():
        return None, "off (TUICHAT_CPU_KERNELS)"
    compiler = _compiler()
    if compiler is None:
        return None, f"torch ({_no_compiler()})"
    flags = _flags()
    try:
        library = ctypes.CDLL(str(_build(compiler, flags)))
        if library.amx_enable() != 0:  # the CPU has AMX but the kernel won't hand it to this process
            library = ctypes.CDLL(str(_build(compiler, flags + _NO_AMX)))
        kernels = CpuKernels(library)
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:  # AttributeError: a missing export
        return None, f"torch (kernel build failed: {exc})"
    return kernels, kernels.isa
