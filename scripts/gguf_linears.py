"""A decode step's matmuls over a real GGUF file, in place: every linear weight the kernels read in the file's own
layout (Q4_K, Q6_K), straight from the mapped file, times `rows` inputs, as a step of that many rows does.

    .venv/bin/python scripts/gguf_linears.py FILE.gguf [--rows 1,8,64] [--repeats 5] [--recut]
        [--only NAME] [--threads N] [--huge] [--served [--malloc]]

--recut times the same linears the way the engine serves them today instead: re-cut into blocks of 32 and
packed into the tiled path's order (a copy in memory, made here first). --only keeps the tensors whose name
holds NAME (one tensor that fits in L3 times the kernel's instructions rather than the memory's bandwidth);
--threads sets the kernels' threads (default: torch's). --huge times copies of the in-place tensors in one
anonymous map advised MADV_HUGEPAGE (2 MB pages; heap.WeightArena, as the engine serves them) instead of the
file's map (4 KB pages): what the TLB costs. --served times every linear as the engine serves it instead (the
model loaded by engine/mapped.py: tiles, re-cut blocks, the map, each in its format), and --malloc with it
copies those weights into torch's own memory first (malloc: 4 KB pages where the THP mode is "madvise").

Prints, per number of rows, the pass's time and the weight read rate by format (the output layer included: a
decode step reads it whole). Numbers vary with what else the machine runs: compare rows of one run.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections import defaultdict

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from tuichat.engine.cpu import build
from tuichat.engine.heap import WeightArena
from tuichat.engine.quant import RECUT, PackedWeight, recut

IN_PLACE = {12: "Q4_K", 14: "Q6_K"}
NAMES = {**IN_PLACE, **{RECUT[fmt]: f"{name} re-cut" for fmt, name in IN_PLACE.items()}}


def format_name(fmt: int) -> str:
    if fmt in NAMES:
        return NAMES[fmt]
    try:
        return GGMLQuantizationType(fmt).name
    except ValueError:
        return f"format {fmt}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--recut", action="store_true", help="time the re-cut, packed copies instead")
    parser.add_argument("--only", default="", help="only the tensors whose name holds this")
    parser.add_argument("--threads", type=int, default=0, help="the kernels' threads (default: torch's)")
    parser.add_argument("--huge", action="store_true", help="time copies in 2 MB pages, not the file's map")
    parser.add_argument("--served", action="store_true", help="every linear as the engine serves it")
    parser.add_argument("--malloc", action="store_true", help="with --served: copies in torch's memory")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels, why = build.load()
    if kernels is None:
        raise SystemExit(f"no CPU kernels: {why}")
    print(f"kernels: {why}; {torch.get_num_threads()} threads")
    weights = []
    if args.served:
        from pathlib import Path
        from tempfile import mkdtemp

        from tuichat.engine import mapped

        model, _ = mapped.load(args.gguf, kernels, Path(mkdtemp()), with_tokenizer=False)
        weights = [w for name, w in model.tuichat_mapped.packed.items() if args.only in name]
        if args.malloc:
            weights = [PackedWeight(w.data.clone(), w.format, w.out_features, w.in_features) for w in weights]
    with warnings.catch_warnings():  # the mapping is read-only, and the kernels only read it
        warnings.simplefilter("ignore", UserWarning)
        for tensor in GGUFReader(args.gguf).tensors:
            fmt = int(tensor.tensor_type)
            if not args.served and fmt in IN_PLACE and len(tensor.shape) == 2 and args.only in tensor.name:
                k, n = (int(v) for v in tensor.shape)
                blocks = np.asarray(tensor.data)
                if args.recut:
                    packed = kernels.pack(recut(blocks, fmt), RECUT[fmt], k)
                    weights.append(PackedWeight(packed, RECUT[fmt], n, k))
                else:
                    weights.append(PackedWeight(torch.from_numpy(blocks), fmt, n, k))
    if args.huge and not args.recut:
        arena = WeightArena()  # as the engine's load copies them
        weights = [PackedWeight(torch.from_numpy(arena.copy(w.data.numpy())), w.format, w.out_features, w.in_features)
                   for w in weights]
    where = ("as served" + (", copied by malloc" if args.malloc else "") if args.served else "re-cut" if args.recut
             else "copied into 2 MB pages" if args.huge else "in place")
    print(f"{len(weights)} linears {where}, {sum(w.bytes for w in weights) / 1e6:,.0f} MB")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {w.in_features: torch.randn(rows, w.in_features) for w in weights}
        seconds: dict[int, float] = defaultdict(lambda: float("inf"))
        for _ in range(args.repeats):
            this = defaultdict(float)
            for w in weights:
                start = time.perf_counter()
                kernels.linear(inputs[w.in_features], w, None)
                this[w.format] += time.perf_counter() - start
            for fmt, spent in this.items():
                seconds[fmt] = min(seconds[fmt], spent)
        total = sum(seconds.values())
        def rate(fmt: int, spent: float) -> str:
            ours = [w for w in weights if w.format == fmt]
            blocks = sum(w.out_features * w.in_features for w in ours) / 256  # super-blocks of 256 weights
            return (f"{format_name(fmt)} {sum(w.bytes for w in ours) / spent / 1e9:.1f} GB/s, "
                    f"{spent * 1e9 * torch.get_num_threads() / blocks:.1f} ns a super-block a thread")
        parts = ", ".join(rate(fmt, spent) for fmt, spent in sorted(seconds.items()))
        print(f"rows {rows:3d}: {total * 1e3:8.1f} ms a pass ({parts})")


if __name__ == "__main__":
    main()
