"""A GGUF file opened in place: its metadata and tensor table read once, its tensors as views of one read-only
memory map, and the model's config and tokenizer made from the metadata (the tokenizer cached by the metadata's
hash, so that a later load reads a few MB of JSON rather than the vocabulary's arrays).

Why not gguf's GGUFReader: it builds numpy views for every string of the vocabulary and its merges, several
seconds for a 128k-token Llama 3 vocabulary here, before a weight is read. This reader walks the same header
with `struct` and keeps strings as Python strings. transformers' own GGUF config and tokenizer conversion run
over it (`as_gguf_reader`), so that they stay transformers' for every family it knows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import mmap
import os
import re
import shutil
import struct
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from tuichat.engine.types import TuichatError

_NUMERIC = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRUCT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
HUGE_PAGE = 2 << 20


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # rows first (numpy's order; the file lists the dims the other way round)
    type: int  # ggml's type number
    offset: int  # from the start of the file
    nbytes: int
    part: int = 0  # which file of a split model holds it (0: the first, or the only one)


_HEADERS: dict[tuple[str, int, int], tuple] = {}  # the last two headers read, by path, size and mtime
SPLIT_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")  # llama.cpp's gguf-split parts: NAME-00001-of-00003.gguf


class GGUFFile:
    """The header of `path` (fields: {key: value}, tensors: {name: TensorInfo}) and, on demand, its tensors as
    views of a read-only map of the file (`array`). Raises TuichatError for a file that is not GGUF or is cut
    short, naming the bytes it lacks."""

    def __init__(self, path: str | Path, summary: bool = False, part: bool = False) -> None:
        """`summary`: an array of strings (a vocabulary) is read as its length only, not kept (listing stores of
        models: most of a header's bytes, and most of its parse, are its tokens). A model split into several
        files (llama.cpp's gguf-split) is opened by its first, and read as one file; `part`: one of its files
        alone (the first reads the others so)."""
        self.path = Path(path)
        self._summary = summary
        self.paths = [self.path]  # the files it reads: several for a split model
        self.fields: dict[str, object] = {}
        self.types: dict[str, tuple[int, ...]] = {}  # each field's GGUF value type (arrays: 9 and the item type)
        try:
            with open(self.path, "rb") as file:
                self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
                stat = os.fstat(file.fileno())
        except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
            raise TuichatError(f"Could not read {self.path}: {exc}") from None
        # A load opens its file a few times (its family, whether it is served in place, the load itself): the
        # header (a third of a second for a 128k-token vocabulary) is read once per path, size and mtime.
        key = (os.path.realpath(self.path), stat.st_size, stat.st_mtime_ns)
        self._maps = [self._map]
        if not summary and hasattr(mmap, "MADV_HUGEPAGE"):
            # A step streams every weight read in place: faults then bring the file in as 2 MB folios mapped whole,
            # where the kernel and the filesystem have them, not as 4 KB pages that each cost a TLB miss.
            with contextlib.suppress(OSError):
                self._map.madvise(mmap.MADV_HUGEPAGE)
        if key in _HEADERS and not summary:
            self.fields, self.types, self.tensors, self.data_offset, self.header_bytes = _HEADERS[key]
        else:
            self._parse()
            if not summary:
                _HEADERS[key] = self.fields, self.types, self.tensors, self.data_offset, self.header_bytes
                while len(_HEADERS) > 2:
                    del _HEADERS[next(iter(_HEADERS))]
        if not part:
            self._join_parts()

    def _join_parts(self) -> None:
        """The other files of a split model, beside the first: their tensors join its table (each knows its file)."""
        count, number = int(self.fields.get("split.count", 1) or 1), int(self.fields.get("split.no", 0) or 0)
        if count <= 1:
            return
        named = SPLIT_NAME.search(self.path.name)
        if number != 0 or named is None:
            first = SPLIT_NAME.sub(f"-00001-of-{count:05d}.gguf", self.path.name) if named else "its first file"
            self.close()
            raise TuichatError(f"{self.path} is file {number + 1} of a model split into {count}: open the first, {first}.")
        tensors = dict(self.tensors)
        for i in range(1, count):
            path = self.path.with_name(SPLIT_NAME.sub(f"-{i + 1:05d}-of-{count:05d}.gguf", self.path.name))
            try:
                if not path.is_file():
                    raise TuichatError(f"{self.path.name} is the first of {count} files; file {i + 1}, {path.name}, "
                                       f"is not beside it.")
                other = GGUFFile(path, self._summary, part=True)
                self._maps.append(other._map)
                if int(other.fields.get("split.no", -1)) != i:
                    raise TuichatError(f"{path} says it is not file {i + 1} of {self.path.name}'s model.")
            except TuichatError:
                self.close()
                raise
            self.paths.append(path)
            tensors.update({name: dataclasses.replace(info, part=i) for name, info in other.tensors.items()})
        want = self.fields.get("split.tensors.count")
        if want is not None and int(want) != len(tensors):
            self.close()
            raise TuichatError(f"{self.path.name}'s {count} files hold {len(tensors)} tensors; the first says {want}.")
        self.tensors = tensors

    def _parse(self) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        buf = self._map
        size = len(buf)
        try:
            magic, version, n_tensors, n_fields = struct.unpack_from("<4sIQQ", buf, 0)
            if magic != b"GGUF" or version not in (2, 3):
                raise ValueError(f"magic {magic!r}, version {version}")
            self._at = 24
            for _ in range(n_fields):
                key = self._string()
                (kind,) = self._unpack("<I")
                self.fields[key], self.types[key] = self._value(kind)
            infos = []
            for _ in range(n_tensors):
                name = self._string()
                (dims,) = self._unpack("<I")
                shape = self._unpack(f"<{dims}Q")
                kind, offset = self._unpack("<IQ")
                infos.append((name, tuple(reversed(shape)), kind, offset))
            alignment = int(self.fields.get("general.alignment", 32))
            if alignment <= 0:
                raise ValueError(f"alignment {alignment}")
            self.data_offset = -(-self._at // alignment) * alignment
        except (struct.error, ValueError, UnicodeDecodeError, OverflowError, MemoryError) as exc:
            self.close()
            raise TuichatError(f"{self.path} is truncated or corrupt: it does not read as GGUF ({exc}).") from None
        self.header_bytes = self._at
        self.tensors: dict[str, TensorInfo] = {}
        end = self.data_offset
        for name, shape, kind, offset in infos:
            try:
                block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                self.close()
                raise TuichatError(f"{self.path} holds tensor {name} in ggml type {kind}, which gguf {_gguf_version()} "
                                   "does not know: a newer file format than this tuichat reads.") from None
            count = int(np.prod(shape, dtype=np.int64))
            nbytes = count // block * block_bytes
            self.tensors[name] = TensorInfo(name, shape, kind, self.data_offset + offset, nbytes)
            end = max(end, self.data_offset + offset + nbytes)
        if end > size:
            self.close()
            raise TuichatError(f"{self.path} is truncated or corrupt: its tensors need {end:,} bytes, the file has "
                               f"{size:,}. Download or copy it again.")

    # -- the header's grammar --------------------------------------------------------------------------------
    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._map, self._at)
        self._at += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = struct.unpack_from("<Q", self._map, self._at)
        start = self._at + 8
        self._at = start + length
        if self._at > len(self._map):
            raise ValueError("a string runs past the end of the file")
        return self._map[start:self._at].decode("utf-8", errors="replace")

    def _value(self, kind: int) -> tuple[object, tuple[int, ...]]:
        if kind == _STRING:
            return self._string(), (kind,)
        if kind in _NUMERIC:
            (value,) = self._unpack("<" + _STRUCT[kind])
            return value, (kind,)
        if kind != _ARRAY:
            raise ValueError(f"unknown value type {kind}")
        item, count = self._unpack("<IQ")
        if item == _STRING and self._summary:
            for _ in range(count):
                (length,) = struct.unpack_from("<Q", self._map, self._at)
                self._at += 8 + length
            if self._at > len(self._map):
                raise ValueError("a string runs past the end of the file")
            return count, (kind, item)
        if item == _STRING:
            return [self._string() for _ in range(count)], (kind, item)
        if item not in _NUMERIC:
            raise ValueError(f"an array of value type {item}")
        dtype = np.dtype(_NUMERIC[item])
        values = np.frombuffer(self._map, dtype, count, self._at).copy()
        self._at += dtype.itemsize * count
        return values, (kind, item)

    # -- what the engine reads -------------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return str(self.fields.get("general.architecture", ""))

    def array(self, name: str) -> np.ndarray:
        """Tensor `name` as the file stores it: uint8 rows of its blocks, or F32/F16/BF16 values, a read-only view
        of the map (nothing is read until used)."""
        info = self.tensors[name]
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(info.type)]
        flat = np.frombuffer(self._maps[info.part], np.uint8, info.nbytes, info.offset)
        rows = int(np.prod(info.shape[:-1], dtype=np.int64))
        plain = {0: np.float32, 1: np.float16, 30: np.uint16}.get(info.type)  # F32, F16, BF16 (as raw bits)
        if plain is not None:
            return flat.view(plain).reshape(info.shape)
        return flat.reshape(rows, info.shape[-1] // block * block_bytes)

    def release(self, name: str) -> None:
        """Drop tensor `name`'s pages from this process's memory, for a tensor the load copied into another layout:
        its file bytes would otherwise stay resident beside the copy. The page cache keeps them, and a later read
        maps them again. Only whole pages inside the tensor go, so a neighbour read in place keeps its own."""
        info = self.tensors[name]
        start = -(-info.offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (info.offset + info.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self._maps[info.part].madvise(mmap.MADV_DONTNEED, start, end - start)

    def settle_pages(self, names: Iterable[str]) -> int:
        """Map tensors `names` (those read in place) now, and return how many bytes of the file this process maps
        in 2 MB pages. A step streams every weight read in place, and on these VMs a TLB miss every 4 KB costs a
        fifth of the bandwidth (docs/design/kernels.md). The map is advised MADV_HUGEPAGE, but the page cache may
        already hold parts of the file in small folios (read some other way before), which no advice changes:
        those 2 MB pages are then dropped (posix_fadvise DONTNEED; the kernel keeps any another process maps) and
        read again through this map, as 2 MB folios, as many as the free 2 MB blocks allow. Linux only; elsewhere,
        or where the file system gives no large folios, 0."""
        if sys.platform != "linux" or not hasattr(mmap, "MADV_HUGEPAGE"):
            return 0
        huge = 0
        for part, (path, mapped) in enumerate(zip(self.paths, self._maps)):
            view = np.frombuffer(mapped, np.uint8)
            if view.ctypes.data % HUGE_PAGE:  # a 2 MB page must start where a 2 MB of the file does
                continue
            pages = sorted({page for info in (self.tensors[name] for name in names) if info.part == part and info.nbytes
                            for page in range(info.offset // HUGE_PAGE, (info.offset + info.nbytes - 1) // HUGE_PAGE + 1)
                            if (page + 1) * HUGE_PAGE <= len(view)})
            if not pages:
                continue
            small = _small_pages(mapped, view, pages)[: _free_2mb_blocks()]
            if small:
                with contextlib.suppress(OSError):
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        for first, count in _runs(small):
                            mapped.madvise(mmap.MADV_DONTNEED, first * HUGE_PAGE, count * HUGE_PAGE)  # this process's hold
                            os.posix_fadvise(fd, first * HUGE_PAGE, count * HUGE_PAGE, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
                int(view[np.array(small, np.int64) * HUGE_PAGE].sum())
            huge += _pmd_mapped(view.ctypes.data)
        return huge

    def header_hash(self) -> str:
        """sha256 of the metadata and tensor table: what the tokenizer and config are made from."""
        return hashlib.sha256(self._map[: self.header_bytes]).hexdigest()

    def close(self) -> None:
        """Unmap the files once no view of them is left (a view still alive keeps its pages mapped)."""
        for mapped in getattr(self, "_maps", [self._map]):
            try:
                mapped.close()
            except BufferError:  # views remain: the map goes when they do
                pass


def _runs(pages: list[int]) -> Iterator[tuple[int, int]]:
    """(first, count) of each run of consecutive numbers in the sorted `pages`."""
    first = previous = pages[0]
    for page in pages[1:]:
        if page != previous + 1:
            yield first, previous + 1 - first
            first = page
        previous = page
    yield first, previous + 1 - first


def _small_pages(mapped: mmap.mmap, view: np.ndarray, pages: list[int]) -> list[int]:
    """Those of `pages` (2 MB pages of the map) that this process maps in 4 KB pages, each touched once. A fault in
    a page that the page cache holds as one 2 MB folio maps all of it; in smaller folios, only the 64 KB around the
    address. So each page's last 4 KB, mapped or not after a touch of its first byte, says which (the present bit
    of /proc/self/pagemap, which needs no privilege). This map's hold is dropped first (MADV_DONTNEED leaves the
    page cache as it is): a page read before would show whole. Where pagemap cannot be read, all of them if less
    than half is mapped in 2 MB pages, else none."""
    for first, count in _runs(pages):
        mapped.madvise(mmap.MADV_DONTNEED, first * HUGE_PAGE, count * HUGE_PAGE)
    int(view[np.array(pages, np.int64) * HUGE_PAGE].sum())
    base = view.ctypes.data
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
        try:
            return [page for page in pages
                    if not int.from_bytes(os.pread(fd, 8, (base + (page + 1) * HUGE_PAGE - mmap.PAGESIZE) // mmap.PAGESIZE * 8),
                                          "little") >> 63]
        finally:
            os.close(fd)
    except OSError:
        return pages if _pmd_mapped(base) < len(pages) * HUGE_PAGE // 2 else []


def _free_2mb_blocks() -> int:
    """How many free blocks of 2 MB the kernel has (/proc/buddyinfo, orders 9 and up): a page read again where
    there are none comes back in small folios, and reading it from the disk again at every load gains nothing."""
    try:
        lines = Path("/proc/buddyinfo").read_text().splitlines()
    except OSError:
        return sys.maxsize
    return sum(int(count) << (order - 9) for line in lines
               for order, count in enumerate(line.split()[4:]) if order >= 9 and count.isdigit())


def _pmd_mapped(address: int) -> int:
    """Bytes of the file map at `address` that this process maps in 2 MB pages (FilePmdMapped in its smaps)."""
    try:
        with open("/proc/self/smaps") as smaps:
            inside = False
            for line in smaps:
                if "-" in line.split(" ", 1)[0]:
                    inside = int(line.split("-", 1)[0], 16) == address
                elif inside and line.startswith("FilePmdMapped:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


class _Field:
    """A field as gguf's ReaderField shows it to transformers: parts indexed by `data`, and the value types."""

    def __init__(self, value, types: tuple[int, ...]) -> None:
        self.types = list(types)
        if types[0] == _STRING:
            self.parts, self.data = [value.encode()], [0]
        elif types[0] != _ARRAY:
            self.parts, self.data = [np.array([value])], [0]
        elif types[1] == _STRING:
            self.parts, self.data = [s.encode() for s in value], range(len(value))
        else:
            self.parts, self.data = value.reshape(-1, 1), range(len(value))


