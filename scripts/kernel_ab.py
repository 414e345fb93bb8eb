"""The working tree's CPU kernels against another revision's, in one process, over a GGUF file's linears.

    .venv/bin/python scripts/kernel_ab.py FILE.gguf [--base HEAD] [--rows 1,8] [--passes 40] [--only NAME]

These machines' speed drifts by more than most kernel changes gain, minute to minute: two processes timed one
after the other compare the minutes as much as the kernels. Here both builds are loaded side by side (two
libraries through ctypes) and each pass over all the file's linears (as served, `scripts/gguf_linears.py
--served`) runs with one build then the other, the order swapped every pass; a whole pass is larger than the
caches, so neither build runs on weights the other left hot. Prints each build's median and best pass and the
median of the per-pass ratios (working tree ÷ base) with their range: below 1, the working tree is faster.
`--base` builds that revision's csrc/ (git archive) with the same compiler flags; the same revision on both
sides shows the harness's own spread.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tarfile
import tempfile
import time
import warnings
from io import BytesIO
from pathlib import Path

import torch

from tuichat.engine import mapped
from tuichat.engine.cpu import build
from tuichat.engine.cpu.native import CpuKernels

ROOT = Path(__file__).resolve().parent.parent
CSRC = "tuichat/engine/cpu/csrc"


def built_at(revision: str, into: Path) -> Path:
    """The kernels of `revision`, compiled into `into` as build.py compiles the working tree's."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, CSRC], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    sources = sorted(str(p) for p in (into / CSRC).rglob("*.c"))
    library = into / "cpu_kernels.so"
    subprocess.run([build._compiler(), *build._flags(), *sources, "-o", str(library)], check=True, timeout=build.BUILD_TIMEOUT_S)
    return library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("gguf")
    parser.add_argument("--base", default="HEAD", help="the git revision to compare with (default HEAD)")
    parser.add_argument("--rows", default="1,8", help="input rows per linear, comma-separated")
    parser.add_argument("--passes", type=int, default=40)
    parser.add_argument("--only", default="", help="only the linears whose name holds this")
    args = parser.parse_args()
    ours, why = build.load()
    if ours is None:
        raise SystemExit(f"no CPU kernels: {why}")
    with tempfile.TemporaryDirectory() as folder:
        base = CpuKernels(ctypes.CDLL(str(built_at(args.base, Path(folder)))))
        with warnings.catch_warnings():  # the mapping is read-only, and the kernels only read it
            warnings.simplefilter("ignore", UserWarning)
            model, _ = mapped.load(args.gguf, ours, Path(folder) / "cache", with_tokenizer=False)
        weights = [w for name, w in model.tuichat_mapped.packed.items() if args.only in name]
        print(f"kernels: {ours.isa}; {torch.get_num_threads()} threads; {len(weights)} linears; working tree ÷ {args.base}")
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = {w.in_features: torch.randn(rows, w.in_features) for w in weights}
            times: dict[str, list[float]] = {"base": [], "ours": []}
            for i in range(args.passes):
                for name, kernels in (("base", base), ("ours", ours))[:: 1 if i % 2 else -1]:
                    start = time.perf_counter()
                    for w in weights:
                        kernels.linear(inputs[w.in_features], w, None)
                    times[name].append(time.perf_counter() - start)
            ratios = [o / b for o, b in zip(times["ours"], times["base"])]
            print(f"rows {rows:3d}: base {statistics.median(times['base']) * 1e3:.1f} ms (best {min(times['base']) * 1e3:.1f}), "
                  f"ours {statistics.median(times['ours']) * 1e3:.1f} ms (best {min(times['ours']) * 1e3:.1f}); "
                  f"ratio {statistics.median(ratios):.3f} (range {min(ratios):.3f}–{max(ratios):.3f})")


if __name__ == "__main__":
    main()
