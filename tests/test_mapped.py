"""A GGUF served in place (engine/mapped.py, gguf_file.py, loader.in_place, prepare._prepare_mapped), end to end,
against references of its own: a float32 transformers Llama over the file's weights as gguf dequantizes them
(the same model transformers' own GGUF loading makes), gguf's GGUFReader and dequantize. Tiny llama GGUFs are
written here (tests/tiny_gguf.py); the engine must serve them in C as close to float32 as its arithmetic allows,
read Q4_K and Q6_K from the file's map, leave no converted copy on disk, give replies that do not depend on
batching, apply Llama 3's rope_freqs, and look the embedding's rows up as gguf decodes them."""

from __future__ import annotations

import asyncio
import dataclasses
import mmap
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import (
    LONG_PROMPTS,
    PROMPTS,
    float32_continuations,
    replies_independent_of_batching,
    teacher_forced_error,
)
from tests.tiny_gguf import (
    FORMATS,
    FORMATS_K,
    GEMMA_HEAD_DIM,
    GEMMA_LAYERS,
    GEMMA_ROPE_FACTOR,
    GEMMA_ROPE_THETA,
    GEMMA_WINDOW,
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
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q8_0,
    VOCAB,
    llama_cpp_order,
    write_gguf,
)
from tuichat.engine import mapped, quant
from tuichat.engine.engine import Engine, EngineConfig
from tuichat.engine.gguf_file import HUGE_PAGE, GGUFFile
from tuichat.engine.types import TuichatError

F16, BF16 = 1, 30
GGUF_NAMES = {hf: gguf for gguf, hf in HF_NAMES.items()}


@dataclasses.dataclass
class Tiny:
    path: Path
    hidden: int
    formats: list[dict[str, int]]
    output_format: int
    weights: dict[str, np.ndarray]  # float32, by transformers' names, as gguf dequantizes the file's tensors
    reference: torch.nn.Module  # float32 LlamaForCausalLM over `weights`
    metadata: Path  # this file's own tokenizer/config cache folder


