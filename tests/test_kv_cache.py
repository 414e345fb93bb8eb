"""Property test of the block manager: any interleaving of admissions, growth, registration and frees
keeps the accounting exact and every block free again at the end."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tuichat.backend import SamplingParams
from tuichat.engine.kv_cache import BlockManager, CacheFull
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
        for s in live.values():
            assert len(s.block_table) >= manager.blocks_for(len(s))
            for block_id in s.block_table:
                refs[block_id] += 1
        assert refs == [b.ref_count for b in manager.blocks]  # ref counts are exactly the table references
        assert manager.num_free == sum(1 for r in refs if r == 0)
        for h, block_id in manager.by_hash.items():
            assert manager.blocks[block_id].hash == h
    for seq in live.values():
        manager.free_sequence(seq)
    assert manager.num_free == manager.num_blocks
