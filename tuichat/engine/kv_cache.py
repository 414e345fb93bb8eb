"""Paged KV cache: a fixed pool of blocks, per-sequence block tables, and a prefix cache over them.

A full block is identified by a digest chained over every token before it (blake2b of the parent's digest
and the block's tokens), so two sequences share a block only when their whole prefixes match. A
collision-resistant digest, not Python's hash(): with many clients on one cache, a crafted or unlucky
collision of parent chains would hand one conversation another's KV (vLLM moved to sha256 after
CVE-2025-25183 for the same reason). Hashes are registered only once a block's
K/V is really computed (chunked prefill can leave a block allocated but not yet filled). Blocks whose ref
count drops to zero keep their hash and stay findable until the pool needs them; they are reused oldest
freed first (LRU), like vLLM's free-block queue.

Sliding-window layers need only a window's K/V: once every position of a block is out of the window of the
end of a sequence's last full block, the block's pages in those layers are given back (KVCache.release) while
its full-attention layers keep theirs. Such a block is no longer `resident`: it still serves a prefix hit,
but only where no sliding layer reads it, so a hit is cut back until the window before its end lies in
resident blocks (vLLM's hybrid allocator keeps the same rule with a block table per kind of layer).
"""

from __future__ import annotations

import hashlib
import math
import mmap
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from tuichat.engine.request import Sequence


def block_digest(parent: bytes | None, tokens: tuple[int, ...]) -> bytes:
    """The prefix cache's key of a full block: its tokens, chained to every block before it."""
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16, key=parent or b"").digest()


class CacheFull(Exception):
    """No free block: the scheduler answers by preempting a sequence."""


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    resident: bool = True  # False once its sliding-window layers' K/V were released


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_cache = prefix_cache
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.by_hash: dict[bytes, int] = {}
        self.lower = None  # a kv_disk.KVDisk: evicted blocks go there, and new sequences' blocks come back from it
        # The longest sliding window of the model's layers, and what gives a block's pages in those layers back
        # (KVCache.release), where the engine releases them; None: every block stays resident.
        self.window: int | None = None
        self.release = None

    # -- accounting -------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation -------------------------------------------------------------------------------------
    def _take_free(self) -> Block:
        if not self.free:
            raise CacheFull
        block = self.blocks[self.free.popitem(last=False)[0]]
        if block.hash is not None and self.lower is not None and block.resident:
            self.lower.write(block)  # evicted from the pool, kept on disk
        if block.hash is not None and self.by_hash.get(block.hash) == block.id:
            del self.by_hash[block.hash]
        block.hash, block.token_ids, block.ref_count, block.resident = None, (), 1, True
        return block

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Ids of cached blocks covering seq's leading full blocks. Stops before the block holding the
        last token: that token must be computed again to get the logits for the next one."""
        if not self.prefix_cache:
            return []
        bs, hits, parent = self.block_size, [], None
        for i in range((len(seq) - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent = block_digest(parent, tokens)
            block_id = self.by_hash.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        if self.window is not None:  # the first row computed reads the window before it in sliding layers
            while hits and not all(self.blocks[b].resident for b in hits[self._window_start(len(hits) * bs) :]):
                hits.pop()
        return hits

    def _window_start(self, position: int) -> int:
        """The first block that a row at `position` reads in a sliding-window layer."""
        return max(0, position + 1 - self.window) // self.block_size

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks.
        Raises CacheFull (and changes nothing) when the pool cannot hold it now."""
        hits = self._cached_prefix(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # cached but free: they count too
        needed = self.blocks_for(len(seq)) - len(hits)
        if needed > self.num_free - revived:
            raise CacheFull
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
        seq.block_table = hits + [self._take_free().id for _ in range(needed)]
        seq.num_computed = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)
        seq.num_released_blocks = 0
        seq.last_block_hash = self.blocks[hits[-1]].hash if hits else None
        if self.lower is not None and self.prefix_cache:  # the blocks after the hits, from disk where it has them
            restored = self.lower.restore(seq, len(hits), seq.last_block_hash) * self.block_size
            if restored:
                seq.num_computed += restored
                seq.num_restored_tokens += restored
                self.register_computed(seq)

    def ensure_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Make room for seq to hold num_tokens tokens. Raises CacheFull."""
        while len(seq.block_table) < self.blocks_for(num_tokens):
            seq.block_table.append(self._take_free().id)

    def release_window(self, seq: Sequence) -> None:
        """Give back the sliding-window layers' pages of seq's blocks that no row of it will read again: those
        wholly before the window of its last full block's end, not of its next row, so that a next turn's prefix
        hit (full blocks only) still finds its window. A block another sequence holds too is kept: that one may
        still read it. Nothing where the model has no sliding window (or its blocks cannot be released)."""
        if self.window is None:
            return
        end = self._window_start(seq.num_computed // self.block_size * self.block_size)
        for i in range(seq.num_released_blocks, min(end, len(seq.block_table))):
            block = self.blocks[seq.block_table[i]]
            if block.ref_count == 1 and block.resident:
                if self.lower is not None:
                    self.lower.write(block)  # whole, while it is: a later session restores it from there
                self.release(block.id)
                block.resident = False
        seq.num_released_blocks = max(seq.num_released_blocks, end)

    def keep_all(self) -> None:
        """Every cached block to disk (the engine closing); a released one went there before its release."""
        if self.lower is not None:
            for block in self.blocks:
                if block.hash is not None and block.resident:
                    self.lower.write(block)

    def free_sequence(self, seq: Sequence) -> None:
        # Tail blocks first, so they are evicted before the shared head of the prefix.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} ref count went negative"
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.num_computed = 0
        seq.num_hashed_blocks = 0
        seq.num_released_blocks = 0
        seq.last_block_hash = None

    def register_computed(self, seq: Sequence) -> None:
        """Publish seq's newly completed full blocks (prompt or generated) to the prefix cache."""
        if not self.prefix_cache:
            return
        bs = self.block_size
        while seq.num_hashed_blocks < seq.num_computed // bs:
            i = seq.num_hashed_blocks
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = block_digest(seq.last_block_hash, tokens)
            block = self.blocks[seq.block_table[i]]
            # A twin computed by another sequence at the same time keeps the entry; ours stays private. A released
            # twin gives the entry up: ours can serve a hit it could not.
            twin = self.by_hash.get(h)
            if twin is None or not self.blocks[twin].resident:
                block.hash, block.token_ids = h, tokens
                self.by_hash[h] = block.id
            seq.last_block_hash = h
            seq.num_hashed_blocks += 1


