"""Memory over hours, compressed: the RSS of a real `tuichat serve` across idle/busy cycles or model switches.

`idle_cycles` sends each prompt after the engine thread has ended for idleness (the gap exceeds
engine.IDLE_EXIT_S), so every request runs on a new engine thread, as a TUI left open sees at nearly every
message; the prompts are random words, so none shares a prefix with another beyond the chat template.
`model_switches` sends each request to the next of several models (more than the server keeps loaded), so each
one loads a model and unloads another. scripts/soak.py runs them from the command line; tests/test_memory.py
holds them to a bound.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

from tuichat.backends.protocol import Message
from tuichat.bench.peers.serve import ServePeer
from tuichat.engine.heap import process_memory

WORDS = ("river stone lantern orchard copper meadow whistle harbor velvet thunder maple signal quiet garden silver "
         "candle mirror forest pocket window marble basket feather canyon ribbon winter saddle").split()


def rss_mb(pid: int) -> float:
    """A process's resident memory now (Linux)."""
    try:
        return process_memory(pid)[0] / 2**20
    except OSError:
        raise RuntimeError(f"no VmRSS for process {pid}") from None


def fresh_prompt(rng: random.Random, words: int) -> list[Message]:
    return [Message("user", " ".join(rng.choice(WORDS) for _ in range(words)))]


def idle_cycles(peer: ServePeer, count: int, gap_s: float, words: int,
                report: Callable[[int, float], None] = lambda i, rss: None) -> list[float]:
    """RSS (MB) after one warm-up cycle, then after each of `count` cycles: a fresh prompt, then `gap_s` idle."""
    rng = random.Random(0)
    samples = []
    for i in range(count + 1):
        peer.generate(fresh_prompt(rng, words), max_tokens=8)
        time.sleep(gap_s)  # the engine thread ends in this gap: the next request starts another
        samples.append(rss_mb(peer.process.pid))
        report(i, samples[-1])
    return samples


def model_switches(peer: ServePeer, models: Sequence[str], count: int,
                   report: Callable[[int, float], None] = lambda i, rss: None) -> list[float]:
    """RSS (MB) after each model answered once (the warm-up), then after each of `count` requests, each to the
    next model in turn."""
    for model in models:
        peer.generate([Message("user", "hello")], max_tokens=4, model=model)
    samples = [rss_mb(peer.process.pid)]
    report(0, samples[-1])
    for i in range(1, count + 1):
        peer.generate([Message("user", f"hello {i}")], max_tokens=4, model=models[i % len(models)])
        samples.append(rss_mb(peer.process.pid))
        report(i, samples[-1])
    return samples
