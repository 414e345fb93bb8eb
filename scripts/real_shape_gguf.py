"""Makes a GGUF file of a real model's shape with random weights, the way users' files are made: a transformers
checkpoint converted by llama.cpp's own convert_hf_to_gguf.py and quantized by its llama-quantize. The text it
writes is noise; the cost of a token, the memory and the load time are a real model's.

    python scripts/real_shape_gguf.py --shape llama-1b --quant Q4_K_M --llama-cpp DIR [--out FOLDER]

DIR is what ../shared/baselines/build_llama_cpp.sh DIR built (its llama.cpp sources and build/bin); the converter
also wants `sentencepiece` in this Python (`pip install sentencepiece`: a tool's need, not tuichat's). The tokenizer
is the embedded model's (SmolLM2's, from its GGUF); the vocabulary keeps the real model's size (the converter
pads it, or this script pads the tokenizer with unreachable tokens), so the embedding and the output layer cost
what the real ones do.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The layer shapes of the models users run most (their public config.json), by family and size.
SHAPES: dict[str, dict] = {
    "llama-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                     rope_theta=500000.0, tie_word_embeddings=True, max_position_embeddings=131072,
                     rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama-3b": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                     num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                     rope_theta=500000.0, tie_word_embeddings=True, max_position_embeddings=131072,
                     rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                     rope_theta=500000.0, tie_word_embeddings=False, max_position_embeddings=131072,
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=40960),
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=40960),
    "gemma3-1b": dict(model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                      sliding_window=512, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                      query_pre_attn_scalar=256, max_position_embeddings=32768, tie_word_embeddings=True),
}


def checkpoint(shape: str, folder: Path) -> None:
    """A transformers folder of the shape, random weights in bf16, with the embedded model's tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tuichat.catalog import embedded_gguf

    gguf = embedded_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    fields = dict(SHAPES[shape])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    pad_vocabulary(folder / "tokenizer.json", config.vocab_size)


def pad_vocabulary(path: Path, size: int) -> None:
    """Unreachable tokens appended to the tokenizer up to the model's vocabulary size: converters that cut the
    embedding to the tokenizer's length (Gemma 3's) then keep every row, as the real model's file has them."""
    import json

    data = json.loads(path.read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    used = max([*vocab.values(), *(token["id"] for token in data["added_tokens"])]) + 1
    vocab.update({f"<unused{i}>": used + i for i in range(size - used)})
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--quant", default="Q4_K_M", help="llama-quantize's type (Q4_K_M, Q4_0, Q8_0, ...) or F16")
    parser.add_argument("--llama-cpp", type=Path, required=True, help="the folder build_llama_cpp.sh built")
    parser.add_argument("--out", type=Path, default=Path("."), help="where the .gguf goes")
    args = parser.parse_args()
    sources = next(args.llama_cpp.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
    quantize = args.llama_cpp / "build" / "bin" / "llama-quantize"
    if sources is None or not quantize.exists():
        sys.exit(f"{args.llama_cpp}: no llama.cpp build there (run ../shared/baselines/build_llama_cpp.sh DIR)")
    try:
        import sentencepiece  # noqa: F401  (the converter imports it for llama-family vocabularies)
    except ImportError:
        sys.exit("llama.cpp's converter needs sentencepiece: pip install sentencepiece")
    args.out.mkdir(parents=True, exist_ok=True)
    final = args.out / f"{args.shape}-{args.quant}.gguf"
    with tempfile.TemporaryDirectory(dir=args.out) as work:
        folder, f16 = Path(work) / "hf", Path(work) / "f16.gguf"
        checkpoint(args.shape, folder)
        env = {**os.environ, "PYTHONPATH": str(sources / "gguf-py")}
        subprocess.run([sys.executable, str(sources / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f16",
                        "--outfile", str(f16)], check=True, env=env)
        if args.quant.upper() == "F16":
            shutil.move(f16, final)
        else:
            env = {**os.environ, "LD_LIBRARY_PATH": str(quantize.parent)}
            subprocess.run([str(quantize), str(f16), str(final), args.quant], check=True, env=env,
                           stdout=subprocess.DEVNULL)
    print(final)


if __name__ == "__main__":
    main()
