"""`tuichat bench`: streaming, batching and caching measured on this machine, next to the usual alternatives.

The modules follow a run: corpus (the prompts) -> settings (what to run, with which caps) -> peers (tuichat
and the systems it is compared with) -> scenarios (the measurements, timed with stats, against the floor)
-> report (targets, tables, JSON, plot). `main` is what the `tuichat bench` command does.
"""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

from tuichat.bench.corpus import QUESTIONS, SINGLE_QUESTIONS
from tuichat.bench.floor import measure_bandwidth, step_floor
from tuichat.bench.peers.hf import HFPeer
from tuichat.bench.peers.llama_server import LlamaServerPeer, find_llama_server
from tuichat.bench.progress import Progress
from tuichat.bench.report import check_plot_available, plot, render, skipped_notes, targets, write
from tuichat.bench.scenarios import ENGINE_THREAD, run_bench
from tuichat.bench.settings import MODES, PEERS, SCENARIOS, BenchSettings, parse_list, plan
from tuichat.bench.stats import RequestResult, percentile, summarize

__all__ = [
    "ENGINE_THREAD", "MODES", "PEERS", "QUESTIONS", "SCENARIOS", "SINGLE_QUESTIONS", "BenchSettings", "HFPeer",
    "LlamaServerPeer", "Progress", "RequestResult", "check_plot_available", "find_llama_server", "main",
    "measure_bandwidth", "parse_list", "percentile", "plan", "plot", "render", "run_bench", "skipped_notes",
    "step_floor", "summarize", "targets",
]


def main(settings: BenchSettings, as_json: bool = False, plot_path: str | None = None,
         out: TextIO | None = None, err: TextIO | None = None) -> dict[str, Any]:
    """What `tuichat bench` does: run, print the table (or the JSON), save the plot."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    if plot_path:
        check_plot_available()  # fail before minutes of measuring, not after
    result = run_bench(settings, err)
    if plot_path:
        plot(result, plot_path)
        result["plot"] = plot_path
    if as_json:
        out.write(json.dumps(result, default=str) + "\n")  # never through rich: pure JSON
    else:
        write(result, out, plot_path)
    out.flush()
    return result
