"""Memory over hours, compressed (tuichat/bench/soak.py): RSS of a real `tuichat serve`.

    python scripts/soak.py cycles --cycles 30     # fresh ~450-token prompts, each after an idle gap
    python scripts/soak.py switch --switches 20   # requests to three copies of the embedded GGUF in turn

Config and history go to a temporary folder; the cache dir (built kernels, the GGUF's conversion) is the usual
one, so a warm machine starts in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from tuichat.backends.protocol import EngineOptions, Message
from tuichat.bench.peers.serve import ServePeer
from tuichat.bench.soak import idle_cycles, model_switches
from tuichat.catalog import embedded_gguf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["cycles", "switch"])
    parser.add_argument("--cycles", type=int, default=30)
    parser.add_argument("--switches", type=int, default=20)
    parser.add_argument("--gap-s", type=float, default=1.4, help="idle time after each reply (cycles)")
    parser.add_argument("--words", type=int, default=300, help="words a prompt (~1.5 tokens each)")
    parser.add_argument("--every", type=int, default=10, help="print every Nth sample")
    args = parser.parse_args()

    def report(i: int, rss: float) -> None:
        if i % args.every == 0:
            print(json.dumps({"mode": args.mode, "after": i, "rss_mb": round(rss, 1)}), flush=True)

    with tempfile.TemporaryDirectory() as home:
        home = Path(home)
        os.environ.update(TUICHAT_CONFIG_DIR=str(home / "config"), TUICHAT_DATA_DIR=str(home / "data"),
                          HF_HUB_OFFLINE="1")
        models = ["smollm2-135m"]
        if args.mode == "switch":
            models = [str(shutil.copy(embedded_gguf(), home / f"copy-{name}.gguf")) for name in "abc"]
            os.chdir(home)  # serve looks a request's file up by its name from its working directory
        peer = ServePeer(models[0], EngineOptions(), [Message("user", "hello")])
        try:
            if args.mode == "cycles":
                samples = idle_cycles(peer, args.cycles, args.gap_s, args.words, report)
            else:
                samples = model_switches(peer, models, args.switches, report)
        finally:
            peer.close()
    print(json.dumps({"mode": args.mode, "first_mb": round(samples[0], 1), "last_mb": round(samples[-1], 1),
                      "growth_mb": round(samples[-1] - samples[0], 1), "peak_mb": round(max(samples), 1)}))


if __name__ == "__main__":
    main()
