"""The block manager: any interleaving of admissions, growth, registration and frees keeps the accounting
exact, shares a block only between sequences holding the same tokens in front of it at the same place, and
frees every block at the end; an identical prompt reuses the full blocks but recomputes its last token."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tuichat.backends.protocol import SamplingParams
from tuichat.engine.heap import process_memory
from tuichat.engine.kv_cache import BlockManager, CacheFull, KVCache
from tuichat.engine.request import Sequence

ops = st.lists(
    st.tuples(st.sampled_from(["admit", "grow", "free"]), st.integers(0, 7), st.integers(1, 40)), max_size=60
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, prefix_cache=st.booleans())
def test_block_accounting_survives_any_interleaving(ops, prefix_cache):
    manager = BlockManager(num_blocks=12, block_size=4, prefix_cache=prefix_cache)
    live: dict[int, Sequence] = {}
    for op, slot, n in ops:
        seq = live.get(slot)
        if op == "admit" and seq is None:
            # Few distinct token patterns, so prefixes really collide and get shared.
            candidate = Sequence([slot % 2] * n, SamplingParams())
            try:
                manager.allocate(candidate)
            except CacheFull:
                continue
            candidate.num_computed = len(candidate)
            manager.register_computed(candidate)
            live[slot] = candidate
        elif op == "grow" and seq is not None:
            try:
                manager.ensure_slots(seq, len(seq) + n)
            except CacheFull:
                continue
            seq.token_ids += [slot % 2] * n
            seq.num_computed = len(seq)
            manager.register_computed(seq)
        elif op == "free" and seq is not None:
            manager.free_sequence(live.pop(slot))
        refs = [0] * manager.num_blocks
        holders: dict[int, list[tuple[Sequence, int]]] = {}
        for s in live.values():
            assert len(s.block_table) >= manager.blocks_for(len(s))
            assert len(set(s.block_table)) == len(s.block_table)
            for index, block_id in enumerate(s.block_table):
                refs[block_id] += 1
                holders.setdefault(block_id, []).append((s, index))
        assert refs == [b.ref_count for b in manager.blocks]  # ref counts are exactly the table references
        assert manager.num_free == sum(1 for r in refs if r == 0)
        assert prefix_cache or max(refs, default=0) <= 1
        for held in holders.values():
            if len(held) > 1:  # shared: a full block, at one place, after the same tokens in every holder
                (first, index), *others = held
                end = (index + 1) * manager.block_size
                assert all(i == index and len(o) >= end for o, i in others) and len(first) >= end
                assert all(o.token_ids[:end] == first.token_ids[:end] for o, _ in others)
        for h, block_id in manager.by_hash.items():
            assert manager.blocks[block_id].hash == h
    for seq in live.values():
        manager.free_sequence(seq)
    assert manager.num_free == manager.num_blocks


def computed(manager: BlockManager, tokens: list[int]) -> Sequence:
    seq = Sequence(tokens, SamplingParams())
    manager.allocate(seq)
    seq.num_computed = len(seq)
    manager.register_computed(seq)
    return seq


def test_an_identical_prompt_reuses_its_full_blocks_and_recomputes_the_last_token():
    manager = BlockManager(num_blocks=16, block_size=4)
    first = computed(manager, [7] * 10)  # blocks: 4, 4, and 2 tokens
    again = Sequence([7] * 10, SamplingParams())
    manager.allocate(again)
    assert again.block_table[:2] == first.block_table[:2] and again.num_computed == 8
    assert again.block_table[2] not in first.block_table
    # Exactly two full blocks: the second holds the last token, which must run again for the next logits.
    exact = Sequence([7] * 8, SamplingParams())
    manager.allocate(exact)
    assert exact.block_table[0] == first.block_table[0] and exact.block_table[1] not in first.block_table
    assert exact.num_computed == 4
    # The same tokens after a different first block are a different prefix: nothing shared.
    other = Sequence([8] * 4 + [7] * 6, SamplingParams())
    manager.allocate(other)
    assert not set(other.block_table) & set(first.block_table) and other.num_computed == 0


def test_without_the_prefix_cache_nothing_is_shared():
    manager = BlockManager(num_blocks=16, block_size=4, prefix_cache=False)
    first = computed(manager, [7] * 10)
    again = Sequence([7] * 10, SamplingParams())
    manager.allocate(again)
    assert not set(again.block_table) & set(first.block_table) and again.num_computed == 0


def test_a_cpu_pool_takes_memory_as_it_fills_and_reads_zero_where_unwritten():
    """A 3B Llama's 16k-token pool (1.8 GB): the process's resident memory grows by what the cached tokens use,
    not by the pool's size (it was file + 2.3 GB at `ask --max-tokens 1` on a 2 GB file)."""
    before, _ = process_memory()
    kv = KVCache(28, 1024, 16, 8, 128, torch.float16, [torch.device("cpu")] * 28)
    assert process_memory()[0] - before < 64 * 2**20
    for layer in range(28):  # one block of 16 tokens written in every layer: 1.8 MB, in 56 tensors' first pages
        kv.k[layer][:16] = 1.0
        kv.v[layer][:16] = 2.0
    # Pages are the kernel's: 4 KB, or 2 MB where it gives transparent huge pages (then ~112 MB here).
    assert process_memory()[0] - before < KVCache.bytes_per_block(28, 16, 8, 128, torch.float16) * 1024 // 4
    assert kv.k[5][16:].abs().sum() == 0 and kv.v[27][-16:].abs().sum() == 0 and kv.k[0][:16].sum() == 16 * 8 * 128
    assert all(t.is_contiguous() and t.shape == (16384, 8, 128) for t in (*kv.k, *kv.v))
