"""`tuichat bench` against a remote engine (`--model NAME:MODEL` of a config endpoint, or `--base-url`): single,
tabs and multiturn over the wire, each reply timed on this client as tuichat's own are (bench/stats.py). What
needs tuichat's engine in this process is skipped with a note: the transformers and llama.cpp peers, and the
scenarios that compare its settings (batching modes, cache off, shared prefix, interference)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, TextIO

from tuichat.backends.protocol import Backend, Message, SamplingParams
from tuichat.bench.corpus import FIRST_TURN, FOLLOW_UPS, QUESTIONS, SINGLE_QUESTIONS, WARMUP_QUESTION
from tuichat.bench.peers.tuichat import run_tabs, stream_once
from tuichat.bench.settings import BenchSettings
from tuichat.bench.stats import summarize

REMOTE_SCENARIOS = ("single", "tabs", "multiturn")


async def _measure(settings: BenchSettings, backend: Backend, model: str) -> tuple[str, dict[str, Any]]:
    s = settings
    name = await backend.load(model)
    await stream_once(backend, "warmup", [Message("user", WARMUP_QUESTION)], SamplingParams(max_tokens=4))
    out: dict[str, Any] = {}
    if "single" in s.scenarios:
        params = SamplingParams(max_tokens=s.single_tokens)
        start = time.perf_counter()
        results = [await stream_once(backend, f"single-{i}", [Message("user", SINGLE_QUESTIONS[i % len(SINGLE_QUESTIONS)])],
                                     params) for i in range(max(1, s.single_prompts))]
        out["single"] = {"prompts": len(results), "max_tokens": s.single_tokens,
                         **summarize(results, time.perf_counter() - start)}
    if "tabs" in s.scenarios:
        conversations = [[Message("user", QUESTIONS[i % len(QUESTIONS)])] for i in range(s.tabs)]
        results, wall = await run_tabs(backend, conversations, SamplingParams(max_tokens=s.tab_tokens), s.stagger_ms / 1000)
        out["tabs"] = {"tabs": s.tabs, "stagger_ms": s.stagger_ms, "max_tokens": s.tab_tokens, **summarize(results, wall)}
    if "multiturn" in s.scenarios:
        history: list[Message] = []
        turns = []
        for user in [FIRST_TURN] + [FOLLOW_UPS[i % len(FOLLOW_UPS)] for i in range(s.turns - 1)]:
            history.append(Message("user", user))
            result = await stream_once(backend, "multiturn", list(history), SamplingParams(max_tokens=s.turn_tokens))
            history.append(Message("assistant", result.text))
            turns.append({"prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens,
                          "ttft_ms": result.ttft_ms})
        out["multiturn"] = {"turns": turns, "max_tokens": s.turn_tokens}
    await backend.close()
    return name, out


def main(settings: BenchSettings, backend: Backend, model: str, endpoint: str, as_json: bool, out: TextIO) -> dict:
    name, scenarios = asyncio.run(_measure(settings, backend, model))
    skipped = [n for n in settings.scenarios if n not in REMOTE_SCENARIOS]
    notes = ["timed on this client over HTTP, as the TUI sees it (network and the server's load included)"]
    if skipped:
        notes.append(f"skipped on a remote engine: {', '.join(skipped)} (they compare tuichat's own engine settings)")
    if settings.peers:
        notes.append(f"peers skipped: {', '.join(settings.peers)} (they run beside tuichat's engine in this process)")
    result = {"model": name, "endpoint": endpoint, "scenarios": scenarios, "notes": notes}
    out.write(json.dumps(result) + "\n" if as_json else render(result) + "\n")
    out.flush()
    return result


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f} ms"


def render(result: dict[str, Any]) -> str:
    lines = [f"tuichat bench · {result['model']} at {result['endpoint']}"]
    scenarios = result["scenarios"]
    if "single" in scenarios:
        r = scenarios["single"]
        decode = f"{1000 / r['tpot_ms_p50']:.1f} tok/s" if r["tpot_ms_p50"] else "-"
        lines.append(f"single · {r['prompts']} prompts, ≤{r['max_tokens']} tokens: TTFT p50 {_ms(r['ttft_ms_p50'])} · "
                     f"ITL p50 {_ms(r['itl_ms_p50'])} · decode {decode}")
    if "tabs" in scenarios:
        r = scenarios["tabs"]
        lines.append(f"tabs · {r['tabs']} conversations, {r['stagger_ms']:g} ms apart, ≤{r['max_tokens']} tokens: "
                     f"{r['tokens_per_s']:.1f} tok/s · TTFT p50 {_ms(r['ttft_ms_p50'])} p90 {_ms(r['ttft_ms_p90'])} · "
                     f"ITL p50 {_ms(r['itl_ms_p50'])} p90 {_ms(r['itl_ms_p90'])}")
    if "multiturn" in scenarios:
        lines.append(f"multiturn · replies ≤{scenarios['multiturn']['max_tokens']} tokens (cached: the server's usage)")
        for k, turn in enumerate(scenarios["multiturn"]["turns"], 1):
            share = turn["cached_tokens"] / turn["prompt_tokens"] if turn["prompt_tokens"] else 0.0
            lines.append(f"  turn {k}: {turn['prompt_tokens']} prompt tokens, {turn['cached_tokens']} cached "
                         f"({share:.0%}), TTFT {_ms(turn['ttft_ms'])}")
    lines += [f"note: {note}" for note in result["notes"]]
    return "\n".join(lines)
