"""GPU check for tuichat, sized for one call of at most 5 minutes on a one-GPU machine.

    python scripts/gpu_check.py [--device cuda] [--out DIR]

1. Correctness on the device: tiny random Llama and Qwen2 models (float32), engine greedy output against
   transformers `generate` on the same device, with 8 staggered requests, chunked prefill and prefix hits.
2. Speed: the SmolLM2-135M architecture (the embedded model's config, random bf16 weights: timing does not
   depend on the weights, and the 98 MB GGUF cannot travel to a lent machine) — TTFT of a short chat prompt,
   single-stream decode tok/s, 8-tab aggregate tok/s, against transformers `generate` and a padded batch.
3. The accelerate device-map path: a saved tiny model loaded with device_map="auto", engine vs generate.
4. Tensor parallelism when 2+ GPUs are visible (skipped with a note otherwise).

Prints a JSON report (and writes it to --out/gpu_check.json). Runs on CPU too (`--device cpu`), which is
how it is exercised where no GPU is lent.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

# Run by path (python scripts/gpu_check.py), maybe where tuichat is not installed: the checkout's root holds it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tuichat.backends.protocol import SamplingParams
from tuichat.catalog import resolve
from tuichat.engine.engine import Engine, EngineConfig
from tuichat.engine.request import Status

SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)
# The tests' tiny llama shape (tests/helpers.py's TINY).
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(arch: str, params: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    config = config_cls(**params, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    reference = model_cls(copy.deepcopy(config)).to(device, dtype).eval()
    model = model_cls(copy.deepcopy(config)).to(device, dtype).eval()
    model.load_state_dict(reference.state_dict())
    return model, reference


def hf_greedy(model, prompt: list[int], n: int, device: torch.device) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts(lengths, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def check_correctness(device: torch.device) -> dict:
    report = {}
    for arch in ("llama", "qwen2"):
        model, reference = build(arch, TINY, device, torch.float32)
        engine = Engine(model, config=EngineConfig(num_blocks=128, max_batched_tokens=32))
        batch = prompts([3, 40, 17, 1, 64, 9, 33, 16], TINY["vocab_size"])
        seqs = []
        for p in batch:  # staggered arrivals; 32-token budget forces chunked prefill
            seqs.append(engine.submit(p, SamplingParams(max_tokens=16)))
            engine.step()
        shared = engine.submit(batch[4] + [5, 6, 7], SamplingParams(max_tokens=16))
        while any(s.status is not Status.FINISHED for s in seqs + [shared]):
            engine.step()
        matches = [s.completion_ids == hf_greedy(reference, p, 16, device) for p, s in zip(batch, seqs)]
        matches.append(shared.completion_ids == hf_greedy(reference, batch[4] + [5, 6, 7], 16, device))
        report[arch] = {"requests": len(matches), "identical": sum(matches), "prefix_hit_tokens": shared.num_cached_tokens}
    return report


def timed_generate(engine: Engine, batch: list[list[int]], max_tokens: int, device) -> dict:
    """Runs batch to completion on this thread; TTFT = submit -> first token sampled (synchronized)."""
    seqs = [engine.submit(p, SamplingParams(max_tokens=max_tokens)) for p in batch]
    first: dict[int, float] = {}
    start = time.perf_counter()
    while any(s.status is not Status.FINISHED for s in seqs):
        engine.step()
        sync(device)
        now = time.perf_counter()
        for s in seqs:
            if s.num_completion_tokens and s.id not in first:
                first[s.id] = now - start
    wall = time.perf_counter() - start
    generated = sum(s.num_completion_tokens for s in seqs)
    return {"wall_s": wall, "tokens": generated, "tokens_per_s": generated / wall,
            "ttft_ms": sorted(first.values())[len(first) // 2] * 1000}


def check_speed(device: torch.device, dtype: torch.dtype, new_tokens: int) -> dict:
    model, reference = build("llama", SMOLLM2_135M, device, dtype)
    engine = Engine(model, config=EngineConfig(kv_cache_mb=2048))
    chat = prompts([40], SMOLLM2_135M["vocab_size"], seed=3)[0]
    eight = prompts([40 + 7 * i for i in range(8)], SMOLLM2_135M["vocab_size"], seed=4)
    timed_generate(engine, [chat], 8, device)  # warm-up
    single = timed_generate(engine, [chat], new_tokens, device)
    engine.blocks.prefix_cache = False  # measure the cold TTFT, not a cache hit on the warm-up
    cold = timed_generate(engine, [chat], 1, device)
    engine.blocks.prefix_cache = True
    tabs = timed_generate(engine, eight, new_tokens, device)

    def hf(batch):
        ids = torch.tensor([[0] * (max(map(len, batch)) - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (ids.shape[1] - len(p)) + [1] * len(p) for p in batch], device=device)
        reference.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        sync(device)
        start = time.perf_counter()
        reference.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=0)
        sync(device)
        return len(batch) * new_tokens / (time.perf_counter() - start)

    return {
        "ttft_ms_cold": cold["ttft_ms"],
        "single_decode_tokens_per_s": single["tokens_per_s"],
        "tabs8_tokens_per_s": tabs["tokens_per_s"],
        "hf_generate_tokens_per_s": hf([chat]),
        "hf_static_batch8_tokens_per_s": hf(eight),
    }


def check_device_map(device: torch.device) -> dict:
    from transformers import AutoModelForCausalLM

    _, reference = build("llama", TINY, torch.device("cpu"), torch.float32)
    with tempfile.TemporaryDirectory() as folder:
        reference.save_pretrained(folder)
        spread = AutoModelForCausalLM.from_pretrained(folder, device_map="auto" if device.type == "cuda" else None)
        engine = Engine(spread.eval(), config=EngineConfig(num_blocks=64))
        prompt = prompts([21], TINY["vocab_size"], seed=5)[0]
        (seq,) = engine.generate([prompt], SamplingParams(max_tokens=16))
        expected = hf_greedy(reference, prompt, 16, torch.device("cpu"))
        return {"device_map": getattr(spread, "hf_device_map", None), "identical": seq.completion_ids == expected}


def check_tp(device: torch.device) -> dict:
    visible = torch.cuda.device_count() if device.type == "cuda" else 2
    if visible < 2:
        return {"skipped": f"{visible} GPU visible; tensor parallelism needs 2"}
    from transformers import AutoModelForCausalLM

    _, reference = build("llama", TINY, torch.device("cpu"), torch.float32)
    with tempfile.TemporaryDirectory() as folder:
        reference.save_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder).to(device).eval()
        engine = Engine(model, config=EngineConfig(num_blocks=64, tp=2), source=resolve(folder))
        try:
            prompt = prompts([30], TINY["vocab_size"], seed=6)[0]
            (seq,) = engine.generate([prompt], SamplingParams(max_tokens=16))
        finally:
            engine.close()
        return {"tp": 2, "identical": seq.completion_ids == hf_greedy(reference, prompt, 16, torch.device("cpu"))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per request in the speed check")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cpu" or torch.cuda.is_bf16_supported() else torch.float16
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__}
    for name, check in (("correctness", lambda: check_correctness(device)),
                        ("speed", lambda: check_speed(device, dtype, args.tokens)),
                        ("device_map", lambda: check_device_map(device)),
                        ("tensor_parallel", lambda: check_tp(device))):
        started = time.perf_counter()
        try:
            report[name] = check()
        except Exception as exc:  # report every section, even after one fails
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        report[name]["seconds"] = round(time.perf_counter() - started, 1)
        print(f"[gpu_check] {name}: {json.dumps(report[name])}", file=sys.stderr, flush=True)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_check.json").write_text(text)


if __name__ == "__main__":
    main()