def gemma3_reference(weights: dict[str, np.ndarray], hidden: int, inter: int) -> torch.nn.Module:
    """transformers' float32 Gemma 3 of the file's shape, as Google's configs spell it."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=len(weights["model.embed_tokens.weight"]), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=GEMMA_LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=GEMMA_HEAD_DIM,
        query_pre_attn_scalar=GEMMA_HEAD_DIM, max_position_embeddings=2048, rms_norm_eps=1e-6,
        sliding_window=GEMMA_WINDOW, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": GEMMA_ROPE_FACTOR, "rope_theta": GEMMA_ROPE_THETA},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    reference = Gemma3ForCausalLM(config).eval()
    missing, unexpected = reference.load_state_dict(
        {k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in weights.items()}, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)  # tied to the embedding
    return reference


def reference_model(weights: dict[str, np.ndarray], hidden: int, inter: int, arch: str = "llama") -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if arch == "gemma3":
        return gemma3_reference(weights, hidden, inter)
    config_class, model_class = (Qwen3Config, Qwen3ForCausalLM) if arch == "qwen3" else (LlamaConfig, LlamaForCausalLM)
    config = config_class(vocab_size=len(weights["model.embed_tokens.weight"]), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=LAYERS,
                          num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=hidden // HEADS,
                          max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    reference = model_class(config).eval()
    reference.load_state_dict({k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in weights.items()})
    return reference


def write_tiny(folder: Path, hidden: int = HIDDEN, inter: int = INTER, formats=FORMATS,
               output_format: int = OUTPUT_FORMAT, **options) -> Tiny:
    path = folder / "tiny.gguf"
    weights = write_gguf(path, hidden=hidden, inter=inter, formats=formats, output_format=output_format, **options)
    path = path if path.is_file() else sorted(folder.glob("tiny-*-of-*.gguf"))[0]  # split: its first file
    reference = reference_model(weights, hidden, inter, options.get("arch", "llama"))
    return Tiny(path, hidden, formats, output_format, weights, reference, folder / "meta")


@pytest.fixture(scope="module")
def kernel(session_cache):
    """This CPU's kernels, built (once per session) in the session's cache."""
    from tuichat.engine.cpu import build

    patch = pytest.MonkeyPatch()
    patch.setenv("TUICHAT_CACHE_DIR", str(session_cache))
    try:
        kernel, why = build.load()
    finally:
        patch.undo()
    if kernel is None:
        pytest.skip(f"no CPU kernels here ({why})")
    return kernel


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Tiny:
    """Q8_0, Q4_0 and Q4_1 linears, a Q4_0 lm_head."""
    return write_tiny(tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def kquant(tmp_path_factory) -> Tiny:
    """Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1 linears (a Q4_K_M file's mix), a Q6_K lm_head."""
    return write_tiny(tmp_path_factory.mktemp("kquant"), HIDDEN_K, INTER_K, FORMATS_K, OUTPUT_FORMAT_K)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Tiny:
    """A Qwen3 file (q/k norms, Q and K unpermuted) of the K-quant mix: Qwen3's layers in C over its blocks."""
    return write_tiny(tmp_path_factory.mktemp("qwen3"), HIDDEN_K, INTER_K, FORMATS_K, OUTPUT_FORMAT_K, arch="qwen3")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Tiny:
    """A Gemma 3 file of the K-quant mix, its embedding (and so its tied lm_head) Q8_0: Gemma 3's layers in C
    over its blocks, with heads of 256 dims, five sliding-window layers to a full one, local RoPE."""
    return write_tiny(tmp_path_factory.mktemp("gemma3"), HIDDEN_K, INTER_K, FORMATS_K, Q8_0, arch="gemma3",
                      embedding_format=Q8_0)


def load(tiny: Tiny, kernel, cache: Path | None = None):
    """A fresh mapped model (an engine rewires its model). No EOS: a random model would stop its replies at
    different lengths."""
    model, _ = mapped.load(tiny.path, kernel, cache or tiny.metadata)
    model.config.eos_token_id = None
    if model.generation_config is not None:
        model.generation_config.eos_token_id = None
    return model


def engine(tiny: Tiny, kernel, **config) -> Engine:
    config.setdefault("num_blocks", 96)
    return Engine(load(tiny, kernel), config=EngineConfig(**config))


def reader_tensors(path: Path) -> dict:
    from gguf import GGUFReader

    return {t.name: t for t in GGUFReader(str(path)).tensors}


def gguf_name(module_name: str) -> str:
    if module_name == "lm_head":
        return "output.weight"
    _, _, i, linear = module_name.split(".", 3)  # model.layers.<i>.<self_attn.q_proj>
    return f"blk.{i}.{GGUF_NAMES[linear]}.weight"


def map_range(model) -> tuple[int, int]:
    """[start, end) of the addresses of the model's file map."""
    view = np.frombuffer(model.tuichat_mapped.file._map, np.uint8)
    return view.ctypes.data, view.ctypes.data + view.size


# Bounds, as a share of a row's float32 logit range, teacher-forced along the float32 model's greedy replies.
# Q8_0/Q4_0/Q4_1 measured at most 0.78 % (mean 0.58 %): fp32 activations quantized to int8 per block of 32,
# K and V in an f16 cache; the bound is test_gguf_engine's (3 %, mean 1.5 %), room for other builds' summation
# orders. The K-quants read in place quantize their inputs per 256 (llama.cpp's Q8_K: one scale for 8x the
# inputs, so a coarser step), measured at most 2.2 % (mean 1.6 %): bound 5 % (mean 3 %). A wrong row order,
# block layout, scale or rotary frequency is tens of % off.
# Gemma 3's logits are dominated by its scaled, tied embedding: measured at most 0.13 % (mean 0.11 %), where
# attention without its window is 3.9 % (1.9 %) off and the full layers' RoPE in the sliding ones 1.4 % (0.9 %).
BOUNDS = {"plain": (0.03, 0.015), "kquant": (0.05, 0.03), "qwen3": (0.05, 0.03), "gemma3": (0.008, 0.004)}


@pytest.mark.parametrize("which", ["plain", "kquant", "qwen3", "gemma3"])
def test_both_format_sets_are_served_in_c_as_close_to_float32_as_their_arithmetic_allows(kernel, which, request):
    from gguf import GGMLQuantizationType
    from transformers import AutoModelForCausalLM

    tiny: Tiny = request.getfixturevalue(which)
    # Gemma 3's also past its window and past 256 positions, where decoder.c splits a row's attention.
    prompts = PROMPTS + LONG_PROMPTS[:1] if which == "gemma3" else PROMPTS
    sequences, want = float32_continuations(tiny.reference, prompts=prompts)
    # The reference is transformers' own reading of the file (config from its metadata, Q/K rows un-permuted);
    # not the Qwen3 one: transformers reads no head size from a GGUF (its Qwen3 default, 128, is the real models'),
    # nor Gemma 3's RoPE scaling.
    if which in ("plain", "kquant"):
        theirs = AutoModelForCausalLM.from_pretrained(str(tiny.path.parent), gguf_file=tiny.path.name,
                                                      dtype=torch.float32).eval()
        with torch.inference_mode():
            for sequence in sequences:
                ids = torch.tensor([sequence])
                assert torch.allclose(theirs(ids).logits, tiny.reference(ids).logits, atol=1e-4, rtol=1e-4)

    served = engine(tiny, kernel, prefix_cache=False)
    assert served.layers == "C"
    assert served.model.tuichat_mapped is not None
    formats = {f for layer in tiny.formats for f in layer.values()} | {tiny.output_format}
    names = {GGMLQuantizationType(f).name for f in formats}
    # Every format in its blocks where these kernels take them (the K-quants: AVX-512 builds), else some in bf16.
    if which == "plain" or (kernel.layout(Q4_K, HIDDEN_K) == "in place"
                            and kernel.layout(quant.RECUT[Q5_K], HIDDEN_K) == "tiles"):
        assert set(served.weights.split(", ")) == names
    errors, agreement = teacher_forced_error(served, sequences, want, prompts)
    served.close()
    bound, mean_bound = BOUNDS[which]
    assert errors.max() < bound and errors.mean() < mean_bound, (errors.max(), errors.mean())
    assert agreement >= 0.9  # a flip needs a near-tie (measured: none)


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and ":" not in first:
            start, end = (int(x, 16) for x in first.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_q4_k_and_q6_k_are_read_from_the_files_map(kernel, kquant, plain):
    """Q4_K and Q6_K linears (and Q5_K ones on AVX2 builds) are views of the file's map at their tensors' offsets
    (gguf's tensor table), bytes for bytes the file's, and the decoder reads those very bytes; a llama's Q and K (rows permuted back from
    llama.cpp's order) and every other format are copies in memory. Where the system has transparent huge
    pages, the map and the copies are advised to get 2 MB pages."""
    from tuichat.engine import heap

    if kernel.layout(Q4_K, HIDDEN_K) != "in place":
        pytest.skip("these kernels read no K-quant in place (an AVX2 or AVX-512 build does)")
    tensors = reader_tensors(kquant.path)
    model = load(kquant, kernel)
    start, end = map_range(model)
    huge = heap.huge_pages()
    assert not huge or "hg" in vm_flags(start)
    packed = model.tuichat_mapped.packed
    assert sorted(packed) == sorted([f"model.layers.{i}.{n}" for i in range(LAYERS) for n in HF_NAMES.values()] + ["lm_head"])
    in_place, copied = 0, []
    for module_name, weight in packed.items():
        tensor = tensors[gguf_name(module_name)]
        address = weight.data.data_ptr()
        qk = module_name.endswith(("q_proj", "k_proj"))
        if int(tensor.tensor_type) in (Q5_0, Q5_1):  # in their own bytes where tiles or pairs take them, else re-cut
            qtype, recut = int(tensor.tensor_type), quant.RECUT[int(tensor.tensor_type)]
            if kernel.layout(qtype, weight.in_features) in ("tiles", "pairs"):
                assert weight.format == qtype, module_name
            else:  # re-cut where the kernels take that, else bf16 (no AVX2)
                assert weight.format == (recut if kernel.layout(recut, weight.in_features) != "none" else BF16), module_name
        if kernel.layout(int(tensor.tensor_type), weight.in_features) == "in place" and not qk:  # Q5_K too on AVX2
            assert address == start + int(tensor.data_offset), module_name
            assert np.array_equal(weight.data.numpy(), tensor.data), module_name
            in_place += int(tensor.n_bytes)
        else:
            assert not start <= address < end, module_name
            assert not huge or "hg" in vm_flags(address), module_name
            copied.append(module_name)
            if int(tensor.tensor_type) == Q4_K:  # Q and K: the file's rows in the model's order
                heads = HEADS if module_name.endswith("q_proj") else KV_HEADS
                model_rows = np.argsort(llama_cpp_order(len(tensor.data), heads))
                assert np.array_equal(weight.data.numpy(), tensor.data[model_rows]), module_name
    assert "model.layers.0.self_attn.q_proj" in copied and "model.layers.0.self_attn.k_proj" in copied
    assert model.tuichat_mapped.in_place_bytes == in_place > 0

    # The decoder's steps read the same addresses: nothing read in place was joined into a copy.
    served = Engine(model, config=EngineConfig(num_blocks=96))
    native = served.runner.native
    read = {w.data.data_ptr() for w in [*native.weights, native.head]}
    assert {w.data.data_ptr() for w in packed.values() if start <= w.data.data_ptr() < end} <= read
    served.close()

    # Q8_0, Q4_0 and Q4_1 are laid out in the kernels' tiles: all copies.
    other = load(plain, kernel)
    start, end = map_range(other)
    assert not any(start <= w.data.data_ptr() < end for w in other.tuichat_mapped.packed.values())
    assert not huge or all("hg" in vm_flags(w.data.data_ptr()) for w in other.tuichat_mapped.packed.values())
    assert other.tuichat_mapped.in_place_bytes == 0


def files_under(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


def test_a_backend_serves_the_file_without_a_converted_copy(kernel, kquant, tmp_path, monkeypatch):
    """Through LocalBackend as a user loads it: no transformers folder, no safetensors, nothing the size of the
    weights in the cache, not even a hash of the whole file; only the tokenizer and config, under 20 MB, which a second load reads back instead of
    the file's metadata. The tokenizer encodes as transformers' own GGUF tokenizer does."""
    from transformers import AutoConfig, AutoTokenizer

    from tuichat.backends.local import LocalBackend
    from tuichat.backends.protocol import EngineOptions
    from tuichat.engine import gguf_file, loader

    cache = tmp_path / "cache"
    monkeypatch.setenv("TUICHAT_CACHE_DIR", str(cache))  # the kernels are loaded already (the `kernel` fixture)
    entered = []
    original = gguf_file.as_gguf_reader
    monkeypatch.setattr(gguf_file, "as_gguf_reader", lambda file, **kw: entered.append(file.path) or original(file, **kw))

    def served(backend: LocalBackend) -> tuple[Engine, object]:  # (the engine, its tokenizer)
        name = backend.load_sync(str(kquant.path))
        loaded = backend._loaded[name]
        assert loaded.engine.layers == "C"
        assert loaded.engine.model.tuichat_mapped is not None
        return loaded.engine, loaded.tokenizer

    backend = LocalBackend(EngineOptions(kv_cache_mb=16), default_model=str(kquant.path))
    try:
        _, first_tokenizer = served(backend)
        assert entered  # the metadata was read once
    finally:
        asyncio.run(backend.close())
    assert not any(p.suffix == ".safetensors" for p in files_under(cache))
    assert not (cache / "models").exists()  # no conversion, and the file was never hashed for one
    [metadata] = list((cache / "gguf").iterdir())
    assert (metadata / "config.json").is_file() and (metadata / "tokenizer_config.json").is_file()
    assert sum(p.stat().st_size for p in files_under(cache / "gguf")) < 20 * 2**20
    total = sum(p.stat().st_size for p in files_under(cache))
    assert total < kquant.path.stat().st_size  # nothing the size of the model was written

    entered.clear()
    monkeypatch.setattr(loader, "converted_path", lambda *a, **k: pytest.fail("the GGUF was converted"))
    second = LocalBackend(EngineOptions(kv_cache_mb=16), default_model=str(kquant.path))
    try:
        second_engine, tokenizer = served(second)
        config = second_engine.model.config.to_dict()
    finally:
        asyncio.run(second.close())
    assert entered == []  # the tokenizer and config came from the cache
    assert [p for p in (cache / "gguf").iterdir()] == [metadata]
    # The config read back from the cache is transformers' own from the file's metadata.
    their_config = AutoConfig.from_pretrained(str(kquant.path.parent), gguf_file=kquant.path.name).to_dict()
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "max_position_embeddings",
                "rope_parameters", "tie_word_embeddings", "eos_token_id"):
        assert config.get(key) == their_config.get(key), key
    assert config["hidden_size"] == HIDDEN_K and config["vocab_size"] == VOCAB
    theirs = AutoTokenizer.from_pretrained(str(kquant.path.parent), gguf_file=kquant.path.name)
    text = "Hello there, tuichat! 0123 \u00e9\u4e2d<|endoftext|>"
    assert tokenizer.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    assert first_tokenizer.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    assert tokenizer.decode(theirs.encode(text, add_special_tokens=False)) == text


def test_a_reply_by_the_name_the_load_returned_streams_from_any_folder(kernel, tmp_path, monkeypatch):
    """The TUI loads a GGUF by its path, then streams each reply by the name the load returned (the file's name),
    from a folder where that name is no file: the loaded model answers, with no second resolve or load."""
    from tuichat.backends.local import LocalBackend
    from tuichat.backends.protocol import EngineOptions, Message, SamplingParams

    (tmp_path / "model").mkdir()
    tiny = write_tiny(tmp_path / "model", HIDDEN_K, INTER_K, FORMATS_K, OUTPUT_FORMAT_K,
                      chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    monkeypatch.setenv("TUICHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    backend = LocalBackend(EngineOptions(kv_cache_mb=16))

    async def turn() -> list:
        name = await backend.load(str(tiny.path))
        assert name == tiny.path.name and not (tmp_path / name).exists()
        return [event async for event in backend.stream("c", [Message("user", "hi")], SamplingParams(max_tokens=3),
                                                        model=name)]

    try:
        events = asyncio.run(turn())
    finally:
        asyncio.run(backend.close())
    assert not events[-1].error and events[-1].usage.completion_tokens == 3


def test_loader_serves_in_place_only_a_bf16_cpu_auto_load(kernel, kquant, tmp_path, monkeypatch):
    """loader.in_place's gate: the mapped path for a llama GGUF on a CPU in bf16 with --quant auto; the
    converted way for float32, another quant mode, or a folder."""
    from tuichat import catalog
    from tuichat.engine import loader

    monkeypatch.setenv("TUICHAT_CACHE_DIR", str(tmp_path / "cache"))
    resolved = catalog.resolve(str(kquant.path))
    cpu = torch.device("cpu")
    assert loader.in_place(resolved, cpu, torch.bfloat16)
    assert not loader.in_place(resolved, cpu, torch.float32)
    assert not loader.in_place(resolved, cpu, torch.bfloat16, quant="int8")
    assert not loader.in_place(resolved, cpu, torch.bfloat16, tp=2)
    assert not loader.in_place(dataclasses.replace(resolved, kind="local"), cpu, torch.bfloat16)
    model, tokenizer = loader.load(resolved, cpu, torch.bfloat16, mapped=True)
    assert model.tuichat_mapped is not None and tokenizer is not None
    assert not any(p.suffix == ".safetensors" for p in files_under(tmp_path / "cache"))


def test_a_load_runs_no_collection_but_the_one_that_settles_it(kernel, kquant, tmp_path, monkeypatch):
    """The collector is paused while a backend imports and loads a model: the only collection is the settle
    as the pause ends, and the collector is on again afterwards, also after a load that fails."""
    import gc

    from tuichat.backends.local import LocalBackend
    from tuichat.backends.protocol import EngineOptions

    monkeypatch.setenv("TUICHAT_CACHE_DIR", str(tmp_path / "cache"))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(kquant.path.read_bytes()[:4096])
    backend = LocalBackend(EngineOptions(kv_cache_mb=16), default_model=str(kquant.path))
    collections = []

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(count)
    try:
        backend.load_sync(str(kquant.path))
        assert collections == [2] and gc.isenabled()
        with pytest.raises(TuichatError):
            backend.load_sync(str(broken))
        assert gc.isenabled()
    finally:
        gc.callbacks.remove(count)
        asyncio.run(backend.close())


@pytest.mark.parametrize("which", ["kquant", "qwen3", "gemma3"])
def test_k_quant_replies_do_not_depend_on_batching_chunking_or_caching(kernel, which, request):
    """The mapped engine against itself, token for token (the float32 test above is the correctness reference)."""
    tiny = request.getfixturevalue(which)
    replies_independent_of_batching(lambda **config: engine(tiny, kernel, **config))


def test_the_header_reads_as_ggufs_own_reader_reads_it(plain, tmp_path):
    from gguf import GGUFReader

    reader = GGUFReader(str(plain.path))
    file = GGUFFile(plain.path)
    try:
        fields = {key: field for key, field in reader.fields.items() if not key.startswith("GGUF.")}  # the preamble's
        assert list(file.fields) == list(fields)
        for key, field in fields.items():
            assert file.types[key] == tuple(int(t) for t in field.types), key
            want, got = field.contents(), file.fields[key]
            if isinstance(got, np.ndarray):
                assert np.array_equal(got, np.asarray(want)), key
            else:
                assert got == want, key
        assert len(file.fields["tokenizer.ggml.tokens"]) == VOCAB
        assert file.architecture == "llama"
        assert list(file.tensors) == [t.name for t in reader.tensors]
        for tensor in reader.tensors:
            info = file.tensors[tensor.name]
            assert info.shape == tuple(int(n) for n in reversed(tensor.shape)), tensor.name
            assert info.type == int(tensor.tensor_type), tensor.name
            assert info.offset == int(tensor.data_offset), tensor.name
            assert info.nbytes == int(tensor.n_bytes), tensor.name
            assert np.array_equal(file.array(tensor.name), tensor.data), tensor.name
        assert mapped.gguf_model_type(plain.path) == "llama"
        end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
    finally:
        file.close()

    data = plain.path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:end - 100])  # the last tensor's last 100 bytes missing
    with pytest.raises(TuichatError) as error:
        GGUFFile(cut)
    assert f"{end:,}" in str(error.value) and f"{end - 100:,}" in str(error.value)
    cut.write_bytes(data[:2000])  # inside the token list
    with pytest.raises(TuichatError, match="truncated or corrupt"):
        GGUFFile(cut)
    for name, content in (("text.gguf", b"not a GGUF file, just some text\n" * 4), ("empty.gguf", b"")):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(TuichatError):
            GGUFFile(tmp_path / name)


def resident_kb(path: Path) -> int:
    """kB of `path`'s map resident in this process (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    total, inside = 0, False
    for line in lines:
        if "-" in line.split(" ", 1)[0]:  # a mapping's first line: its address range, ..., its path
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_a_released_tensor_leaves_the_process_memory_and_still_reads_the_same(tmp_path):
    """A tensor the load copied (a Q8_0 laid out in tiles, a re-cut Q5_0) is released: its pages leave the
    process's memory, so the file's bytes and the copy are not both resident; a read maps them again."""
    from gguf import GGUFWriter

    path = tmp_path / "two.gguf"
    values = np.random.default_rng(0).standard_normal((512, 2048)).astype(np.float32)  # 4 MiB
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("big", values)
    writer.add_tensor("small", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = GGUFFile(path)
    try:
        assert np.array_equal(file.array("big"), values) and np.array_equal(file.array("small"), np.arange(8))
        touched = resident_kb(path)
        assert touched >= values.nbytes // 1024
        file.release("big")
        assert touched - resident_kb(path) >= (values.nbytes - 2 * mmap.PAGESIZE) // 1024
        assert np.array_equal(file.array("small"), np.arange(8))  # its neighbour's bytes are still there
        assert np.array_equal(file.array("big"), values)
    finally:
        file.close()


def _small_folios(path: Path, upto: int = 0) -> None:
    """The page cache holds `path` (its first `upto` bytes, where given) in 4 KB folios: dropped, then read a page
    at a time in random order."""
    import os
    import random

    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages (a file just written) would stay
        os.posix_fadvise(fd, 0, upto, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        pages = list(range(0, upto or os.fstat(fd).st_size, mmap.PAGESIZE))
        random.Random(0).shuffle(pages)
        for offset in pages:
            os.pread(fd, 1, offset)
    finally:
        os.close(fd)


def _fresh_read_gets_2_mb_pages(path: Path) -> bool:
    """Whether `path`, dropped from the page cache and read through a map advised MADV_HUGEPAGE, is mapped in
    2 MB pages anywhere (/proc/self/smaps' FilePmdMapped)."""
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    try:
        mapped.madvise(mmap.MADV_HUGEPAGE)
        view = np.frombuffer(mapped, np.uint8)
        int(view[::mmap.PAGESIZE].sum())
        lines = Path("/proc/self/smaps").read_text().splitlines()
        start = f"{view.ctypes.data:x}-"
        at = next(i for i, line in enumerate(lines) if line.startswith(start))
        pmd = next(line for line in lines[at + 1:] if line.startswith("FilePmdMapped:"))
        del view
        return int(pmd.split()[1]) > 0
    finally:
        mapped.close()


def _served_and_copied(tmp_path: Path) -> tuple[Path, np.ndarray]:
    """A file of two tensors: "served" (16 MiB: 8 huge pages) and "copied"."""
    from gguf import GGUFWriter

    path = tmp_path / "big.gguf"
    served = np.random.default_rng(0).standard_normal((2048, 2048)).astype(np.float32)
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("served", served)
    writer.add_tensor("copied", np.ones((1024, 2048), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, served


@pytest.mark.skipif(sys.platform != "linux", reason="2 MB pages of a file's map: Linux's transparent huge pages")
def test_the_tensors_read_in_place_end_up_in_2_mb_pages_and_no_others_are_mapped(tmp_path):
    """settle_pages maps the in-place tensors in 2 MB pages even where the page cache held the file in 4 KB
    folios (read back through the map advised MADV_HUGEPAGE), and maps nothing of a tensor not named (one the
    load copied and released). Skipped where the file read again through such a map still gets no 2 MB pages."""
    path, served = _served_and_copied(tmp_path)
    whole = served.nbytes // HUGE_PAGE * HUGE_PAGE - HUGE_PAGE  # the tensor's 2 MB pages but a part one at each end
    if not _fresh_read_gets_2_mb_pages(path):
        pytest.skip("this file system or kernel gives a file's map no 2 MB pages")
    _small_folios(path)
    file = GGUFFile(path)
    try:
        assert file.settle_pages(["served"]) >= whole
        assert resident_kb(path) * 1024 < served.nbytes + 2 * HUGE_PAGE  # nothing of "copied" beyond a shared page
        assert np.array_equal(file.array("served"), served)
    finally:
        file.close()


@pytest.mark.skipif(sys.platform != "linux", reason="2 MB pages of a file's map: Linux's transparent huge pages")
def test_a_few_pages_in_small_folios_among_2_mb_ones_are_read_again(tmp_path):
    """Where the page cache holds most of the in-place tensors in 2 MB folios and a few 2 MB of them in small
    ones (that part read some other way: another program, a copy), settle_pages still maps all of them in 2 MB
    pages: the small ones found and read again, not left because most were fine."""
    path, served = _served_and_copied(tmp_path)
    whole = served.nbytes // HUGE_PAGE * HUGE_PAGE - HUGE_PAGE
    if not _fresh_read_gets_2_mb_pages(path):
        pytest.skip("this file system or kernel gives a file's map no 2 MB pages")
    _small_folios(path, upto=3 * HUGE_PAGE)  # 3 of the tensor's 8 pages: the rest stay in 2 MB folios
    file = GGUFFile(path)
    try:
        assert file.settle_pages(["served"]) >= whole
        assert np.array_equal(file.array("served"), served)
    finally:
        file.close()


def test_llama_3_rope_freqs_divide_the_rotary_frequencies(kernel, tmp_path):
    """A file with rope_freqs.weight: the engine matches a float32 model whose rotary frequencies are divided by
    those factors (llama.cpp's theta_i = pos * base^(-2i/d) / factor_i), and not one without them."""
    half = HIDDEN // HEADS // 2
    factors = np.linspace(4.0, 1.0, half, dtype=np.float32)  # the fastest pairs slowed most: visible in 50 tokens
    tiny = write_tiny(tmp_path, rope_freqs=factors)
    unscaled = tiny.reference
    scaled = reference_model(tiny.weights, HIDDEN, INTER)
    rotary = scaled.model.rotary_emb
    rotary.inv_freq = rotary.inv_freq / torch.from_numpy(factors)
    sequences, want = float32_continuations(scaled)
    with torch.inference_mode():
        plain_logits = torch.cat([unscaled(torch.tensor([s])).logits[0, len(p) - 1:-1] for s, p in zip(sequences, PROMPTS)])
    spread = want.amax(dim=1) - want.amin(dim=1)
    apart = float(((plain_logits - want).abs().amax(dim=1) / spread).mean())
    bound, mean_bound = BOUNDS["plain"]
    assert apart > 4 * mean_bound, apart  # the two references differ by far more than the engine may

    served = engine(tiny, kernel, prefix_cache=False)
    errors, agreement = teacher_forced_error(served, sequences, want)
    unscaled_errors, _ = teacher_forced_error(served, sequences, plain_logits)
    served.close()
    assert errors.max() < bound and errors.mean() < mean_bound, (errors.max(), errors.mean())
    assert agreement >= 0.9
    assert unscaled_errors.mean() > 2 * mean_bound, unscaled_errors.mean()


@pytest.mark.parametrize("qtype", [Q8_0, F16, BF16, Q4_K])
def test_the_embeddings_rows_are_ggufs_own(kernel, tmp_path, qtype):
    """token_embd in Q8_0, F16, BF16 or Q4_K: the rows a step looks up are gguf's dequantize of the file's rows,
    and (the quantized ones) the engine over them is as close to the float32 model as with an F32 table."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    k = qtype == Q4_K  # super-blocks of 256: the K-quant model's hidden size
    shape = (HIDDEN_K, INTER_K, FORMATS_K, OUTPUT_FORMAT_K) if k else ()
    tiny = write_tiny(tmp_path, *shape, embedding_format=qtype)
    token_embd = reader_tensors(tiny.path)["token_embd.weight"]
    assert int(token_embd.tensor_type) == qtype
    model = load(tiny, kernel)
    embedding = model.tuichat_mapped.embedding
    ids = [0, VOCAB - 1, 5, 5, 317, 42, 0]
    want = dequantize(np.asarray(token_embd.data)[ids], GGMLQuantizationType(qtype)).reshape(len(ids), tiny.hidden)
    got = embedding.rows(ids)
    assert got.dtype is torch.float32 and torch.equal(got, torch.from_numpy(np.asarray(want, dtype=np.float32)))
    assert torch.equal(embedding.rows(list(range(VOCAB))), torch.from_numpy(tiny.weights["model.embed_tokens.weight"]))
    assert torch.equal(model.model.embed_tokens(torch.tensor([ids])).float()[0], got)
    if qtype not in (Q8_0, Q4_K):
        return
    sequences, want_logits = float32_continuations(tiny.reference)
    served = Engine(model, config=EngineConfig(num_blocks=96, prefix_cache=False))
    errors, agreement = teacher_forced_error(served, sequences, want_logits)
    served.close()
    bound, mean_bound = BOUNDS["kquant" if k else "plain"]
    assert errors.max() < bound and errors.mean() < mean_bound, (errors.max(), errors.mean())
    assert agreement >= 0.9


def test_a_file_copied_elsewhere_reuses_its_metadata_cache(kernel, plain, tmp_path, monkeypatch):
    """The tokenizer cache is keyed by the header: a byte-identical copy elsewhere reads it back; a file whose
    metadata differs (here a chat template) gets its own."""
    from tuichat.engine import gguf_file

    cache = tmp_path / "meta"
    load(plain, kernel, cache)
    copy = tmp_path / "copy" / "tiny.gguf"
    copy.parent.mkdir()
    shutil.copyfile(plain.path, copy)
    entered = []
    original = gguf_file.as_gguf_reader
    monkeypatch.setattr(gguf_file, "as_gguf_reader", lambda file, **kw: entered.append(file.path) or original(file, **kw))
    model, tokenizer = mapped.load(copy, kernel, cache)
    assert model.tuichat_mapped.file.path == copy and tokenizer is not None
    assert entered == [] and len(list(cache.iterdir())) == 1
    template = "{{ messages[0]['content'] }}"
    other = write_tiny(tmp_path, chat_template=template)
    _, tokenizer = mapped.load(other.path, kernel, cache)
    assert entered == [other.path] and len(list(cache.iterdir())) == 2
    assert tokenizer.chat_template == template


def test_a_vocabulary_of_rows_not_a_multiple_of_16_is_served_whole(kernel, tmp_path):
    """323 rows (a llama with pad tokens added has 32001): the kernels' lm_head gets zero rows, which no logit
    shows, in the C steps and in the load's probe alike."""
    tiny = write_tiny(tmp_path, extra_tokens=3)
    sequences, want = float32_continuations(tiny.reference)
    assert want.shape[1] == VOCAB + 3
    served = engine(tiny, kernel, prefix_cache=False)
    assert served.layers == "C"
    errors, agreement = teacher_forced_error(served, sequences, want)  # shapes must agree to subtract
    served.close()
    assert errors.max() < BOUNDS["plain"][0] and agreement >= 0.9


def test_a_model_split_into_files_is_served_from_them_as_one(kernel, tmp_path):
    """llama.cpp's gguf-split layout (gguf's own writer, 5 tensors a file): opened by its first file, every
    tensor read from the file that holds it, as close to float32 as the model written whole; a later file, or a
    first without the rest, is refused by name."""
    tiny = write_tiny(tmp_path, split_max_tensors=5)
    files = sorted(tmp_path.glob("tiny-*-of-*.gguf"))
    assert len(files) > 2 and tiny.path == files[0]
    served = engine(tiny, kernel, prefix_cache=False)
    assert served.layers == "C" and len(served.model.tuichat_mapped.file.paths) == len(files)
    sequences, want = float32_continuations(tiny.reference)
    errors, agreement = teacher_forced_error(served, sequences, want)
    served.close()
    assert errors.max() < BOUNDS["plain"][0] and errors.mean() < BOUNDS["plain"][1] and agreement >= 0.9
    with pytest.raises(TuichatError, match=rf"file 2 of a model split into {len(files)}: open the first, {files[0].name}"):
        GGUFFile(files[1])
    files[-1].rename(tmp_path / "elsewhere.gguf")
    with pytest.raises(TuichatError, match=rf"file {len(files)}, {files[-1].name}, is not beside it"):
        GGUFFile(files[0])
