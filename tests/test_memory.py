"""Memory over hours, compressed: a real `tuichat serve` in its own process, its RSS read from /proc across
idle/busy cycles and model switches (tuichat/bench/soak.py). A bound on memory is not a bound on speed: these
hold on any machine. scripts/soak.py runs the same loops longer and prints the figures."""

from __future__ import annotations

import shutil
import sys

import pytest

from tuichat.backends.protocol import EngineOptions, Message
from tuichat.bench.peers.serve import ServePeer
from tuichat.bench.soak import idle_cycles, model_switches
from tuichat.catalog import embedded_gguf
from tuichat.engine.engine import IDLE_EXIT_S

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads RSS from /proc (Linux)")


@pytest.fixture
def serve():
    peers = []

    def start(model: str, **options) -> ServePeer:
        peers.append(ServePeer(model, EngineOptions(**options), [Message("user", "hello")]))
        return peers[-1]

    yield start
    for peer in peers:
        peer.close()


def test_rss_stays_flat_over_idle_busy_cycles(serve):
    """Each fresh ~450-token prompt after the engine thread ended for idleness, so each runs on a new thread:
    what a TUI left open sees at nearly every message. Scratch kept per thread leaked ~9 MB a cycle here.
    The KV pool's pages are mapped as tokens are first cached (~7 MB a cycle here), growth up to the pool's size
    and no further: a 32 MB pool (~1,400 tokens) is full by the third cycle, and reused from then on."""
    samples = idle_cycles(serve("smollm2-135m", kv_cache_mb=32), count=10, gap_s=IDLE_EXIT_S + 0.4, words=300)
    settled = samples[2]  # after the first cycles' one-time growth (allocator pools, caches filled once)
    assert max(samples[2:]) - settled < 50, f"RSS (MB) by cycle: {[round(s) for s in samples]}"


def test_rss_returns_after_model_switches(serve, tmp_path, monkeypatch):
    """Three models, at most two loaded: each request loads one and unloads another. The freed weights and
    load buffers stayed in the C heap, ~75 MB a switch here, until the heap was trimmed after each."""
    models = [str(shutil.copy(embedded_gguf(), tmp_path / f"model-{name}.gguf")) for name in "abc"]
    monkeypatch.chdir(tmp_path)  # serve looks a request's file up by its name from its working directory
    samples = model_switches(serve(models[0]), models, count=6)
    # Back where it started (the measure): the lower of the last two, since a switch's own load may
    # still hold pages the next one returns. Without the trim it ends hundreds of MB up.
    assert min(samples[-2:]) - samples[0] < 100, f"RSS (MB) by switch: {[round(s) for s in samples]}"
