"""A GGUF served in its own blocks (quant.py, native.py), end to end: a tiny llama GGUF written here with Q8_0,
Q4_0 and Q4_1 linears and llama.cpp's Q/K row order goes through the real loader and Engine. The engine must
serve the file's blocks, be as close to a float32 model over the file's dequantized weights as its arithmetic
allows, give replies that do not depend on batching, chunking or caching, keep a linear whose rows do not
match in bf16, and cache the packed weights beside the converted model."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import (
    LONG_PROMPTS,
    PROMPTS,
    cache_contents,
    echoing_prompts,
    float32_continuations,
    greedy,
    replies_independent_of_batching,
    teacher_forced_error,
    whole_and_row_by_row,
)
from tests.tiny_gguf import (
    FORMATS,
    FORMATS_K,
    HEADS,
    HF_NAMES,
    HIDDEN,
    HIDDEN_K,
    INTER,
    INTER_K,
    KV_HEADS,
    LAYERS,
    OUTPUT_FORMAT,
    OUTPUT_FORMAT_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    VOCAB,
    k_quant_blocks,
    shapes,
    write_gguf,
)
from tuichat.engine import quant
from tuichat.engine.cpu import native
from tuichat.engine.engine import Engine, EngineConfig
from tuichat.engine.runner import StepChunk

PACKED_NAME = "tuichat-packed.safetensors"


@dataclasses.dataclass
class TinyGGUF:
    resolved: object  # catalog.ResolvedModel, converted once
    reference: torch.nn.Module  # float32, every weight as the file holds it
    packed_bytes: int  # bytes of the file's quantized linear tensors, from the file's tensor table
    file_q0: np.ndarray  # layer 0's Q tensor as the file stores it, dequantized (llama.cpp's row order)


def build_tiny(tmp_path_factory, session_cache, hidden: int = HIDDEN, inter: int = INTER, formats=FORMATS,
               output_format: int = OUTPUT_FORMAT) -> TinyGGUF:
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers import LlamaConfig, LlamaForCausalLM

    from tuichat import catalog
    from tuichat.engine import loader

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    weights = write_gguf(path, hidden=hidden, inter=inter, formats=formats, output_format=output_format)
    reader = GGUFReader(str(path))
    quantized = [t for t in reader.tensors if int(t.tensor_type) in (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)]
    assert len(quantized) == 7 * LAYERS + 1
    q0 = next(t for t in quantized if t.name == "blk.0.attn_q.weight")
    patch = pytest.MonkeyPatch()
    patch.setenv("TUICHAT_CACHE_DIR", str(session_cache))
    try:
        resolved = catalog.resolve(str(path))
        loader.converted_path(resolved)  # the one conversion of this module
    finally:
        patch.undo()
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=hidden // HEADS,
                         max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    reference = LlamaForCausalLM(config).eval()
    reference.load_state_dict({k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in weights.items()})
    return TinyGGUF(resolved, reference, sum(int(t.n_bytes) for t in quantized),
                    dequantize(q0.data, q0.tensor_type))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, session_cache) -> TinyGGUF:
    return build_tiny(tmp_path_factory, session_cache)


@pytest.fixture(scope="module")
def tiny_k(tmp_path_factory, session_cache) -> TinyGGUF:
    """Its linears in Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1 (what Q4_K_M and Q5_K_M files hold), the lm_head in Q6_K."""
    return build_tiny(tmp_path_factory, session_cache, HIDDEN_K, INTER_K, FORMATS_K, OUTPUT_FORMAT_K)


def load(tiny: TinyGGUF, resolved=None):
    """A fresh bf16 model through the real loader (an engine rewires its model). No EOS: a random model would
    stop its replies at different lengths."""
    from tuichat.engine import loader

    model, _ = loader.load(resolved or tiny.resolved, torch.device("cpu"), torch.bfloat16, with_tokenizer=False)
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    return model


def engine(tiny: TinyGGUF, resolved=None, model=None, **config) -> Engine:
    config.setdefault("num_blocks", 96)
    resolved = resolved or tiny.resolved
    return Engine(model or load(tiny, resolved), config=EngineConfig(**config), source=resolved)


def own_copy(tiny: TinyGGUF, tmp_path: Path):
    """The module's conversion copied to `tmp_path`, without packed weights cached: a ResolvedModel for a test
    that tampers with the model or the cache."""
    converted = tmp_path / "converted"
    shutil.copytree(tiny.resolved.converted_dir, converted, ignore=shutil.ignore_patterns(PACKED_NAME))
    return dataclasses.replace(tiny.resolved, converted_at=lambda: converted)


def expected_formats() -> list[int]:
    """The format of each weight a decoder step reads, in NativeDecoder.weights' order (qkv, o, gate_up, down
    per layer, then the lm_head)."""
    return [f[name] for f in FORMATS for name in ("attn_q", "attn_output", "ffn_gate", "ffn_down")] + [OUTPUT_FORMAT]


def test_the_engine_serves_the_files_own_blocks(kernels, tiny):
    served = engine(tiny)
    assert served.layers == "C"
    assert served.weights == "Q4_0, Q4_1, Q8_0"
    assert [w.format for w in served.runner.native.weights] == expected_formats()
    assert served.weight_bytes == tiny.packed_bytes  # the file's bytes, not bf16's
    # Q and K were found in llama.cpp's order: the file's rows are not the model's, yet they were packed.
    model_q = tiny.reference.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    assert not np.array_equal(tiny.file_q0, model_q)
    # The bf16 copies of the decoder's linears are freed; every step runs through decoder.c.
    for layer in served.model.model.layers:
        for linear in (layer.self_attn.fused_q_k_v, layer.self_attn.o_proj, layer.mlp.fused_gate_up, layer.mlp.down_proj):
            assert linear.weight.numel() == 0
    assert served.model.lm_head.weight.numel() == 0  # untied and packed: its bf16 copy is freed too
    # The embedding and the norms are read in fp32, as the file holds them (not their bf16 rounding), and the
    # embedding's bf16 copy is freed.
    decoder, reference = served.runner.native, tiny.reference.model
    assert torch.equal(decoder.embedding, reference.embed_tokens.weight)
    assert served.model.model.embed_tokens.weight.numel() == 0
    norms = [n.weight for layer in reference.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    assert len(decoder._norms) == len(norms) and all(torch.equal(a, b) for a, b in zip(decoder._norms, norms))
    assert torch.equal(decoder.final_norm, reference.norm.weight)
    assert served.runner.native.accepts(2 * native.MAX_ROWS)
    served.close()


def test_as_close_to_float32_over_the_files_weights_as_its_arithmetic_allows(kernels, tiny):
    """Teacher-forced along the float32 model's greedy replies. Measured here (both builds): the packed engine is
    off by at most ~1.0 % of a row's logit range (mean 0.7 %), the bf16 one by 0.6 % (0.45 %): bf16 activations
    round each op by 2^-9, and the int8 path's per-block activation quantization (a step of max|x| / 127) adds
    about as much. 3 % leaves room for other builds' summation orders; a wrong row order, block layout or
    scale is tens of % off."""
    sequences, want = float32_continuations(tiny.reference)
    for quant_mode, weights in (("auto", "Q4_0, Q4_1, Q8_0"), ("none", "bfloat16")):
        served = engine(tiny, quant=quant_mode, prefix_cache=False)
        assert served.weights == weights
        errors, agreement = teacher_forced_error(served, sequences, want)
        served.close()
        assert errors.max() < 0.03 and errors.mean() < 0.015, (quant_mode, errors.max(), errors.mean())
        # A flip needs a near-tie: here one of 36 rows, where the top two are within the error of each other.
        assert agreement >= 0.9, quant_mode


def test_long_rows_are_as_close_to_float32_as_short_ones(kernels, tiny):
    """Rows past 256 positions, whose attention runs in parts merged afterwards (decoder.c: SPLIT), decode
    across the 512 mark within the short rows' bounds, and so does a row that grows past 256 from a 250-token
    prompt."""
    sequences, want = float32_continuations(tiny.reference, tokens=10, prompts=LONG_PROMPTS)
    served = engine(tiny, prefix_cache=False)
    errors, agreement = teacher_forced_error(served, sequences, want, prompts=LONG_PROMPTS)
    served.close()
    assert errors.max() < 0.03 and errors.mean() < 0.015, (errors.max(), errors.mean())
    assert agreement >= 0.9


def llama_cpp_arithmetic(reference: torch.nn.Module, kernels) -> torch.nn.Module:
    """The float32 model computing as llama.cpp does over a GGUF, written here in torch: each linear's input
    quantized to int8 per block of 32 (d = max|x| / 127, q = round(x / d)) where the kernels' method for its
    format does so (AVX2 without VNNI takes Q8_0 in fp32), K and V through an f16 cache, the rest in fp32, the
    embeddings and norms included."""
    import copy

    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def int8_blocks(module, args):
        x = args[0]
        blocks = x.reshape(*x.shape[:-1], -1, 32)
        d = blocks.abs().amax(-1, keepdim=True) / 127
        inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        return (torch.round(blocks * inverse) * d).reshape(x.shape)

    def f16_cache(module, query, key, value, *args, **kwargs):
        return sdpa_attention_forward(module, query, key.half().float(), value.half().float(), *args, **kwargs)

    AttentionInterface.register("tuichat_test_f16_cache", f16_cache)
    model = copy.deepcopy(reference)
    formats = {f"model.layers.{i}.{HF_NAMES[name]}": format for i, layer in enumerate(FORMATS) for name, format in layer.items()}
    formats["lm_head"] = OUTPUT_FORMAT
    for name, module in model.named_modules():
        if name in formats and kernels.quant_math(formats[name], module.in_features) != "fp32":
            module.register_forward_pre_hook(int8_blocks)
    model.set_attn_implementation("tuichat_test_f16_cache")
    return model


def test_the_packed_engine_computes_in_fp32_over_an_f16_cache_as_llama_cpp_does(kernels, tiny):
    """Its logits are llama.cpp's arithmetic (written in torch above) but for fp32 summation order, and what that
    order does to int8 rounding: an input a hair from a rounding boundary lands on the other int8 step. The
    engine as it was before (bf16 activations and cache, then bf16 embeddings and norms) fails this bound
    several times over."""
    sequences = [p + [(5 * i + 1) % 300 for i in range(12)] for p in PROMPTS]
    emulated = llama_cpp_arithmetic(tiny.reference, kernels)
    with torch.inference_mode():
        want = torch.cat([emulated(torch.tensor([s])).logits[0, len(p) - 1:-1] for s, p in zip(sequences, PROMPTS)])
    served = engine(tiny, prefix_cache=False)
    assert all(k.dtype is torch.float16 for k in served.kv.k + served.kv.v)
    errors, _ = teacher_forced_error(served, sequences, want)
    served.close()
    assert errors.max() < 0.012 and errors.mean() < 0.004, (errors.max(), errors.mean())


def test_replies_do_not_depend_on_batching_chunking_or_caching(kernels, tiny, monkeypatch):
    """The packed engine against itself, token for token: each row's arithmetic is its own whatever shares
    its step (the correctness reference is the float32 test above)."""
    prompts, expected = replies_independent_of_batching(lambda **config: engine(tiny, **config))
    long_prompt = prompts[3]

    # 600 rows in one step: NativeDecoder runs them as 512 + 88 (transformers' layers have no weights left).
    rows = []
    original = native.NativeDecoder.execute
    monkeypatch.setattr(native.NativeDecoder, "execute",
                        lambda self, chunks: rows.append(sum(len(c.token_ids) for c in chunks)) or original(self, chunks))
    wide = engine(tiny, max_batched_tokens=1024)
    assert greedy(wide, [long_prompt, prompts[1]]) == [expected[3], expected[1]]
    assert max(rows) > native.MAX_ROWS
    # Greedy tokens of a random model hardly depend on context 500 tokens back (pieces run in the wrong order
    # kept them): the logits must be bitwise those of 64-row chunks. An empty cache: nothing left from above.
    for cache in wide.kv.k + wide.kv.v:
        cache.zero_()
    whole = wide.runner.execute([StepChunk(long_prompt, 0, list(range(38)), True)])
    for start in range(0, len(long_prompt), 64):
        piece = long_prompt[start:start + 64]
        chunked = wide.runner.execute([StepChunk(piece, start, list(range(40, 78)), start + 64 >= len(long_prompt))])
    assert torch.equal(whole, chunked)
    wide.close()


def test_speculation_keeps_the_replies_of_the_engine_without_it(kernels, tiny):
    """Drafts verified over the file's blocks, several rows of a sequence in one step beside the others': eight
    replies at once are token for token those of the same engine with speculation off."""
    prompts = echoing_prompts(8, seed=2)
    replies = {}
    for mode in ("off", "ngram"):
        served = engine(tiny, max_batched_tokens=32, speculate=mode)
        replies[mode] = greedy(served, prompts, tokens=24)
        if mode == "ngram":
            assert 0 < served.accepted_tokens < served.draft_tokens  # drafts both kept and cut
        served.close()
    assert replies["ngram"] == replies["off"]


def test_a_linear_whose_rows_do_not_match_stays_in_bf16(kernels, tiny, tmp_path):
    """Rows in an order neither the file's nor llama.cpp's Q/K order explains (two of layer 1's K rows
    swapped in the loaded model): that K is served from the model's bf16 weights, never from the file's blocks
    in a wrong order; q and v beside it, and every other linear, are still packed."""
    resolved = own_copy(tiny, tmp_path)  # a packed cache holds what the untampered model matched
    model = load(tiny, resolved)
    k = model.model.layers[1].self_attn.k_proj.weight
    with torch.no_grad():
        k[[0, 1]] = k[[1, 0]].clone()
    served = engine(tiny, resolved, model)
    formats = [w.format for w in served.runner.native.weights]
    want = expected_formats()
    want[4:5] = [want[4], quant.BF16, want[4]]  # layer 1's q, k, v, apart
    assert formats == want
    assert served.weights == "Q4_0, Q4_1, Q8_0, bfloat16"
    served.close()


def test_from_gguf_finds_llama_cpps_q_k_order(kernels, tiny):
    """Every Q and K tensor is packed (their file rows are in llama.cpp's order, which only the permutation
    explains) and each packed tensor's rows are the model's: unpacked by the kernel's own linear on unit
    inputs, they equal the model's weights to bf16 rounding."""
    model = load(tiny)
    packed = quant.from_gguf(tiny.resolved.source, model, kernels)
    assert sorted(packed) == sorted([f"model.layers.{i}.{n}" for i in range(LAYERS) for n in HF_NAMES.values()] + ["lm_head"])
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.k_proj"):
        weight = model.get_submodule(name).weight
        # x = one-hot rows: the linear then reads out columns of W (exact for the fp32 path, int8 on one-hot
        # inputs is exact as well: the one non-zero quantizes to 127 with scale 1/127).
        eye = torch.eye(weight.shape[1], dtype=torch.bfloat16)
        columns = torch.cat([kernels.linear(eye[i:i + 256], packed[name], None) for i in range(0, len(eye), 256)])
        assert torch.allclose(columns.T.float(), weight.float(), rtol=2**-7, atol=1e-6), name


