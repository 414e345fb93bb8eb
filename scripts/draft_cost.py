"""What verifying a draft costs: a step's time at R rows against the tokens each row computes.

    python scripts/draft_cost.py [--model smollm2-135m] [--quant auto] [--rows 1,8] [--lengths 1,2,3,4,6,8]

Each row is one sequence in decode; L tokens a row is the shape of a verify chunk (a draft of L - 1 tokens
and the token after it), built here from tokens already in the cache. For each L it prints the step's
median time and its ratio to the one-token step: the tokens a row must gain from each step for drafts of
that length to pay. `best` is what speculation could give at that length if every drafted token were kept
(L ÷ the ratio): where it is under 1, no draft of that length pays even when it is always right, and auto
(engine.py `_propose`) should not draft. `GMAC/s` is the step's multiply-adds (each token through every
linear) per second; with `--peak` the script also times a loop of nothing but AVX-512 VNNI dot products on
every core, the most int8 multiply-adds this CPU does: where the step's rate reaches it, no kernel makes
those rows cheaper.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time

# 24 independent accumulators per thread: enough to hide the instruction's latency. Built with -O3: at -O2 GCC keeps
# them in memory (a store and a load around every dot product), which halves the rate.
PEAK_LOOP = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
int main(void) {
    const long iterations = 20000000;
    double started = omp_get_wtime();
    int threads = 1, sink = 0;
    #pragma omp parallel reduction(+ : sink)
    {
        __m512i acc[24], u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(5);
        for (int i = 0; i < 24; i++) acc[i] = _mm512_set1_epi32(i);
        for (long n = 0; n < iterations; n++) {
            for (int i = 0; i < 24; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], u, s);
            __asm__ volatile("" : "+v"(u));
        }
        for (int i = 0; i < 24; i++) sink += _mm512_reduce_add_epi32(acc[i]);
        #pragma omp single
        threads = omp_get_num_threads();
    }
    printf("%f %d\n", iterations * 24.0 * 64 * threads / (omp_get_wtime() - started) / 1e9, sink & 1);
    return 0;
}
"""


def vnni_peak() -> str:
    """GMAC/s of the loop above on every core, or why it could not run."""
    with tempfile.TemporaryDirectory() as folder:
        source, binary = os.path.join(folder, "peak.c"), os.path.join(folder, "peak")
        with open(source, "w") as f:
            f.write(PEAK_LOOP)
        from tuichat.engine.cpu import build

        built = subprocess.run([build._compiler() or "cc", "-O3", "-march=native", "-fopenmp", source, "-o", binary],
                               capture_output=True, text=True)
        if built.returncode:
            return "not built (needs cc and AVX-512 VNNI): " + built.stderr.strip().splitlines()[-1]
        return f"{float(subprocess.run([binary], capture_output=True, text=True, check=True).stdout.split()[0]):.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quant", default="auto")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--lengths", default="1,2,3,4,6,8")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--peak", action="store_true", help="also time the CPU's own int8 dot-product rate")
    args = parser.parse_args()

    import torch

    from tuichat import catalog
    from tuichat.backends.protocol import SamplingParams
    from tuichat.engine import loader
    from tuichat.engine.engine import Engine, EngineConfig
    from tuichat.engine.runner import StepChunk

    resolved = catalog.resolve(args.model)
    device = loader.resolve_device("auto")
    weights, tokenizer = loader.load(resolved, device, loader.resolve_dtype(args.dtype, device, loader.family(resolved)))
    macs = sum(m.in_features * m.out_features for m in weights.modules() if isinstance(m, torch.nn.Linear))
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
                  f"best {length / (ms / one):4.2f}×  {rows * length * macs / ms / 1e6:5.0f} GMAC/s")
        for seq in seqs:
            engine.cancel(seq.id)
        engine.step()
    engine.close()
    if args.peak:
        print(f"VNNI dot products alone, every core: {vnni_peak()} GMAC/s")


if __name__ == "__main__":
    main()
