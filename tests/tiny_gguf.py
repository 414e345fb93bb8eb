"""A tiny llama GGUF written for the tests (test_gguf_engine, test_cli): a byte-level BPE tokenizer and linears in
the formats asked for, Q and K in llama.cpp's row order."""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 128, 256, 2, 4, 2, 32, 320
Q8_0, Q4_0, Q4_1 = 8, 2, 3
# q/k/v and gate/up are fused, so each group shares one format; the formats differ across layers and linears.
FORMATS = [dict(attn_q=Q8_0, attn_k=Q8_0, attn_v=Q8_0, attn_output=Q4_0, ffn_gate=Q4_1, ffn_up=Q4_1, ffn_down=Q8_0),
           dict(attn_q=Q4_1, attn_k=Q4_1, attn_v=Q4_1, attn_output=Q8_0, ffn_gate=Q4_0, ffn_up=Q4_0, ffn_down=Q4_1)]
OUTPUT_FORMAT = Q4_0
HF_NAMES = dict(attn_q="self_attn.q_proj", attn_k="self_attn.k_proj", attn_v="self_attn.v_proj",
                attn_output="self_attn.o_proj", ffn_gate="mlp.gate_proj", ffn_up="mlp.up_proj", ffn_down="mlp.down_proj")
Q5_0, Q5_1, Q4_K, Q5_K, Q6_K = 6, 7, 12, 13, 14
# The model of the re-cut formats (K-quants, and Q5_0/Q5_1, which llama.cpp's K-quant mixes fall back to for
# rows not a multiple of 256): superblocks of 256 need a hidden size of 256 (head_dim 64). Its lm_head is Q6_K,
# as a Q4_K_M file's output tensor is.
HIDDEN_K, INTER_K = 256, 512
# Layer 0's v has more bits than its q and k (as a Q4_K_M file's does in half its layers), layer 1's gate and up
# differ: those linears run part by part.
FORMATS_K = [dict(attn_q=Q4_K, attn_k=Q4_K, attn_v=Q6_K, attn_output=Q6_K, ffn_gate=Q4_K, ffn_up=Q4_K, ffn_down=Q5_K),
             dict(attn_q=Q5_K, attn_k=Q5_K, attn_v=Q5_K, attn_output=Q5_1, ffn_gate=Q6_K, ffn_up=Q5_0, ffn_down=Q5_0)]
OUTPUT_FORMAT_K = Q6_K


# Gemma 3: six layers (its pattern: five sliding-window layers, then a full one), heads of 256 dims as the real
# models' (wider than the hidden size), a window shorter than the prompts, RoPE scaled in its full layers only.
GEMMA_LAYERS, GEMMA_HEAD_DIM, GEMMA_WINDOW, GEMMA_ROPE_THETA, GEMMA_ROPE_FACTOR = 6, 256, 16, 1e6, 2.0


def shapes(hidden: int, inter: int, head_dim: int | None = None) -> dict[str, tuple[int, int]]:
    head_dim = head_dim or hidden // HEADS
    return dict(attn_q=(HEADS * head_dim, hidden), attn_k=(KV_HEADS * head_dim, hidden), attn_v=(KV_HEADS * head_dim, hidden),
                attn_output=(hidden, HEADS * head_dim), ffn_gate=(inter, hidden), ffn_up=(inter, hidden), ffn_down=(hidden, inter))


