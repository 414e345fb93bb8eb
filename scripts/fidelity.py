"""How close each way of serving a model stays to its float32 self: teacher-forced argmax agreement.

    python scripts/fidelity.py [--model smollm2-135m | FOLDER] [--quant none,auto,int8,int4]
                               [--int4 q4_1/q8_0,q4_0/q8_0] [--prompts 64] [--tokens 48] [--llama-server PATH]

The float32 model (transformers, a plain forward) writes a greedy continuation of each held chat prompt; then
each way is fed the very same tokens (teacher forcing: prompt as one prefill, then one decode step per token)
and scores, at each position, whether its argmax is float32's; and, less noisy than a count of flips, how far
its log-probability of float32's choice is off (|log p(top) error|: llama.cpp's from its top-50 log-probs)
and, where all the logits are at hand, its KL divergence from float32:
- transformers bf16: the model's own bf16 forward;
- tuichat, once per --quant mode (default none,auto): none is bf16 (C layers where they run), auto a GGUF's
  own blocks, served from the file where LocalBackend would (int8 dot products), int8 / int4 a dense model's linears quantized at load (Q8_0; Q4_1
  with a Q8_0 lm_head; --int4 measures other blocks, int4 once for each), each with the seconds its engine
  took to start (the quantization, or reading the cache it wrote the first time: run twice for both);
- llama.cpp: the same GGUF through `llama-server` (its own process), one greedy token per position, its
  prompt cache keeping the rest: teacher forcing by request. Skipped when no llama-server is given or found.
A float32 argmax with a near tie is within noise of any of them: a position counts only when float32's top
two logits differ by more than `--margin` (default 0), and the count of positions is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

CHATS = [
    "What is the capital of France?", "Write a haiku about the sea.", "List three fruits.",
    "Explain photosynthesis briefly.", "How do I reverse a list in Python?", "Tell me a joke about cats.",
    "What is 17 times 23?", "Name the planets of the solar system.", "Why is the sky blue?",
    "Translate 'good morning' into Spanish.", "Give me a recipe for pancakes.", "What causes earthquakes?",
    "Describe a sunset in two sentences.", "What is a prime number?", "Suggest a name for a black cat.",
    "How far away is the Moon?", "Write a limerick about a frog.", "What does a compiler do?",
    "Summarize the plot of Cinderella.", "How do vaccines work?", "What is the boiling point of water?",
    "Write a short poem about autumn leaves.", "How do I make a cup of tea?", "What is the difference between weather and climate?",
    "Give three tips for better sleep.", "Who wrote Romeo and Juliet?", "Explain what a black hole is.",
    "How many legs does a spider have?", "Write a tweet about coffee.", "What is the largest ocean on Earth?",
    "How do airplanes stay in the air?", "Describe your ideal weekend.", "What is machine learning?",
    "Suggest a gift for a friend who loves books.", "How do bees make honey?", "What is the square root of 144?",
    "Write a thank-you note to a teacher.", "Why do leaves change color in the fall?", "What are the primary colors?",
    "How do I boil an egg?", "Tell me a fun fact about octopuses.", "What is democracy?", "Explain gravity to a child.",
    "What should I pack for a beach trip?", "Write a two-line rhyme about rain.", "What is the speed of light?",
    "How does a refrigerator work?", "Name five animals that live in the Arctic.", "What is an adjective?",
    "Give me a motivational quote.", "How do I start learning to play guitar?", "What is the tallest mountain in the world?",
    "Explain the water cycle.", "Write a short story opening about a dragon.", "What does DNA stand for?",
    "How can I save money on groceries?", "What is the capital of Japan?", "Why do cats purr?",
    "Describe the taste of a lemon.", "What is a noun?", "How do plants grow from seeds?",
    "Write a riddle about time.", "What is the main ingredient in guacamole?", "How does the internet work?",
]


def engine_argmax(engine, sequences):
    """Per sequence: (argmax ids, logits) at each continuation position, through the engine's serving path."""
    import torch

    from tuichat.engine.runner import StepChunk

    out = []
    for prompt, full in sequences:
        blocks = list(range((len(full) + engine.config.block_size - 1) // engine.config.block_size))
        logits = [engine.runner.execute([StepChunk(prompt, 0, blocks, True)])]
        logits += [engine.runner.execute([StepChunk([full[i]], i, blocks, True)]) for i in range(len(prompt), len(full) - 1)]
        out.append(torch.cat(logits).float())
    return out


def llama_server_argmax(binary: str, gguf: str, sequences, threads: int, wanted, eos: int):
    """Per sequence: llama.cpp's greedy next token at each continuation position, and its log-prob of the token
    `wanted` there (float32's argmax; NaN when outside its top 50, or after an end of text)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(binary))
    server = subprocess.Popen([binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
                               "-c", "4096", "-np", "1", "--no-warmup"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("llama-server did not come up")
            time.sleep(0.2)
        out, tops = [], []
        for (prompt, full), want in zip(sequences, wanted):
            picks, top = [], []
            for i in range(len(prompt), len(full)):
                # n_probs: log-probs of the raw logits (before sampling), as llama.cpp computes them.
                body = json.dumps({"prompt": full[:i], "n_predict": 1, "temperature": 0, "top_k": 1, "n_probs": 50,
                                   "cache_prompt": True, "return_tokens": True}).encode()
                request = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=60) as r:
                    reply = json.loads(r.read())
                # An end of text ends the reply before it is sent: no token and no log-probs come back.
                picks.append(reply["tokens"][0] if reply["tokens"] else eos if reply.get("stop_type") == "eos" else -1)
                candidates = (reply.get("completion_probabilities") or [{}])[0].get("top_logprobs", [])
                top.append(next((c["logprob"] for c in candidates if c["id"] == want[i - len(prompt)]), float("nan")))
            out.append(picks)
            tops.append(top)
        return out, tops
    finally:
        server.terminate()
        server.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=len(CHATS))
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--margin", type=float, default=0.0)
    parser.add_argument("--quant", default="none,auto", help="comma-separated --quant modes to serve")
    parser.add_argument("--int4", default=None,
                        help="int4 once per comma-separated LINEARS[/HEAD] blocks, e.g. q4_0/q8_0,q4_1/q4_1")
    parser.add_argument("--llama-server", default=os.environ.get("TUICHAT_LLAMA_SERVER") or shutil.which("llama-server"))
    args = parser.parse_args()

    import torch

    from tuichat import catalog
    from tuichat.engine import loader, quant
    from tuichat.engine.cpu import build
    from tuichat.engine.engine import Engine, EngineConfig

    modes = args.quant.split(",")
    if not set(modes) <= {"auto", "none", "int8", "int4"}:
        parser.error(f"--quant takes auto, none, int8 and int4, not {args.quant}")
    formats = {"q4_0": 2, "q4_1": 3, "q8_0": 8}
    int4 = [quant.QUANT_FORMATS["int4"]]
    if args.int4:
        int4 = [(formats[v.partition("/")[0]], formats[v.partition("/")[2] or v.partition("/")[0]])
                for v in args.int4.lower().split(",")]
        modes = [m for mode in modes for m in ([mode] if mode != "int4" else ["int4"] * len(int4))]
    build.load()  # built before any engine is timed
    torch.manual_seed(0)
    resolved = catalog.resolve(args.model)
    cpu = torch.device("cpu")
    reference, tokenizer = loader.load(resolved, cpu, torch.float32)
    chats = [CHATS[i % len(CHATS)] for i in range(args.prompts)]
    sequences, ref_logits = [], []
    with torch.inference_mode():
        for chat in chats:
            prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": chat}], add_generation_prompt=True,
                                                        return_dict=True)["input_ids"])
            full = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                      max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                                      pad_token_id=0)[0].tolist()
            sequences.append((prompt, full))
            ref_logits.append(reference(torch.tensor([full])).logits[0, len(prompt) - 1:-1].float().log_softmax(-1))
        counted = []
        for logits in ref_logits:
            top2 = logits.topk(2).values
            counted.append((top2[:, 0] - top2[:, 1]) > args.margin)
    positions = int(sum(c.sum() for c in counted))

    def score(name: str, picks, logprobs=None, top_logprob=None, note: str = "") -> None:
        """picks: argmax ids per sequence; logprobs: full log-softmax rows (KL and the top token's log-prob error
        come from them), or top_logprob: per sequence, each position's log-prob of float32's argmax."""
        agree = sum(int(((p == r.argmax(-1)) & c).sum()) for p, r, c in zip(picks, ref_logits, counted))
        wanted = [r.max(-1).values for r in ref_logits]
        if logprobs is not None:
            kl = torch.cat([(r.exp() * (r - l)).sum(-1) for l, r in zip(logprobs, ref_logits)]).mean()
            top_logprob = [l.gather(-1, r.argmax(-1, keepdim=True))[:, 0] for l, r in zip(logprobs, ref_logits)]
        off = torch.cat([(t - w).abs() for t, w in zip(top_logprob, wanted)]).nanmean()
        error = f"  |log p(top) error| {off:.4f}" + ("" if logprobs is None else f"  KL {kl:.5f}")
        print(f"{name:<36} {100 * agree / positions:6.2f} % argmax agreement{error}{note}")

    print(f"{args.model}: {len(sequences)} prompts x {args.tokens} float32 greedy tokens; {positions} positions "
          f"(float32 top-2 gap > {args.margin})")
    score("float32 (reference)", [r.argmax(-1) for r in ref_logits], ref_logits)
    with torch.inference_mode():
        bf16 = reference.to(torch.bfloat16)
        logits = [bf16(torch.tensor([full])).logits[0, len(prompt) - 1:-1].float().log_softmax(-1) for prompt, full in sequences]
        score("transformers bf16", [l.argmax(-1) for l in logits], logits)
        del bf16, reference
    for i, mode in enumerate(modes):
        if mode == "int4":
            quant.QUANT_FORMATS["int4"] = int4[modes[:i].count("int4")]
        dtype = loader.resolve_dtype("auto", cpu, loader.family(resolved), resolved.kind == "gguf")
        in_place = loader.in_place(resolved, cpu, dtype, mode)  # a GGUF served from its file, as LocalBackend does
        model, _ = loader.load(resolved, cpu, dtype, with_tokenizer=False, mapped=in_place)
        config = EngineConfig(quant=mode, prefix_cache=False, quant_cache=loader.quant_cache(resolved, mode),
                              quant_source=loader.checkpoint_dir(resolved))  # as LocalBackend does
        started = time.perf_counter()
        engine = Engine(model, tokenizer, config, name=resolved.name, source=resolved)
        ready = time.perf_counter() - started
        with torch.inference_mode():
            logits = [l.log_softmax(-1) for l in engine_argmax(engine, sequences)]
        score(f"tuichat {mode}: {engine.weights}", [l.argmax(-1) for l in logits], logits,
              note=f"  (layers {engine.layers}; {engine.weight_bytes / 1e6:.0f} MB a step; engine ready in {ready:.1f} s)")
        engine.close()
    if resolved.kind == "gguf" and args.llama_server:
        picks, top = llama_server_argmax(args.llama_server, resolved.source, sequences, torch.get_num_threads(),
                                         [r.argmax(-1).tolist() for r in ref_logits], tokenizer.eos_token_id)
        score("llama.cpp (same GGUF)", [torch.tensor(p) for p in picks], top_logprob=[torch.tensor(t) for t in top])
    else:
        print("llama.cpp: skipped (no llama-server: --llama-server PATH or TUICHAT_LLAMA_SERVER)", file=sys.stderr)


if __name__ == "__main__":
    main()