class KVCache:
    """The K/V tensors: per layer [num_blocks * block_size, kv_heads, head_dim], addressed by slot."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        devices: list[torch.device],
    ) -> None:
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        size = 2 * num_layers * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        self._map = None
        if size and all(torch.device(d).type == "cpu" for d in devices[:num_layers]):
            # One anonymous map (torch.zeros writes every byte): the kernel maps its zero pages on first write, so
            # the process's memory grows with the tokens cached, not with the pool's size; page-aligned, so that
            # a block's pages can be given back (release).
            self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared: no giving back
            pool = torch.from_numpy(np.frombuffer(self._map, dtype=np.uint8)).view(dtype).view(2, num_layers, *shape)
            self.k, self.v = list(pool[0]), list(pool[1])
            self._block_bytes = block_size * num_kv_heads * head_dim * pool.element_size()
            self._layer_bytes = num_blocks * self._block_bytes
            return
        self.k = [torch.zeros(shape, dtype=dtype, device=devices[i]) for i in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=devices[i]) for i in range(num_layers)]

    @property
    def releasable(self) -> bool:
        """Whether every block's K/V in a layer holds whole pages to give back: a block of a whole number of pages
        (the pool and its layers start on pages), or of two pages or more."""
        return self._map is not None and (self._block_bytes % mmap.PAGESIZE == 0 or self._block_bytes >= 2 * mmap.PAGESIZE)

    def release(self, block_id: int, layers: list[int]) -> None:
        """Give the pages of block_id in these layers back to the system (they read as zeros after): the whole
        pages within the block's K and V, in each layer."""
        for half in range(2):
            for layer in layers:
                start = ((half * len(self.k) + layer) * self._layer_bytes + block_id * self._block_bytes)
                first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
                end = (start + self._block_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
                if end > first:
                    self._map.madvise(mmap.MADV_DONTNEED, first, end - first)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