class _ReaderView:
    """What transformers' load_gguf_checkpoint reads of a GGUFReader (fields and tensor names), over a GGUFFile."""

    def __init__(self, file: GGUFFile, vocabulary: bool = True) -> None:
        """Without the `vocabulary`, the tokenizer's arrays are left out (a config needs only their length, which
        transformers' conversion reads as {arch}.vocab_size where the file does not say it; it would parse every
        token, twice over: a second for a 128k vocabulary)."""
        fields = dict(file.fields)
        types = dict(file.types)
        if not vocabulary:
            vocab_key = f"{file.architecture}.vocab_size"
            tokens = fields.get("tokenizer.ggml.tokens")
            if vocab_key not in fields and tokens is not None:
                fields[vocab_key], types[vocab_key] = len(tokens), (4,)  # uint32
            for key in [k for k, t in types.items() if k.startswith("tokenizer.ggml.") and t[0] == _ARRAY]:
                del fields[key]
        self.fields = {key: _Field(value, types[key]) for key, value in fields.items()}
        self.tensors = [SimpleNamespace(name=name) for name in file.tensors]


@contextmanager
def as_gguf_reader(file: GGUFFile, vocabulary: bool = True) -> Iterator[None]:
    """While inside, gguf.GGUFReader opened on `file`'s path is this reader's view (transformers opens the file
    twice, for the config and the tokenizer, each time with gguf's slow reader); `vocabulary`: see _ReaderView."""
    import gguf

    original = gguf.GGUFReader
    view = _ReaderView(file, vocabulary)
    target = os.path.realpath(file.path)

    def reader(path, *args, **kwargs):
        return view if os.path.realpath(path) == target else original(path, *args, **kwargs)

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _as_llama_cpp_reads_it(file: GGUFFile, config) -> None:
    """What transformers' GGUF mapping leaves at its config's defaults, set as llama.cpp reads the file: linear
    RoPE scaling (Gemma 3's full layers; a flat config's only kind), the sliding layers' RoPE base where the file
    gives it, and Gemma 3's attention scale, 1/sqrt(head size), but 1/sqrt(hidden / heads) for its 62-layer 27B."""
    arch = file.architecture
    kind, factor = file.fields.get(f"{arch}.rope.scaling.type"), file.fields.get(f"{arch}.rope.scaling.factor")
    rope = getattr(config, "rope_parameters", None)
    local_base = file.fields.get(f"{arch}.rope.freq_base_swa")
    if local_base and isinstance(rope, dict) and "sliding_attention" in rope:
        rope["sliding_attention"]["rope_theta"] = float(local_base)
    if kind == "linear" and factor and float(factor) != 1.0 and isinstance(rope, dict):
        scaled = rope.get("full_attention", rope)
        if scaled.get("rope_type", "default") == "default":
            scaled.update(rope_type="linear", factor=float(factor))
    if arch == "gemma3" and getattr(config, "head_dim", None):
        whole = config.num_hidden_layers == 62
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if whole else config.head_dim


