"""TTFT of a turn after a long history (issue: a conversation's TTFT at any length), through LocalBackend:

- warm: a 10-token message after the history, whose previous turn ran on this engine (its KV in the pool);
- restarted: a new backend (a quit and a start), the history's KV read back from the cache dir (kv_disk.py);
- restarted, no disk: the same with the KV's second tier off (kv_disk_mb=0): the whole history prefilled;
- short: a 10-token message opening a new conversation, for scale;
- typed: a ~300-token message after the history, prefilled while typed (LocalBackend.prefill of all but its
  last few words, as a pause in typing would), then sent whole; and the same message with no prefill.

    .venv/bin/python scripts/context_ttft.py [--model SPEC] [--history 3000] [--runs 3]

The history is built from filler turns (its replies written, not generated); the model's load is not timed.
The cache dir is a temporary one, so nothing earlier is read back.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile


async def ttft(backend, conversation: str, messages, model: str) -> tuple[float, int, int]:
    from tuichat.backends.protocol import SamplingParams

    usage = None
    async for event in backend.stream(conversation, messages, SamplingParams(max_tokens=1), model):
        usage = event.usage
    return usage.ttft_ms, usage.prompt_tokens, usage.restored_tokens


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--history", type=int, default=3000, help="tokens of history, about")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    os.environ["TUICHAT_CACHE_DIR"] = tempfile.mkdtemp(prefix="tuichat-ttft-")
    from tuichat.backends.local import LocalBackend
    from tuichat.backends.protocol import EngineOptions, Message

    words = "the quick brown fox jumps over the lazy dog while the river runs past the old mill".split()
    history: list[Message] = []
    while sum(len(m.content.split()) for m in history) * 1.3 < args.history:
        n = len(history) // 2
        history += [Message("user", f"Turn {n}: " + " ".join(words[(n + i) % len(words)] for i in range(120))),
                    Message("assistant", f"Answer {n}: " + " ".join(words[(n * 3 + i) % len(words)] for i in range(120)))]
    rows = {"warm": [], "restarted (KV from disk)": [], "restarted, no disk": [], "short (10 tokens)": [],
            "typed 300 tokens, prefilled": [], "typed 300 tokens, no prefill": []}
    for run in range(args.runs):
        question = [Message("user", f"Question {run}: what happened next?")]
        backend = LocalBackend(EngineOptions(), args.model)
        name = await backend.load(args.model)
        await ttft(backend, f"c{run}", history[:-1], name)  # the conversation so far, run once
        rows["warm"].append(await ttft(backend, f"c{run}", history + question, name))
        rows["short (10 tokens)"].append(await ttft(backend, f"s{run}", [Message("user", f"Hi there {run}, how are you?")], name))
        for label, prefilled in (("typed 300 tokens, prefilled", True), ("typed 300 tokens, no prefill", False)):
            # Its own words each time: nothing of it is in the prefix cache but what its prefill put there.
            long = f"{label} {run}: " + " ".join(words[(run * 7 + i * (2 + prefilled)) % len(words)] for i in range(230))
            conversation = f"t{run}{prefilled}"
            await ttft(backend, conversation, history[:-1], name)  # the history, run as its turns ran
            if prefilled:  # the pause before the last few words
                await backend.prefill(conversation, [*history, Message("user", long.rsplit(" ", 5)[0])], name)
            rows[label].append(await ttft(backend, conversation, [*history, Message("user", long)], name))
        await backend.close()  # its KV to disk
        for label, disk in (("restarted (KV from disk)", 2048), ("restarted, no disk", 0)):
            again = LocalBackend(EngineOptions(kv_disk_mb=disk), args.model)
            await again.load(args.model)
            rows[label].append(await ttft(again, f"c{run}", history + question, name))
            await again.close()
    for label, values in rows.items():
        median = statistics.median(v[0] for v in values)
        print(f"{label:28s} TTFT {median:8.1f} ms (median of {len(values)}: "
              f"{', '.join(f'{v[0]:.0f}' for v in values)}) · prompt {values[0][1]} tokens, "
              f"{values[0][2]} read back from disk")


if __name__ == "__main__":
    asyncio.run(main())
