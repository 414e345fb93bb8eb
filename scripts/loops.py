"""How often a sampling setting makes a model loop, over everyday chat prompts.

    python scripts/loops.py [--model smollm2-135m] [--tokens 256] [--seeds 2]

Each candidate answers every prompt (all at once, batched by the engine), then each reply is counted as
looping when some run of 8 tokens occurs 3 or more times in it, and as cut when it reached --tokens. Sampled
candidates run once per seed. Prints one line per candidate.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tuichat.backends.protocol import EngineOptions, Message, SamplingParams
from tuichat.bench.backend import BenchBackend

PROMPTS = [
    "Write a haiku about the sea.", "What is the capital of France?", "Give me three tips for sleeping better.",
    "Explain what a black hole is to a child.", "Write a short poem about autumn.",
    "How do I boil an egg?", "What are the benefits of exercise?", "Tell me a joke about computers.",
    "Summarize the story of Cinderella in three sentences.", "What is photosynthesis?",
    "Write a thank-you note to a teacher.", "How can I learn to code?", "Name five animals that live in the ocean.",
    "What should I pack for a weekend trip?", "Explain why the sky is blue.", "Describe a sunset in two sentences.",
    "What is the difference between weather and climate?", "Give me a recipe for pancakes.",
    "Why do cats purr?", "Write a limerick about a dog.",
]
CANDIDATES = {
    "greedy (today's default)": dict(temperature=0.0),
    "greedy, frequency 0.5": dict(temperature=0.0, frequency_penalty=0.5),
    "greedy, presence 0.5": dict(temperature=0.0, presence_penalty=0.5),
    "temperature 0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "temperature 0.7, top_p 0.9, frequency 0.3": dict(temperature=0.7, top_p=0.9, frequency_penalty=0.3),
    "temperature 0.2, top_p 0.9 (SmolLM2's card)": dict(temperature=0.2, top_p=0.9),
    "temperature 0.2, top_p 0.9, frequency 0.3": dict(temperature=0.2, top_p=0.9, frequency_penalty=0.3),
    "temperature 0.2, top_p 0.9, frequency 0.5": dict(temperature=0.2, top_p=0.9, frequency_penalty=0.5),
    "temperature 0.5, top_p 0.9, frequency 0.3": dict(temperature=0.5, top_p=0.9, frequency_penalty=0.3),
}


def loops(ids: list[int], n: int = 8, times: int = 3) -> bool:
    counts: dict[tuple[int, ...], int] = {}
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i:i + n])
        counts[gram] = counts.get(gram, 0) + 1
        if counts[gram] >= times:
            return True
    return False


async def run(backend: BenchBackend, params: SamplingParams, tag: str) -> tuple[int, int, float]:
    async def one(i: int, prompt: str):
        events = [e async for e in backend.stream(f"{tag}-{i}", [Message("user", prompt)], params)]
        return (backend.cached_token_ids(f"{tag}-{i}")[events[-1].usage.prompt_tokens:], events[-1].usage,
                "".join(e.text for e in events))
    replies = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
    looped = sum(loops(ids) for ids, _, _ in replies)
    cut = sum(usage.finish_reason == "length" for _, usage, _ in replies)
    return looped, cut, statistics.median(usage.completion_tokens for _, usage, _ in replies), replies[0][2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--only", nargs="*", help="candidates whose name contains one of these")
    parser.add_argument("--show", action="store_true", help="print each candidate's reply to the first prompt")
    args = parser.parse_args()
    backend = BenchBackend(EngineOptions(prefix_cache=False), args.model)

    async def everything():
        await backend.load(args.model)
        print(f"{args.model}: {len(PROMPTS)} prompts, replies up to {args.tokens} tokens; looping = a run of 8 "
              "tokens 3+ times")
        for name, fields in CANDIDATES.items():
            if args.only and not any(o in name for o in args.only):
                continue
            seeds = [None] if fields["temperature"] == 0 else list(range(args.seeds))
            results = [await run(backend, SamplingParams(max_tokens=args.tokens, seed=seed, **fields), f"{name}-{seed}")
                       for seed in seeds]
            looped = sum(r[0] for r in results) / len(results)
            cut = sum(r[1] for r in results) / len(results)
            median = statistics.median(r[2] for r in results)
            print(f"{name:<46} looping {looped:4.1f} / {len(PROMPTS)}   cut {cut:4.1f}   median {median:.0f} tokens")
            if args.show:
                print("    " + results[0][3][:400].replace("\n", "\n    "))
        await backend.close()

    asyncio.run(everything())


if __name__ == "__main__":
    main()
