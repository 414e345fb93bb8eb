"""What a long prompt leaves in memory: the KV pool's resident pages after one reply, and the process's.

    python scripts/kv_rss.py MODEL PROMPT_FILE [--max-tokens 16]

MODEL is what `tuichat ask --model` takes (a GGUF file, a catalog name). The pool's RSS is summed over the
mappings of /proc/self/smaps that overlap it (the pool is one private map; sliding-window layers give back the
pages of blocks that left their window, docs/design/kv-cache.md).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path


def resident_mb(start: int, size: int) -> int:
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if m := re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line):
            inside = int(m.group(2), 16) > start and int(m.group(1), 16) < start + size
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total // 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("prompt_file")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    from tuichat import catalog
    from tuichat.backends.protocol import SamplingParams
    from tuichat.engine import heap, loader
    from tuichat.engine.engine import Engine, EngineConfig

    resolved = catalog.resolve(args.model)
    device = loader.resolve_device("auto")
    dtype = loader.resolve_dtype("auto", device, loader.family(resolved), resolved.kind == "gguf")
    model, tokenizer = loader.load(resolved, device, dtype, mapped=loader.in_place(resolved, device, dtype))
    engine = Engine(model, tokenizer, EngineConfig(speculate="off"), name=resolved.name, source=resolved)
    ids = tokenizer(Path(args.prompt_file).read_text())["input_ids"]
    engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    pool = engine.kv_bytes
    process = heap.process_memory()[0] >> 20
    released = sum(not b.resident for b in engine.blocks.blocks)
    print(f"{len(ids)} prompt tokens; KV pool {pool >> 20} MB, {resident_mb(engine.kv.k[0].data_ptr(), pool)} MB resident "
          f"({released} blocks released in sliding-window layers); process RSS {process} MB")
    engine.close()


if __name__ == "__main__":
    main()
