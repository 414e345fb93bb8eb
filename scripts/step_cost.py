"""What a decode step costs bare and as the product runs it, for batch 1 and 8.

    python scripts/step_cost.py [--model smollm2-135m] [--dtype auto] [--quant auto] [--steps 60] [--repeat 3]
                                [--sampled]

Three ways, each the median ITL over `--steps` decode steps:
- bare: Engine.step() called in a loop on the main thread, which loaded the model (the engine's own cost);
- thread: loaded on a thread that then ends, served by the engine thread, requests with plain callbacks;
- product: LocalBackend.stream consumed by an asyncio loop on the main thread, as `tuichat ask` and the TUI
  run it (adds the event loop, the GIL between the two threads, the per-token events).
Speculation is off in every way: a step is one token per sequence. Greedy, or with --sampled the chat's
default sampling (backend.CHAT_SAMPLING, what the TUI and `ask` use unless told otherwise), seeded. The grid
runs --repeat times, interleaved, and each cell is the median over the repeats: a shared machine drifts by
more than the gaps measured. Each way and each OpenMP wait policy (unset, ACTIVE, PASSIVE) runs in a fresh
process: libgomp reads the policy once, at start, and keeps a thread pool for every live thread that ran a
parallel region.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

PROMPT = "Write a long story about a cat who learns to fly."


def measure(way: str, model: str, dtype: str, quant: str, steps: int, sampled: bool) -> dict:
    import asyncio

    from tuichat import catalog
    from tuichat.backends.local import LocalBackend
    from tuichat.backends.protocol import CHAT_SAMPLING, EngineOptions, Message, SamplingParams
    from tuichat.engine import loader
    from tuichat.engine.engine import Engine, EngineConfig

    resolved = catalog.resolve(model)
    params = SamplingParams(max_tokens=steps + 4, **(dict(CHAT_SAMPLING, seed=1) if sampled else {}))
    out = {}

    def fresh() -> Engine:
        device = loader.resolve_device("auto")
        weights, tokenizer = loader.load(resolved, device, loader.resolve_dtype(dtype, device, loader.family(resolved)))
        return Engine(weights, tokenizer, EngineConfig(quant=quant, speculate="off"), name=resolved.name, source=resolved)

    def prompt_of(engine: Engine) -> list[int]:
        return engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                                    return_dict=True)["input_ids"]

    if way == "bare":  # loaded and stepped on the main thread: one OpenMP pool, the main thread's
        engine = fresh()
        out.update(weights=engine.weights, layers=engine.layers)
        for batch in (1, 8):
            seqs = [engine.submit(prompt_of(engine) + [i], params) for i in range(batch)]
            engine.step()
            gaps = []
            for _ in range(steps):
                started = time.perf_counter()
                engine.step()
                gaps.append(time.perf_counter() - started)
            out[f"bare b{batch}"] = statistics.median(gaps) * 1e3
            for seq in seqs:
                engine.cancel(seq.id)
            engine.step()
    elif way == "thread":  # loaded on a thread that ends, as LocalBackend loads; served by the engine thread
        box = {}
        loading = threading.Thread(target=lambda: box.update(engine=fresh()))
        loading.start()
        loading.join()
        engine = box["engine"]
        engine.start()
        for batch in (1, 8):
            finished = threading.Semaphore(0)
            times: list[list[float]] = [[] for _ in range(batch)]

            def collect(index):
                def on_output(o):
                    times[index].append(time.perf_counter())
                    if o.finished:
                        finished.release()
                return on_output

            for i in range(batch):
                engine.submit(prompt_of(engine) + [i], params, collect(i))
            for _ in range(batch):
                finished.acquire()
            out[f"thread b{batch}"] = statistics.median(b - a for t in times for a, b in zip(t[1:], t[2:])) * 1e3
        engine.close()
    else:  # the product: LocalBackend.stream consumed by an asyncio loop, as `tuichat ask` and the TUI run it
        product = LocalBackend(EngineOptions(dtype=dtype, quant=quant, speculate="off"), model)

        async def tabs(batch: int) -> float:
            async def one(i: int) -> list[float]:
                stamps = []
                async for event in product.stream(f"c{batch}-{i}", [Message("user", f"{PROMPT} ({i})")], params):
                    if event.text:
                        stamps.append(time.perf_counter())
                return stamps

            runs = await asyncio.gather(*(one(i) for i in range(batch)))
            return statistics.median(b - a for t in runs for a, b in zip(t[1:], t[2:])) * 1e3

        async def both():
            await product.load(model)
            for batch in (1, 8):
                out[f"product b{batch}"] = await tabs(batch)
            await product.close()

        asyncio.run(both())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quant", default="auto")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sampled", action="store_true", help="the chat's default sampling, not greedy")
    parser.add_argument("--child", choices=["bare", "thread", "product"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.model, args.dtype, args.quant, args.steps, args.sampled)))
        return
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeat):
        for policy in (None, "ACTIVE", "PASSIVE"):
            env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
            if policy:
                env["OMP_WAIT_POLICY"] = policy
            row = {}
            for way in ("bare", "thread", "product"):  # each in a fresh process: no pool left from another way
                result = subprocess.run([sys.executable, __file__, "--child", way, "--model", args.model, "--dtype",
                                         args.dtype, "--quant", args.quant, "--steps", str(args.steps),
                                         *(["--sampled"] if args.sampled else [])], env=env,
                                        capture_output=True, text=True)
                if result.returncode != 0:
                    sys.exit(result.stderr)
                row.update(json.loads(result.stdout.strip().splitlines()[-1]))
            runs.setdefault(policy or "unset", []).append(row)
    rows = [(policy, {k: (statistics.median(r[k] for r in repeats) if isinstance(repeats[0][k], float) else repeats[0][k])
                      for k in repeats[0]}) for policy, repeats in runs.items()]
    first = rows[0][1]
    columns = [k for k in first if k not in ("weights", "layers")]
    print(f"{args.model} · {first['weights']} weights · layers {first['layers']} · "
          f"{'sampled' if args.sampled else 'greedy'} · median ms per decode step (median of {args.repeat} runs)")
    print(f"{'OMP_WAIT_POLICY':<16}" + "".join(f"{k:>12}" for k in columns))
    for policy, row in rows:
        print(f"{policy:<16}" + "".join(f"{row[k]:>12.1f}" for k in columns))
    for policy, row in rows:
        print(f"{policy}: product ÷ bare: " + ", ".join(
            f"batch {b} {row[f'product b{b}'] / row[f'bare b{b}']:.2f}×" for b in (1, 8)))

if __name__ == "__main__":
    main()
