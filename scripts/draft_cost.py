"""What verifying a draft costs: a step's time at R rows against the tokens each row computes.

    python scripts/draft_cost.py [--model smollm2-135m] [--quant auto] [--rows 1,8] [--lengths 1,2,3,4,6,8]

Each row is one sequence in decode; L tokens a row is the shape of a verify chunk (a draft of L - 1 tokens
and the token after it), built here from tokens already in the cache. For each L it prints the step's
median time and its ratio to the one-token step: the tokens a row must gain from each step for drafts of
that length to pay. `best` is what speculation could give at that length if every drafted token were kept
(L ÷ the ratio): where it is under 1, no draft of that length pays even when it is always right, and auto
(engine.py `_propose`) should not draft.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quant", default="auto")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--lengths", default="1,2,3,4,6,8")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()

    from tuichat import catalog
    from tuichat.backend import SamplingParams
    from tuichat.engine import loader
    from tuichat.engine.engine import Engine, EngineConfig
    from tuichat.engine.runner import StepChunk

    resolved = catalog.resolve(args.model)
    device = loader.resolve_device("auto")
    weights, tokenizer = loader.load(resolved, device, loader.resolve_dtype(args.dtype, device, loader.family(resolved)))
    engine = Engine(weights, tokenizer, EngineConfig(quant=args.quant, speculate="off"), name=resolved.name,
                    source=resolved)
    lengths = [int(n) for n in args.lengths.split(",")]
    print(f"{resolved.name} · {engine.weights} · {engine.layers}")
    for rows in (int(n) for n in args.rows.split(",")):
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me a long story, number {i}."}],
                                                 add_generation_prompt=True, return_dict=True)["input_ids"]
                   for i in range(rows)]
        seqs = [engine.submit(p, SamplingParams(max_tokens=max(lengths) + args.steps + 64)) for p in prompts]
        while any(s.num_uncomputed > 1 for s in seqs) or len(seqs[0]) - seqs[0].num_prompt_tokens < max(lengths) + 1:
            engine.step()
        one = None
        for length in lengths:
            # The last `length` tokens before each row's newest, computed again in place: their K/V is rewritten
            # with the same values, so the rows stay as they were.
            chunks = [StepChunk(s.token_ids[s.num_computed - length : s.num_computed], s.num_computed - length,
                                s.block_table, True, length) for s in seqs]
            times = []
            for _ in range(args.steps + 5):
                started = time.perf_counter()
                engine.runner.execute(chunks)
                times.append(time.perf_counter() - started)
            ms = statistics.median(times[5:]) * 1e3
            one = one or ms
            print(f"rows {rows}  tokens a row {length}  step {ms:6.2f} ms  ÷ one-token step {ms / one:4.2f}  "
                  f"best {length / (ms / one):4.2f}×")
        for seq in seqs:
            engine.cancel(seq.id)
        engine.step()
    engine.close()


if __name__ == "__main__":
    main()
