"""The KV cache's second tier (tuichat.engine.kv_disk) on tiny random models: blocks written when the engine
closes and when the pool evicts them, read back by a later engine (a restart) or the same one, as cached tokens;
replies equal to transformers' greedy `generate` whatever was read back; private files; a corrupt or foreign
file ignored and removed; the folder kept within its budget."""

from __future__ import annotations

import os
import random
import stat

from tests.helpers import hf_greedy, make_tiny
from tuichat.backends.protocol import SamplingParams
from tuichat.engine.engine import Engine, EngineConfig

GREEDY = SamplingParams(max_tokens=12)
BS = 16


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(320) for _ in range(length)]


def engine_for(model, tmp_path, identity: str = "tiny", **config) -> Engine:
    return Engine(model, config=EngineConfig(kv_disk=(tmp_path / "kv", identity), **{"num_blocks": 64, **config}))


def files(tmp_path):
    return sorted(p for p in (tmp_path / "kv").rglob("*.kv"))


def test_a_restarted_engine_reads_back_what_the_last_one_computed(tmp_path):
    first_model, reference = make_tiny()
    text = prompt(100, 1)
    engine = engine_for(first_model, tmp_path)
    (seq,) = engine.generate([text], GREEDY)
    assert seq.num_cached_tokens == 0
    engine.close()  # every cached block to disk
    written = files(tmp_path)
    assert len(written) == (100 + 12 - 1) // BS  # the prompt's and the reply's full blocks
    folder = written[0].parent
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and stat.S_IMODE(folder.parent.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in written)

    model, _ = make_tiny()
    again = engine_for(model, tmp_path)
    follow_up = list(seq.token_ids) + prompt(9, 2)  # the next turn: the history and a new message
    (turn,) = again.generate([follow_up], GREEDY)
    assert turn.num_cached_tokens == turn.num_restored_tokens == (len(seq.token_ids) - 1) // BS * BS
    assert turn.completion_ids == hf_greedy(reference, follow_up, 12)


def test_blocks_the_pool_evicts_come_back_from_disk(tmp_path):
    model, reference = make_tiny()
    engine = engine_for(model, tmp_path, num_blocks=10)
    history = prompt(70, 3)
    engine.generate([history], GREEDY)
    engine.generate([prompt(140, 4)], GREEDY)  # needs all ten blocks: the first prompt's are evicted
    assert len(files(tmp_path)) >= 70 // BS
    (seq,) = engine.generate([history + [5, 6, 7]], GREEDY)
    assert seq.num_restored_tokens == 64 and seq.num_cached_tokens == 64
    assert seq.completion_ids == hf_greedy(reference, history + [5, 6, 7], 12)


def test_a_corrupt_or_foreign_file_is_ignored_and_removed(tmp_path):
    model, reference = make_tiny()
    text = prompt(100, 5)
    engine = engine_for(model, tmp_path)
    engine.generate([text], GREEDY)
    engine.close()
    first = engine_for(make_tiny()[0], tmp_path)
    # The third block of the chain: one flipped byte of its K/V.
    from tuichat.engine.kv_cache import block_digest

    parent = None
    for i in range(3):
        parent = block_digest(parent, tuple(text[i * BS:(i + 1) * BS]))
    third = next(p for p in files(tmp_path) if p.stem == parent.hex())
    data = bytearray(third.read_bytes())
    data[-5] ^= 0xFF
    third.write_bytes(bytes(data))
    (seq,) = first.generate([text], GREEDY)
    assert seq.num_restored_tokens == 2 * BS  # the two blocks before it
    assert seq.completion_ids == hf_greedy(reference, text, 12)
    assert not third.exists()
    # Another model's engine (another identity) finds nothing of this one's.
    other = engine_for(make_tiny(seed=1)[0], tmp_path, identity="another model")
    (seq,) = other.generate([text], GREEDY)
    assert seq.num_restored_tokens == 0


def test_the_folder_keeps_within_its_budget_least_recently_used_first(tmp_path):
    model, _ = make_tiny()
    engine = engine_for(model, tmp_path)
    engine.generate([prompt(100, 6)], GREEDY)
    engine.close()
    size = files(tmp_path)[0].stat().st_size
    kept = engine_for(make_tiny()[0], tmp_path)
    kept.kv_disk.max_bytes = 3 * size
    kept.generate([prompt(50, 7)], GREEDY)
    kept.close()  # writes the new prompt's blocks, the oldest files go
    assert sum(p.stat().st_size for p in files(tmp_path)) <= 3 * size
    assert len(files(tmp_path)) == 3
    assert all(os.path.getsize(p) == size for p in files(tmp_path))