def test_int8_and_int4_keep_the_files_blocks_and_quantize_only_what_it_holds_in_none(kernels, tiny, tmp_path):
    """A GGUF whose lm_head is F32: auto serves that in bf16; int8 and int4 keep every block the file has as it
    is and quantize the lm_head alone, from the float32 conversion, into their own format, each mode cached in
    a file of its own beside the conversion."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from tuichat import catalog

    path = tmp_path / "f32-head.gguf"
    weights = write_gguf(path, output_format=None)
    resolved = catalog.resolve(str(path))
    for mode, head in (("auto", quant.BF16), ("int8", Q8_0), ("int4", quant.QUANT_FORMATS["int4"][1])):
        served = engine(tiny, resolved, quant=mode)
        assert [w.format for w in served.runner.native.weights] == expected_formats()[:-1] + [head], mode
        if mode != "auto":
            blocks = quantize(weights["lm_head.weight"], GGMLQuantizationType(head))
            assert torch.equal(served.runner.native.head.data, kernels.pack(np.ascontiguousarray(blocks), head, HIDDEN))
        served.close()
    assert sorted(p.name for p in resolved.converted_dir.glob("tuichat-packed*")) == [
        quant.cache_name("int4"), quant.cache_name("int8"), quant.cache_name("auto")]


def test_quant_none_serves_the_dequantized_bf16_weights(tiny, monkeypatch):
    monkeypatch.setattr(quant, "packed_weights", lambda *a: pytest.fail("--quant none packed the GGUF"))
    served = engine(tiny, quant="none")
    assert served.layers == "C" and served.weights == "bfloat16"
    linears = sum(a * b for a, b in shapes(HIDDEN, INTER).values()) * LAYERS + VOCAB * HIDDEN
    assert served.weight_bytes == 2 * linears
    served.close()


def test_a_second_engine_loads_the_packed_weights_from_the_cache(tiny, tmp_path, monkeypatch):
    resolved = own_copy(tiny, tmp_path)
    first = engine(tiny, resolved)
    assert (resolved.converted_dir / PACKED_NAME).is_file()
    replies = greedy(first, PROMPTS)
    first.close()
    monkeypatch.setattr(quant, "from_gguf", lambda *a: pytest.fail("the packed cache was not used"))
    second = engine(tiny, resolved)
    assert [w.format for w in second.runner.native.weights] == expected_formats()
    assert second.weight_bytes == tiny.packed_bytes
    assert greedy(second, PROMPTS) == replies
    second.close()


def flip_layout(meta: dict[str, str]) -> dict[str, str]:
    name = "model.layers.0.mlp.down_proj"  # Q8_0: "paired" where its int8 path runs, else "plain"
    format, out_features, in_features, layout = meta[name].split(",")
    return {**meta, name: f"{format},{out_features},{in_features},{'plain' if layout == 'paired' else 'paired'}"}


def wrong_shape(meta: dict[str, str]) -> dict[str, str]:
    name = "model.layers.1.mlp.down_proj"  # not square: its shape transposed is another
    format, out_features, in_features, layout = meta[name].split(",")
    return {**meta, name: f"{format},{in_features},{out_features},{layout}"}

DAMAGE = {
    "another version": lambda meta: {**meta, "version": quant.PACK_VERSION + "0"},
    "another layout": flip_layout,
    "another shape": wrong_shape,
    "no metadata for a tensor": lambda meta: {k: v for k, v in meta.items() if k != "lm_head"},
}


@pytest.mark.parametrize("damage", [*DAMAGE, "not safetensors", "empty"])
def test_a_stale_or_damaged_cache_is_packed_again_and_rewritten(tiny, tmp_path, monkeypatch, damage):
    from safetensors.torch import save_file

    resolved = own_copy(tiny, tmp_path)
    engine(tiny, resolved).close()
    cache = resolved.converted_dir / PACKED_NAME
    good_meta, good_tensors = cache_contents(cache)
    if damage in DAMAGE:
        save_file(good_tensors, str(cache), DAMAGE[damage](good_meta))
    else:
        cache.write_bytes(b"" if damage == "empty" else b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    calls = []
    original = quant.from_gguf
    monkeypatch.setattr(quant, "from_gguf", lambda *a: calls.append(1) or original(*a))
    served = engine(tiny, resolved)
    assert calls == [1]
    assert [w.format for w in served.runner.native.weights] == expected_formats()
    served.close()
    meta, tensors = cache_contents(cache)
    assert meta == good_meta and tensors.keys() == good_tensors.keys()
    assert all(torch.equal(tensors[name], good_tensors[name]) for name in tensors)


def test_an_unwritable_cache_still_serves(tiny, tmp_path, monkeypatch):
    import safetensors.torch

    resolved = own_copy(tiny, tmp_path)
    converted = resolved.converted_dir
    original = safetensors.torch.save_file

    def read_only(tensors, filename, metadata=None):  # what a read-only folder does, even to root
        if Path(filename).parent == converted:
            raise PermissionError(13, "Permission denied", filename)
        return original(tensors, filename, metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", read_only)
    before = sorted(p.name for p in converted.iterdir())
    served = engine(tiny, resolved)
    assert [w.format for w in served.runner.native.weights] == expected_formats()
    assert greedy(served, PROMPTS[1:2])
    served.close()
    assert sorted(p.name for p in converted.iterdir()) == before  # no cache, no temporary left behind


def decode_recut(blocks: np.ndarray, format: int) -> np.ndarray:
    """Weights from blocks of 32 as quant.recut documents them (fp32 scale, fp32 minimum, quants; Q6_K:
    fp16 d, two int8 scales, 32 int8 quants)."""
    per = blocks.reshape(blocks.shape[0], -1, quant.BLOCK_BYTES[format])
    if format == 114:
        d = per[:, :, 0:2].copy().view(np.float16).astype(np.float32)
        scales = per[:, :, 2:4].copy().view(np.int8).astype(np.float32)
        q = per[:, :, 4:].copy().view(np.int8).astype(np.float32).reshape(*per.shape[:2], 2, 16)
        return ((d * scales)[..., None] * q).reshape(blocks.shape[0], -1)
    scale, minimum = (per[:, :, i:i + 4].copy().view(np.float32)[..., 0] for i in (0, 4))
    body = per[:, :, 8:]
    q = np.concatenate([body & 15, body >> 4], axis=-1) if format == 112 else body
    return (scale[..., None] * q.astype(np.float32) + minimum[..., None]).reshape(blocks.shape[0], -1)


@pytest.mark.parametrize("qtype", [Q5_0, Q5_1, Q4_K, Q5_K, Q6_K])
def test_recut_blocks_of_32_are_ggufs_own_weights(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(qtype)
    if qtype in (Q5_0, Q5_1):
        blocks = quantize(rng.standard_normal((48, 768), dtype=np.float32), GGMLQuantizationType(qtype))
    else:
        blocks = k_quant_blocks(rng, 48, 768, qtype)
    if qtype in (Q4_K, Q5_K):
        blocks[:, 4:16] = 255  # the largest 6-bit sub-scales and minimums, whose high bits sit apart
    recut = quant.recut(blocks, qtype)
    assert recut.shape == (48, 768 // 32 * quant.BLOCK_BYTES[quant.RECUT[qtype]])
    assert np.array_equal(decode_recut(recut, quant.RECUT[qtype]), dequantize(blocks, GGMLQuantizationType(qtype)))


@pytest.mark.parametrize("qtype", [Q5_0, Q5_1])
def test_the_kernels_recut_5_bit_blocks_as_numpy_does(kernels, qtype):
    """recut_5bit (pack.c, what a load uses) byte for byte quant.recut's, on scales of every kind: normal,
    subnormal, zero and negative halves."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(qtype)
    blocks = quantize(rng.standard_normal((48, 768), dtype=np.float32), GGMLQuantizationType(qtype))
    per = blocks.reshape(-1, 22 if qtype == Q5_0 else 24)
    halves = np.array([1e-7, 0.0, -3.5, 6e-5, -1e-6], dtype=np.float16).view(np.uint8).reshape(-1, 2)
    per[:len(halves), 0:2] = halves  # d
    if qtype == Q5_1:
        per[len(halves):2 * len(halves), 2:4] = halves  # m
    assert np.array_equal(kernels.recut(blocks, qtype), quant.recut(blocks, qtype))