def config_and_tokenizer(file: GGUFFile, cache: Path | None, with_tokenizer: bool = True):
    """(transformers config, tokenizer or None) from the file's metadata, by transformers' own GGUF conversion.
    The tokenizer (a few MB of JSON: under 20 MB for a 150k vocabulary) and the config are remembered in `cache`,
    a folder keyed by the header's hash, and read from there later; an unwritable cache only makes the next load
    slower."""
    from transformers import AutoConfig, AutoTokenizer

    folder = cache / file.header_hash()[:32] if cache is not None else None
    done = folder is not None and (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file()
    if done:
        try:
            config = AutoConfig.from_pretrained(str(folder))
            return config, AutoTokenizer.from_pretrained(str(folder)) if with_tokenizer else None
        except (OSError, ValueError, json.JSONDecodeError):  # damaged: made again below
            pass
    with as_gguf_reader(file, vocabulary=False):  # the tokenizer reads its vocabulary with a reader of its own
        try:
            config = AutoConfig.from_pretrained(str(file.path.parent), gguf_file=file.path.name)
            tokenizer = AutoTokenizer.from_pretrained(str(file.path.parent), gguf_file=file.path.name)
        except (OSError, ValueError, KeyError) as exc:  # an architecture or tokenizer transformers does not know
            raise TuichatError(f"Could not load model '{file.path.name}': {exc}") from exc
    # transformers' mapping leaves out the heads' size: its config's default (Qwen3's 128) or hidden / heads
    # would stand, where the file says.
    key_length = file.fields.get(f"{file.architecture}.attention.key_length")
    if key_length and hasattr(config, "head_dim"):
        config.head_dim = int(key_length)
    _as_llama_cpp_reads_it(file, config)
    if folder is not None:
        temporary = folder.with_name(folder.name + f".tmp-{os.getpid()}")
        try:
            tokenizer.save_pretrained(str(temporary))
            config.save_pretrained(str(temporary))
            shutil.rmtree(folder, ignore_errors=True)  # a damaged one
            os.replace(temporary, folder)
        except OSError:
            shutil.rmtree(temporary, ignore_errors=True)
    return config, tokenizer if with_tokenizer else None
