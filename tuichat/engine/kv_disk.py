"""The KV cache's second tier: full blocks written to the cache dir and read back instead of computed again.

A block goes to disk when the pool is about to reuse it (the prefix cache's eviction) and, for every cached
block, when the engine closes (the app quits, the model unloads). A new sequence whose next full blocks are not
in the pool but on disk gets them read into the blocks it was just given, as if computed: a conversation
reopened after a restart prefills only what it adds. Reading a block costs its bytes from the page cache or
disk; computing it costs a forward of its tokens through every layer.

A file is one block, named by the prefix cache's own chained digest (kv_cache.block_digest), in a folder per
model identity and KV layout (its dtype, heads, layers: another quantization of the same file is another
model). It holds its tokens and a checksum of its K/V; a read checks the magic, the layout, the size, that the
tokens chain to the digest it was looked up by and that the bytes match the checksum: a corrupt, truncated or
foreign file is ignored (and removed), never trusted. The folder is 0700, the files 0600 (a conversation's KV
reveals its text). The folder is bounded: past its budget the least recently used files go.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from tuichat.engine.kv_cache import Block, KVCache, block_digest
from tuichat.engine.request import Sequence

MAGIC = b"TKV2"
_HEADER = struct.Struct("<4s16sII")  # magic, layout digest, payload checksum (CRC-32), token count
SUFFIX = ".kv"


def _checksum(payload: bytes | memoryview) -> int:
    # Against a file cut or damaged on disk, not against its writer (the folder is the user's own, 0700, and the
    # tokens are checked against the digest chain): CRC-32 reads a block three times as fast as blake2b here.
    return zlib.crc32(payload)


class KVDisk:
    def __init__(self, root: Path, identity: str, kv: KVCache, block_size: int, max_bytes: int) -> None:
        self.kv, self.block_size, self.max_bytes = kv, block_size, max_bytes
        k = kv.k[0]
        layout = {"identity": identity, "layers": len(kv.k), "block_size": block_size, "shape": list(k.shape[1:]),
                  "dtype": str(k.dtype)}
        self.layout = hashlib.blake2b(json.dumps(layout, sort_keys=True).encode(), digest_size=16).digest()
        self.folder = root / self.layout.hex()
        for folder in (root, self.folder):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(folder, 0o700)  # mkdir's mode passes through the umask
        self.block_bytes = 2 * len(kv.k) * block_size * k[0].numel() * k.element_size()
        # On a CPU, numpy views of the K/V as integers of the element's size: a block's copy in or out of a
        # layer's tensor is then a slice assignment (~1 µs), not a torch op (~15 µs), and a block has one per
        # layer for K and V.
        tensors = (*kv.k, *kv.v)
        self.arrays = None
        if all(t.device.type == "cpu" for t in tensors):
            as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[k.element_size()]
            self.arrays = [t.view(as_int).numpy() for t in tensors]
        # What is on disk, least recently used first: {digest: size}. Only this process writes its folder's files
        # while it runs (one engine per model and layout); a file that vanished is simply a miss.
        entries = []
        for entry in os.scandir(self.folder):
            if entry.name.endswith(SUFFIX) and entry.is_file():
                stat = entry.stat()
                entries.append((stat.st_mtime_ns, entry.name[: -len(SUFFIX)], stat.st_size))
        self.files: dict[str, int] = {name: size for _, name, size in sorted(entries)}
        self.total = sum(self.files.values())
        self.read_blocks = self.written_blocks = 0

    def _path(self, digest: str) -> Path:
        return self.folder / f"{digest}{SUFFIX}"

    # -- writing --------------------------------------------------------------------------------------------------
    def write(self, block: Block) -> None:
        """Keep a full, computed block on disk (nothing if it is there already)."""
        if block.hash is None or block.hash.hex() in self.files:
            return
        slots = slice(block.id * self.block_size, (block.id + 1) * self.block_size)
        if self.arrays is not None:
            payload = b"".join(array[slots].tobytes() for array in self.arrays)
        else:
            payload = b"".join(t[slots].contiguous().cpu().view(torch.uint8).numpy().tobytes()
                               for t in (*self.kv.k, *self.kv.v))
        tokens = np.asarray(block.token_ids, dtype="<i8").tobytes()
        data = _HEADER.pack(MAGIC, self.layout, _checksum(payload), len(block.token_ids)) + tokens + payload
        name = block.hash.hex()
        path, partial = self._path(name), self.folder / f".{name}.{os.getpid()}.tmp"
        try:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            os.replace(partial, path)  # whole or not at all
        except OSError:  # a full disk, a read-only cache dir: the block is simply not kept
            partial.unlink(missing_ok=True)
            return
        self.files[name] = len(data)
        self.total += len(data)
        self.written_blocks += 1
        self._shrink()

    def _shrink(self) -> None:
        while self.total > self.max_bytes and self.files:
            name = next(iter(self.files))
            self.total -= self.files.pop(name)
            self._path(name).unlink(missing_ok=True)

    # -- reading --------------------------------------------------------------------------------------------------
    def restore(self, seq: Sequence, first: int, parent: bytes | None) -> int:
        """Fill seq's blocks from index `first` on (allocated, not computed) from disk while the chain of
        digests goes on there; `parent`: the digest of the block before `first`. Stops before the block holding
        the prompt's last token (it must be computed for the next token's logits). Returns the blocks filled."""
        bs, filled = self.block_size, 0
        for i in range(first, (len(seq) - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            digest = block_digest(parent, tokens)
            if digest.hex() not in self.files or not self._read(digest.hex(), tokens, seq.block_table[i]):
                break
            parent = digest
            filled += 1
        return filled

    def _read(self, name: str, tokens: tuple[int, ...], block_id: int) -> bool:
        path = self._path(name)
        try:
            with open(path, "rb") as file:  # into a writable buffer: torch views it without a copy
                data = bytearray(os.fstat(file.fileno()).st_size)
                file.readinto(data)
        except OSError:
            self._forget(name)
            return False
        magic, layout, checksum, count = _HEADER.unpack_from(data) if len(data) >= _HEADER.size else (b"", b"", 0, 0)
        start = _HEADER.size + 8 * count
        payload = memoryview(data)[start:]
        if (magic != MAGIC or layout != self.layout or count != self.block_size or len(payload) != self.block_bytes
                or tuple(np.frombuffer(data, "<i8", count, _HEADER.size).tolist()) != tokens
                or _checksum(payload) != checksum):
            self._forget(name, remove=True)  # corrupt, cut short or not ours: never trusted
            return False
        slots = slice(block_id * self.block_size, (block_id + 1) * self.block_size)
        tensors = (*self.kv.k, *self.kv.v)
        if self.arrays is not None:
            parts = np.frombuffer(payload, dtype=self.arrays[0].dtype).reshape(len(tensors), *self.arrays[0][slots].shape)
            for array, part in zip(self.arrays, parts, strict=True):
                array[slots] = part
        else:
            size = len(payload) // len(tensors)
            for index, tensor in enumerate(tensors):
                part = torch.frombuffer(payload[index * size : (index + 1) * size], dtype=tensor.dtype)
                tensor[slots].copy_(part.view(tensor[slots].shape))
        now = time.time_ns()
        os.utime(path, ns=(now, now))  # recently used: the last to go when the folder shrinks
        self.files[name] = self.files.pop(name)
        self.read_blocks += 1
        return True

    def _forget(self, name: str, remove: bool = False) -> None:
        self.total -= self.files.pop(name, 0)
        if remove:
            self._path(name).unlink(missing_ok=True)