def test_k_quants_are_served_in_blocks_as_close_to_float32_as_the_other_formats(kernels, tiny_k):
    """Where the kernels take the re-cut formats (the 512-bit VNNI tiles), the step reads them and is as
    close to the float32 model over the file's weights as Q4_0/Q4_1/Q8_0 are (the bounds of the test above);
    elsewhere those linears stay bf16, and say so."""
    served = engine(tiny_k, prefix_cache=False)
    assert served.layers == "C"
    if kernels.layout(quant.RECUT[Q4_K], HIDDEN_K) != "tiles":
        assert served.weights == "bfloat16"
        served.close()
        return
    assert served.weights == "Q4_K, Q5_0, Q5_1, Q5_K, Q6_K"
    parts = [["attn_q", "attn_k", "attn_v"], ["attn_output"], ["ffn_gate"], ["ffn_down"],  # layer 0: q, k, v apart
             ["attn_q"], ["attn_output"], ["ffn_gate", "ffn_up"], ["ffn_down"]]  # layer 1: gate and up apart
    order = [quant.RECUT[FORMATS_K[i // 4][name]] for i, names in enumerate(parts) for name in names]
    assert [w.format for w in served.runner.native.weights] == order + [quant.RECUT[OUTPUT_FORMAT_K]]
    linears = {**{f"{i}.{n}": f for i, layer in enumerate(FORMATS_K) for n, f in layer.items()}, "output": OUTPUT_FORMAT_K}
    sizes = {**{f"{i}.{n}": a * b for i in range(LAYERS) for n, (a, b) in shapes(HIDDEN_K, INTER_K).items()},
             "output": VOCAB * HIDDEN_K}
    assert served.weight_bytes == sum(sizes[n] // 32 * quant.BLOCK_BYTES[quant.RECUT[f]] for n, f in linears.items())
    sequences, want = float32_continuations(tiny_k.reference)
    errors, agreement = teacher_forced_error(served, sequences, want)
    served.close()
    assert errors.max() < 0.03 and errors.mean() < 0.015, (errors.max(), errors.mean())
    assert agreement >= 0.9


def test_k_quant_replies_do_not_depend_on_batching_chunking_or_caching(kernels, tiny_k):
    replies_independent_of_batching(lambda **config: engine(tiny_k, **config))


def test_k_quant_rows_attended_together_are_bitwise_rows_attended_alone(kernels, tiny_k):
    """fp32 over the f16 cache, heads of 64: rows attended together against one row a step, the same bits."""
    served = engine(tiny_k, prefix_cache=False)
    whole, alone = whole_and_row_by_row(served)
    served.close()
    assert torch.equal(whole, alone)
