"""Decode-step matmuls on this CPU: tuichat's AMX kernel against torch, over the shapes of a whole model.

    .venv/bin/python scripts/matmul_bench.py [--rows 1,8,16,48,64] [--layers 30] [--repeats 8]

Every linear of a SmolLM2-135M-shaped model (fused q/k/v, o, fused gate/up, down per layer, then lm_head),
random bf16 weights, each matrix read from memory once per pass, as in a decode step. Prints ms per pass
and the weight read rate. Numbers vary with what else the machine runs: compare rows of one run.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from tuichat.engine.cpu import build, native

HIDDEN, MLP, VOCAB = 576, 1536, 49152
LAYER_SHAPES = [(HIDDEN + 2 * 192, HIDDEN), (HIDDEN, HIDDEN), (2 * MLP, HIDDEN), (HIDDEN, MLP)]


def one_pass(weights, inputs, linear) -> None:
    for w in weights:
        linear(inputs[w.shape[1]], w)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,16,48,64")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    kernel, why = build.load()
    print(f"tuichat kernel: {why}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    torch.manual_seed(0)
    weights = [torch.randn(n, k).mul_(0.02).bfloat16() for _ in range(args.layers) for n, k in LAYER_SHAPES]
    weights.append(torch.randn(VOCAB, HIDDEN).mul_(0.02).bfloat16())
    total_bytes = sum(w.numel() * w.element_size() for w in weights)
    candidates = {"torch": F.linear}
    if kernel is not None:
        candidates[kernel.isa] = lambda x, w: kernel(x, w, None)
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k).bfloat16() for k in (HIDDEN, MLP)}
        for name, linear in candidates.items():
            if name != "torch" and rows > native.MAX_ROWS:
                continue
            one_pass(weights, inputs, linear)  # warm-up
            start = time.perf_counter()
            for _ in range(args.repeats):
                one_pass(weights, inputs, linear)
            ms = (time.perf_counter() - start) / args.repeats * 1000
            print(f"rows {rows:3d}  {name:5s} {ms:7.1f} ms  {total_bytes / ms / 1e6:5.1f} GB/s")


if __name__ == "__main__":
    main()
