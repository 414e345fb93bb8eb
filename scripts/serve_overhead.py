"""What HTTP costs: the bench's tabs workload (8 conversations 100 ms apart, up to 64 tokens each) in process,
through LocalBackend, then as 8 concurrent streaming clients of `tuichat serve` (the bench's ServePeer starts
it), with the official openai client and with the bench's light one (SSE lines, json.loads).

    python scripts/serve_overhead.py [--model smollm2-135m] [--tabs 8] [--rounds 3] [--client both]

Prints aggregate tok/s and TTFT p50/p90 of each way (the median over --rounds), and HTTP's against in process.
The clients share the machine with the server: the official openai client's own parsing is part of its figure.
`tuichat bench --scenarios tabs --peers tuichat_serve` measures the light client's way once, with targets.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import openai

from tuichat.backends.local import LocalBackend
from tuichat.backends.protocol import EngineOptions, Message, SamplingParams
from tuichat.bench.corpus import QUESTIONS, WARMUP_QUESTION
from tuichat.bench.peers.serve import ServePeer
from tuichat.bench.peers.tuichat import run_tabs
from tuichat.bench.stats import percentile

TOKENS, STAGGER = 64, 0.1


def summary(ttfts: list[float], tokens: int, wall: float) -> dict:
    return {"tok_s": tokens / wall, "ttft_p50": percentile(ttfts, 0.5), "ttft_p90": percentile(ttfts, 0.9)}


def conversations(tabs: int) -> list[list[Message]]:
    return [[Message("user", QUESTIONS[i % len(QUESTIONS)])] for i in range(tabs)]


async def in_process(model: str, tabs: int, rounds: int) -> list[dict]:
    backend = LocalBackend(EngineOptions(), model)
    await backend.load(model)
    out = []
    for r in range(rounds + 1):  # the first round warms up
        results, wall = await run_tabs(backend, conversations(tabs), SamplingParams(max_tokens=TOKENS), STAGGER,
                                       tag=f"round{r}")
        if r:
            out.append(summary([x.ttft_ms for x in results], sum(x.tokens for x in results), wall))
    await backend.close()
    return out


async def with_openai(base: str, model: str, tabs: int, rounds: int) -> list[dict]:
    api = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)

    async def tab(i: int, t0: float) -> tuple[float, int, float]:
        await asyncio.sleep(max(0.0, t0 + i * STAGGER - time.perf_counter()))
        sent, first, tokens = time.perf_counter(), None, 0
        stream = await api.chat.completions.create(
            model=model, temperature=0, max_tokens=TOKENS, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return (first - sent) * 1000, tokens, time.perf_counter()

    out = []
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        results = await asyncio.gather(*(tab(i, t0) for i in range(tabs)))
        if r:
            out.append(summary([x[0] for x in results], sum(x[1] for x in results), max(x[2] for x in results) - t0))
    await api.close()
    return out


def with_light_client(server: ServePeer, tabs: int, rounds: int) -> list[dict]:
    out = []
    for _ in range(rounds):  # the peer warmed up with `tabs` clients at once
        results, wall = server.tabs(conversations(tabs), TOKENS, STAGGER)
        out.append(summary([x.ttft_ms for x in results], sum(x.tokens for x in results), wall))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tabs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--client", choices=["openai", "httpx", "both"], default="both",
                        help="the official openai client, the bench's light one, or each in turn")
    args = parser.parse_args()
    local = asyncio.run(in_process(args.model, args.tabs, args.rounds))
    server = ServePeer(args.model, EngineOptions(), [Message("user", WARMUP_QUESTION)], args.tabs)
    try:
        base = f"http://127.0.0.1:{server.port}"
        remote = {}
        if args.client in ("openai", "both"):
            remote["openai"] = asyncio.run(with_openai(base, args.model, args.tabs, args.rounds))
        if args.client in ("httpx", "both"):
            remote["light"] = with_light_client(server, args.tabs, args.rounds)
    finally:
        server.close()

    def med(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    print(f"{args.model}: {args.tabs} tabs {STAGGER * 1000:.0f} ms apart, <= {TOKENS} tokens, median of {args.rounds} rounds")
    print(f"  {'in process (LocalBackend)':<34} {med(local, 'tok_s'):6.1f} tok/s   TTFT p50 {med(local, 'ttft_p50'):6.1f} ms   "
          f"p90 {med(local, 'ttft_p90'):6.1f} ms")
    for client, runs in remote.items():
        print(f"  {'over HTTP, ' + client + ' client':<34} {med(runs, 'tok_s'):6.1f} tok/s   TTFT p50 "
              f"{med(runs, 'ttft_p50'):6.1f} ms   p90 {med(runs, 'ttft_p90'):6.1f} ms   ({med(runs, 'tok_s') / med(local, 'tok_s'):.2f}×, "
              f"{med(runs, 'ttft_p50') - med(local, 'ttft_p50'):+.1f} ms)")


if __name__ == "__main__":
    main()
