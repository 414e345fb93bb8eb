"""Concurrent streams through `tuichat serve` and llama.cpp's `llama-server` on the same GGUF file, one server at
a time, each in its own process on loopback: start to ready, aggregate tok/s, TTFT, and each server's RSS after
the streams. The bench's `tabs` scenario over the same two peers (bench/peers), without the bench's in-process
transformers model, which a real-size file would convert to bf16 first.

    python scripts/serve_vs_llama.py FILE.gguf --llama-server PATH [--streams 8] [--max-tokens 64] [--json]

Greedy replies of at most --max-tokens to distinct questions, all sent at once; speculation off in tuichat (a
random-weight file's replies give it nothing to draft from), llama-server with --streams slots of 2048 tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three fruits.",
             "Explain photosynthesis in one sentence.", "What is 17 times 23?", "Name a famous painter.",
             "Why is the sky blue?", "Give me a synonym for happy.", "How do magnets work?",
             "Translate 'good morning' to Spanish.", "What is a prime number?", "Describe a cat in five words."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--llama-server", required=True, help="the llama-server binary (built apart)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch

    from tuichat.backends.local import chat_ids
    from tuichat.backends.protocol import EngineOptions, Message
    from tuichat.bench.peers.llama_server import LlamaServerPeer
    from tuichat.bench.peers.serve import ServePeer
    from tuichat.bench.stats import summarize
    from tuichat.engine.gguf_file import GGUFFile, config_and_tokenizer
    from tuichat.engine.loader import metadata_cache

    conversations = [[Message("user", QUESTIONS[i % len(QUESTIONS)])] for i in range(args.streams)]
    warmup = [Message("user", "Hello")]
    results = {}
    serve = ServePeer(str(args.gguf), EngineOptions(speculate="off"), warmup, args.streams)
    try:
        summary = summarize(*serve.tabs(conversations, args.max_tokens, 0.0))
        results["tuichat serve"] = {**summary, "ready_s": serve.ready_s, **(serve.memory() or {})}
    finally:
        serve.close()
    file = GGUFFile(args.gguf)
    _, tokenizer = config_and_tokenizer(file, metadata_cache())
    file.close()
    prompts = [chat_ids(tokenizer, c) for c in conversations]
    llama = LlamaServerPeer(args.llama_server, str(args.gguf), torch.get_num_threads(), args.streams, 2048,
                            chat_ids(tokenizer, warmup))
    try:
        summary = summarize(*llama.tabs(prompts, args.max_tokens, 0.0))
        results["llama-server"] = {**summary, "ready_s": llama.ready_s, **(llama.memory() or {})}
    finally:
        llama.close()
    if args.json:
        json.dump(results, sys.stdout, indent=1)
        return
    print(f"{args.gguf.name} · {args.streams} streams at once · ≤ {args.max_tokens} tokens each")
    print(f"{'':15} {'ready s':>8} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p90':>9} {'tokens':>7} {'RSS MB':>8} {'peak MB':>8}")
    for name, r in results.items():
        print(f"{name:15} {r['ready_s']:8.1f} {r['tokens_per_s']:8.1f} {r['ttft_ms_p50']:9.0f} {r['ttft_ms_p90']:9.0f} "
              f"{r['output_tokens']:7d} {r.get('rss_mb', 0):8.0f} {r.get('peak_rss_mb', 0):8.0f}")
    ours, theirs = results["tuichat serve"]["tokens_per_s"], results["llama-server"]["tokens_per_s"]
    print(f"tuichat ÷ llama-server, tok/s: {ours / theirs:.2f}×")


if __name__ == "__main__":
    main()