def k_quant_blocks(rng, rows: int, columns: int, qtype: int) -> np.ndarray:
    """Random Q4_K / Q5_K / Q6_K superblocks (gguf writes no K-quants): every byte random but the fp16 scales,
    chosen so that the weights come out about zero-mean with a spread of ~0.1."""
    size = {Q4_K: 144, Q5_K: 176, Q6_K: 210}[qtype]
    blocks = rng.integers(0, 256, size=(rows, columns // 256, size), dtype=np.uint8)
    if qtype == Q6_K:  # signed quants and scales: zero-mean already
        blocks[:, :, 208:210] = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)
        return blocks.reshape(rows, -1)
    d = 3e-4 if qtype == Q4_K else 1.5e-4  # 5-bit quants reach twice as far
    blocks[:, :, 0:2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    blocks[:, :, 2:4] = np.frombuffer(np.float16(d * (8 if qtype == Q4_K else 16)).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def llama_cpp_order(n_rows: int, heads: int) -> np.ndarray:
    """Row i of a Q or K tensor in the file is row order[i] of the model's: convert_hf_to_gguf's `permute`
    (each head's rotary halves interleaved), written out here rather than taken from tuichat."""
    return np.arange(n_rows).reshape(heads, 2, n_rows // heads // 2).swapaxes(1, 2).reshape(n_rows)


def write_gguf(path: Path, seed: int = 0, output_format: int | None = OUTPUT_FORMAT, hidden: int = HIDDEN,
               inter: int = INTER, formats: list[dict[str, int]] = FORMATS,
               chat_template: str | None = None, embedding_format: int | None = None,
               rope_freqs: np.ndarray | None = None, arch: str = "llama", extra_tokens: int = 0,
               split_max_tensors: int = 0) -> dict[str, np.ndarray]:
    """A tiny llama GGUF with a byte-level BPE tokenizer (its lm_head in `output_format`, None: F32; token_embd
    in `embedding_format`, None: F32); returns its float32 weights by transformers' names as the file stores
    them (linears dequantized by gguf itself, Q and K back in the model's row order). `rope_freqs` (head_dim / 2
    float32 divisors of the rotary frequencies, Llama 3's RoPE scaling as llama.cpp reads it) is written as the
    F32 tensor rope_freqs.weight, which has no transformers name (not in the returned weights). `arch` "qwen3":
    a Qwen3 file instead (Q and K in the model's own order, as its converter leaves them; each layer's q_norm and
    k_norm F32 tensors over a head's dim). "gemma3": a Gemma 3 file (GEMMA_*; `formats` cycled over its layers;
    no output tensor: the lm_head is token_embd; q/k norms and the four norms of a Gemma layer, stored as
    convert_hf_to_gguf stores them, 1 + transformers' weight). `extra_tokens`: that many user-defined tokens after
    the VOCAB others (and as many more rows in the embedding and the output). `split_max_tensors`: written as
    llama.cpp's gguf-split writes a model, in files of that many tensors (PATH-00001-of-0000N.gguf, ...)."""
    from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
    from gguf.quants import dequantize, quantize
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    gemma = arch == "gemma3"
    head_dim = GEMMA_HEAD_DIM if gemma else hidden // HEADS
    if gemma:
        formats = [formats[i % len(formats)] for i in range(GEMMA_LAYERS)]
    writer = GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    writer.add_name("tiny")
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_block_count(len(formats))
    writer.add_feed_forward_length(inter)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(head_dim)
    if arch in ("qwen3", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(GEMMA_ROPE_THETA if gemma else 10000.0)
    if gemma:
        writer.add_sliding_window(GEMMA_WINDOW)
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(GEMMA_ROPE_FACTOR)
    writer.add_layer_norm_rms_eps(1e-6 if gemma else 1e-5)
    vocab = VOCAB + extra_tokens
    writer.add_vocab_size(vocab)
    # transformers builds the tokenizer from these: the 256 byte symbols, 63 merges, one control token.
    symbols = list(bytes_to_unicode().values())
    merges = [(symbols[i], symbols[i + 32]) for i in range(65, 128)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(symbols + [a + b for a, b in merges] + ["<|endoftext|>"] + [f"<extra{i}>" for i in range(extra_tokens)])
    writer.add_token_types([1] * (VOCAB - 1) + [3] + [4] * extra_tokens)
    writer.add_token_merges([f"{a} {b}" for a, b in merges])
    writer.add_eos_token_id(VOCAB - 1)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    weights = {}

    def add(name: str, hf_name: str, value: np.ndarray, format: int | None = None, rows: np.ndarray | None = None):
        if format is None:
            writer.add_tensor(name, value)
            weights[hf_name] = value - 1 if gemma and name.endswith("norm.weight") else value
            return
        if format in (Q4_K, Q5_K, Q6_K):  # the value's shape only
            blocks = k_quant_blocks(rng, *value.shape, format)
        else:
            blocks = quantize(value, GGMLQuantizationType(format))  # row by row: permuting rows commutes with it
        weights[hf_name] = dequantize(blocks, GGMLQuantizationType(format))
        writer.add_tensor(name, blocks if rows is None else blocks[rows], raw_dtype=GGMLQuantizationType(format))

    add("token_embd.weight", "model.embed_tokens.weight", rng.standard_normal((vocab, hidden), dtype=np.float32),
        embedding_format)
    for i, layer in enumerate(formats):
        for name, format in layer.items():
            # 0.08: sharp attention and peaked logits, so that a wrong row order or head shows in them
            value = rng.standard_normal(shapes(hidden, inter, head_dim)[name], dtype=np.float32) * 0.08
            rows = {"attn_q": llama_cpp_order(len(value), HEADS), "attn_k": llama_cpp_order(len(value), KV_HEADS)}.get(name)
            add(f"blk.{i}.{name}.weight", f"model.layers.{i}.{HF_NAMES[name]}.weight", value, format,
                rows if arch == "llama" else None)
        if arch in ("qwen3", "gemma3"):
            for name in ("q_norm", "k_norm"):
                add(f"blk.{i}.attn_{name}.weight", f"model.layers.{i}.self_attn.{name}.weight",
                    1 + 0.2 * rng.standard_normal(head_dim, dtype=np.float32))
        norms = (("attn_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
                 ("ffn_norm", "pre_feedforward_layernorm"), ("post_ffw_norm", "post_feedforward_layernorm")) if gemma else (
                 ("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"))
        for name, hf_name in norms:
            add(f"blk.{i}.{name}.weight", f"model.layers.{i}.{hf_name}.weight",
                1 + 0.2 * rng.standard_normal(hidden, dtype=np.float32))
    add("output_norm.weight", "model.norm.weight", 1 + 0.2 * rng.standard_normal(hidden, dtype=np.float32))
    if not gemma:
        add("output.weight", "lm_head.weight", rng.standard_normal((vocab, hidden), dtype=np.float32) * 0.08, output_format)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights
