"""The build of tuichat's CPU kernels (csrc/, see this package's docstring): compiled on first use, on the
machine that runs them (-march=native), into a private (0700) folder of the user cache dir, with the library's
sha256 beside it, and loaded with ctypes only if it is still those bytes, ours, and writable by no one else;
else rebuilt. The build's key covers every source and header, the compiler's version, the CPU's flags and the
compiler flags: a change to any of them is a new build.

Only the C compiler is needed, no torch headers: building takes a few seconds, once (docs/design/kernels.md).
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
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from tuichat.engine.cpu.native import CpuKernels
from tuichat.engine.storage import cache_dir

CSRC = Path(__file__).with_name("csrc")  # every .c under it is compiled into the one library
_SOURCES = sorted(CSRC.rglob("*.c"))
_HEADERS = sorted(CSRC.rglob("*.h"))
_FLAGS = ["-O3", "-fno-math-errno", "-shared", "-fPIC", "-fopenmp"]
_NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((l for l in text.splitlines() if l.startswith("flags")), "")
    return set(line.partition(":")[2].split())


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
    sources = (f"{path.relative_to(CSRC)}\0{path.read_text()}" for path in _SOURCES + _HEADERS)
    key = hashlib.sha256("\0".join([*sources, version, cpu, *flags]).encode())
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
        _compile(compiler, flags, built, library)
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


def _compile(compiler: str, flags: list[str], built: Path, library: Path) -> None:
    """Each source to an object, as many at once as there are cores (the largest first), then one link: one
    compiler call for all of them used one core, and decoder.c alone is half the work."""
    deadline = time.monotonic() + BUILD_TIMEOUT_S

    def run(args: list[str]) -> subprocess.CompletedProcess:
        left = deadline - time.monotonic()
        if left <= 0:
            raise subprocess.TimeoutExpired(args, BUILD_TIMEOUT_S)
        return subprocess.run(args, capture_output=True, text=True, timeout=left)

    objects = {source: built / f"{i}.o" for i, source in enumerate(_SOURCES)}
    compile_flags = [flag for flag in flags if flag != "-shared"]
    jobs = [[compiler, *compile_flags, "-c", str(source), "-o", str(obj)]
            for source, obj in sorted(objects.items(), key=lambda item: -item[0].stat().st_size)]
    try:
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            futures = [pool.submit(run, job) for job in jobs]
            for future in as_completed(futures):
                result = future.result()
                if result.returncode != 0:
                    for other in futures:
                        other.cancel()
                    raise RuntimeError(_why(result.stderr))
        result = run([compiler, *flags, *map(str, objects.values()), "-o", str(library)])
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{compiler} took over {BUILD_TIMEOUT_S} s") from None
    if result.returncode != 0:
        raise RuntimeError(_why(result.stderr))
    for obj in objects.values():  # linked in: the cache keeps only the library
        obj.unlink()


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
