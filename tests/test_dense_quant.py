"""--quant int8 / int4 for a dense checkpoint (quant.from_dense, quant.packed_weights): a tiny random-weight llama
saved as float32 safetensors goes through the real loader and Engine. Its linears and lm_head must be served in
Q8_0 blocks, or Q4_1 ones with a Q8_0 lm_head, quantized from the file's float32 (not from the bf16 the model
loaded in), stay as close to the float32 model as those blocks allow, give replies that do not depend on
batching, chunking or caching, be cached once and reused, and — where the C layers do not run — serve
unquantized, saying why."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import (
    PROMPTS,
    cache_contents,
    float32_continuations,
    greedy,
    replies_independent_of_batching,
    teacher_forced_error,
)
from tuichat.backends.protocol import EngineOptions, TuichatError
from tuichat.engine import quant
from tuichat.engine.engine import Engine, EngineConfig

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 128, 256, 2, 4, 2, 32, 320
Q8_0, Q4_1 = 8, 3
FORMATS = {"int8": (Q8_0, Q8_0), "int4": (Q4_1, Q8_0)}  # (the decoder linears', the lm_head's)
WEIGHTS = {"int8": "Q8_0", "int4": "Q4_1, Q8_0"}
LINEARS = [f"model.layers.{i}.{name}" for i in range(LAYERS) for name in quant.LINEARS] + ["lm_head"]


@dataclasses.dataclass
class Dense:
    resolved: object  # catalog.ResolvedModel of the checkpoint folder
    folder: Path  # model.safetensors in float32, a tokenizer and a chat template
    reference: torch.nn.Module  # float32, the file's weights


def save_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer (the 256 byte symbols are the vocabulary's first ids) with a bare chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {symbol: i for i, symbol in enumerate(bytes_to_unicode().values())}
    vocab |= {f"<x{i}>": i for i in range(len(vocab), VOCAB)}  # the model's other ids, so that every id decodes
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    template = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=template).save_pretrained(folder)


def make_checkpoint(folder: Path, seed: int = 0, tied: bool = False) -> torch.nn.Module:
    """A tiny llama (float32) saved to `folder`: sharp attention and peaked logits (weights 0.08, embeddings and
    norms around 1), so that a wrong block, scale or row shows in them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=2048, rms_norm_eps=1e-5, initializer_range=0.08,
                         tie_word_embeddings=tied, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_()
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1 + 0.2 * torch.randn_like(parameter))
    model.save_pretrained(folder)
    save_tokenizer(folder)
    return model


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Dense:
    from tuichat import catalog

    folder = tmp_path_factory.mktemp("dense") / "tiny-llama"
    reference = make_checkpoint(folder)
    return Dense(catalog.resolve(str(folder)), folder, reference)


def load(dense: Dense, dtype=torch.bfloat16):
    """A fresh model through the real loader, as LocalBackend loads it (an engine rewires its model)."""
    from tuichat.engine import loader

    model, _ = loader.load(dense.resolved, torch.device("cpu"), dtype, with_tokenizer=False)
    return model


def engine(dense: Dense, mode: str, model=None, **config) -> Engine:
    config.setdefault("num_blocks", 96)
    config.setdefault("quant_source", dense.folder)
    return Engine(model or load(dense), config=EngineConfig(quant=mode, **config), source=dense.resolved)


def block_bytes(mode: str) -> int:
    """Bytes of every linear and the lm_head in `mode`'s blocks of 32."""
    linears, head = FORMATS[mode]
    shapes = [((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), (HIDDEN, HEADS * HEAD_DIM), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    decoder = sum(n * k for n, k in shapes) * LAYERS
    return (decoder * quant.BLOCK_BYTES[linears] + VOCAB * HIDDEN * quant.BLOCK_BYTES[head]) // 32


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_every_linear_and_the_lm_head_is_served_in_blocks(kernels, dense, mode):
    served = engine(dense, mode)
    assert served.layers == "C"
    assert served.weights == WEIGHTS[mode]
    linears, head = FORMATS[mode]
    assert [w.format for w in served.runner.native.weights] == [linears] * (4 * LAYERS) + [head]
    assert served.weight_bytes == block_bytes(mode)  # about a half (int8) or a third (int4) of bf16's
    for layer in served.model.model.layers:  # the bf16 copies are freed: every step runs through decoder.c
        for linear in (layer.self_attn.fused_q_k_v, layer.self_attn.o_proj, layer.mlp.fused_gate_up, layer.mlp.down_proj):
            assert linear.weight.numel() == 0
    assert served.model.lm_head.weight.numel() == 0
    served.close()


def quantized(weight: torch.Tensor, format: int) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    return quantize(weight.detach().float().numpy(), GGMLQuantizationType(format))


@pytest.mark.parametrize("tied", [False, True])
def test_the_blocks_are_quantized_from_the_files_float32(kernels, tmp_path, tied):
    """From the float32 file, not from the loaded bf16 (which a tied lm_head finds as the embedding); where
    the file does not hold what the model loaded (here one linear changed after the load), from the model."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "checkpoint"
    reference = make_checkpoint(folder, seed=1, tied=tied)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    changed = model.model.layers[1].mlp.up_proj.weight
    with torch.no_grad():
        changed[0] = -changed[0]
    packed = quant.from_dense(model, kernels, Q4_1, folder, head_format=Q8_0)
    assert sorted(packed) == sorted(LINEARS)
    for name in LINEARS:
        weight = (model if name == "model.layers.1.mlp.up_proj" else reference).get_submodule(name).weight
        format = Q8_0 if name == "lm_head" else Q4_1
        want = kernels.pack(np.ascontiguousarray(quantized(weight, format)), format, weight.shape[1])
        assert packed[name].format == format and torch.equal(packed[name].data, want), name
    # Without the file, from the bf16 model: other blocks (so the comparison above tells the two apart).
    without_file = quant.from_dense(model, kernels, Q4_1, head_format=Q8_0)
    assert sum(not torch.equal(without_file[n].data, packed[n].data) for n in LINEARS) >= len(LINEARS) - 1


# Off by at most this much of a row's logit range (max, mean), teacher-forced against float32, and agreeing on
# the argmax at least this often. Measured here (an AVX-512 VNNI build and a Haswell one): bf16 (--quant none)
# 0.6 % / 0.44 %; int8 1.1 % / 0.8 % (36 rows: 34 or 35 argmaxes agree), its int8 activations as much as its
# weights; int4 9.5 % / 6.3 % (27 of 36), 4-bit blocks of Gaussian weights being 8 % off in RMS (Q4_0's: 8.5 % /
# 6.9 %; with a Q4_1 lm_head too: 10.6 % / 7.7 %). The bounds leave room for other builds' summation orders; a
# wrong block layout, scale or row order is tens of % off.
BOUNDS = {"int8": (0.03, 0.015, 0.9), "int4": (0.2, 0.12, 0.6)}


def test_as_close_to_float32_as_their_blocks_allow(kernels, dense):
    """Teacher-forced along the float32 model's greedy replies."""
    sequences, want = float32_continuations(dense.reference)
    means = {}
    for mode in ("int8", "int4"):
        served = engine(dense, mode, prefix_cache=False)
        assert served.weights == WEIGHTS[mode]
        errors, agreement = teacher_forced_error(served, sequences, want)
        served.close()
        bound_max, bound_mean, bound_agreement = BOUNDS[mode]
        assert errors.max() < bound_max and errors.mean() < bound_mean, (mode, errors.max(), errors.mean())
        assert agreement >= bound_agreement, (mode, agreement)
        means[mode] = errors.mean()
    assert means["int8"] < means["int4"] / 2  # 8-bit blocks are finer than 4-bit ones, by far


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_replies_do_not_depend_on_batching_chunking_or_caching(kernels, dense, mode):
    """Token for token against itself: each row's arithmetic is its own whatever shares its step; and 600 rows
    in one step (decoder.c runs them as 512 + 88) give the replies of 64-row chunks."""
    prompts, expected = replies_independent_of_batching(lambda **config: engine(dense, mode, **config))
    wide = engine(dense, mode, max_batched_tokens=1024)
    assert greedy(wide, [prompts[3], prompts[1]]) == [expected[3], expected[1]]
    wide.close()


def quantize_must_not_run(monkeypatch) -> None:
    import gguf.quants

    def refuse(*args):
        raise AssertionError("quantized again: the cache was not used")

    monkeypatch.setattr(gguf.quants, "quantize", refuse)
    monkeypatch.setattr(quant, "from_dense", refuse)


def test_the_cache_is_written_once_and_reused(kernels, dense, tmp_path, monkeypatch):
    cache = tmp_path / "cache" / quant.cache_name("int4")
    first = engine(dense, "int4", quant_cache=cache)
    assert cache.is_file()
    replies = greedy(first, PROMPTS)
    first.close()
    quantize_must_not_run(monkeypatch)
    second = engine(dense, "int4", quant_cache=cache)
    assert second.weights == "Q4_1, Q8_0" and second.weight_bytes == block_bytes("int4")
    assert greedy(second, PROMPTS) == replies
    second.close()


def retag(cache: Path, tag: str) -> None:
    from safetensors.torch import save_file

    meta, tensors = cache_contents(cache)
    save_file(tensors, str(cache), {**meta, "quant": tag})


@pytest.mark.parametrize("damage", ["garbage", "empty", "int4 in another format", "another mode"])
def test_a_damaged_or_stale_cache_is_quantized_again_and_rewritten(kernels, dense, tmp_path, monkeypatch, damage):
    cache = tmp_path / quant.cache_name("int4")
    engine(dense, "int4", quant_cache=cache).close()
    good_meta, good_tensors = cache_contents(cache)
    if damage == "garbage":
        cache.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    elif damage == "empty":
        cache.write_bytes(b"")
    else:  # a cache of int4 as Q4_0 (another tuichat's choice), or int8's file under int4's name
        retag(cache, "int4 Q4_0 Q8_0" if damage == "int4 in another format" else "int8 Q8_0 Q8_0")
    calls = []
    original = quant.from_dense
    monkeypatch.setattr(quant, "from_dense", lambda *a, **k: calls.append(1) or original(*a, **k))
    served = engine(dense, "int4", quant_cache=cache)
    assert calls == [1] and served.weights == "Q4_1, Q8_0"
    served.close()
    meta, tensors = cache_contents(cache)
    assert meta == good_meta and tensors.keys() == good_tensors.keys()
    assert all(torch.equal(tensors[name], good_tensors[name]) for name in tensors)


def test_an_unwritable_cache_still_serves(kernels, dense, tmp_path):
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    served = engine(dense, "int8", quant_cache=blocked / quant.cache_name("int8"))
    assert served.weights == "Q8_0" and greedy(served, PROMPTS[1:2])
    served.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [blocked.name]


def test_where_the_c_layers_do_not_run_the_model_serves_in_its_dtype_and_says_why(dense, monkeypatch):
    """A family decoder.c runs only over a GGUF's own blocks (qwen3), a float32 model, no CPU kernels: no quantization runs,
    the model serves as it loaded, and `weights` says why int8 was not applied."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tuichat.engine.cpu import build

    monkeypatch.setattr(quant, "from_dense", lambda *a, **k: pytest.fail("quantized where the C layers do not run"))
    config = AutoConfig.for_model("qwen3", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                                  num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                  head_dim=HEAD_DIM, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    qwen3 = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    cases = [
        (qwen3, "bfloat16 (int8 needs the C layers: qwen3 layers run in C only over a GGUF served from its file)"),
        (load(dense, torch.float32), "float32 (int8 needs the C layers: they run in bfloat16, not float32)"),
    ]
    for model, weights in cases:
        served = Engine(model, config=EngineConfig(quant="int8", num_blocks=96))
        assert served.weights == weights
        assert greedy(served, PROMPTS[1:2], tokens=3)
        served.close()
    try:
        with monkeypatch.context() as patch:
            patch.setenv("TUICHAT_CPU_KERNELS", "0")
            build.load.cache_clear()
            served = engine(dense, "int4")
        assert served.weights == "bfloat16 (int4 needs the C layers: no CPU kernels: off (TUICHAT_CPU_KERNELS))"
        assert served.layers == "transformers" and greedy(served, PROMPTS[1:2], tokens=3)
        served.close()
    finally:
        build.load.cache_clear()  # the kernels again for the tests after this one


def ask(*args: str) -> dict:
    """`tuichat ask --json`, greedy, in this process (its kernels are the fixture's build)."""
    from click.testing import CliRunner

    from tuichat.cli import main

    result = CliRunner().invoke(main, ["ask", "hi", "--json", "--max-tokens", "3", "--temperature", "0", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_ask_quantizes_once_into_the_cache_and_shows_it(kernels, dense, session_cache, monkeypatch):
    """Through the CLI and LocalBackend: the cache is a folder of the cache dir keyed by the checkpoint's files;
    a second `ask` reads it; rewriting a weight file gives another key."""
    from tuichat.engine import loader

    cache = loader.quant_cache(dense.resolved, "int8")
    assert cache.parent.parent == session_cache / "quantized" and cache.name == quant.cache_name("int8")
    assert loader.quant_cache(dense.resolved, "auto") is None and loader.quant_cache(dense.resolved, "none") is None
    cache.unlink(missing_ok=True)
    shown = lambda result: (result["quant"], result["weights"], result["weight_mb"], result["text"])  # noqa: E731
    first = shown(ask("--model", str(dense.folder), "--quant", "int8"))
    assert first[:3] == ("int8", "Q8_0", round(block_bytes("int8") / 2**20, 1))
    assert cache.is_file()
    with monkeypatch.context() as patch:
        quantize_must_not_run(patch)
        assert shown(ask("--model", str(dense.folder), "--quant", "int8")) == first
    weights = dense.folder / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    try:
        assert loader.quant_cache(dense.resolved, "int8") != cache
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert loader.quant_cache(dense.resolved, "int8") == cache


@pytest.mark.parametrize("value", ["int8", "int4", "none", "auto"])
def test_the_cli_and_the_config_take_every_quant_mode(tmp_path, value):
    from click.testing import CliRunner

    from tuichat.cli import main
    from tuichat.config import load_config

    seen = []

    async def asked(model, options, *rest):
        seen.append(options.quant)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("tuichat.cli._ask", asked)
        result = CliRunner().invoke(main, ["ask", "hi", "--quant", value])
    assert result.exit_code == 0, result.output
    assert seen == [value]
    path = tmp_path / "config.toml"
    path.write_text(f'[engine]\nquant = "{value}"\n')
    config, warnings = load_config(path)
    assert warnings == [] and config.engine == EngineOptions(quant=value)


def test_a_bad_quant_mode_is_refused_with_the_choices(tmp_path, dense):
    from click.testing import CliRunner

    from tuichat.cli import main
    from tuichat.config import load_config

    result = CliRunner().invoke(main, ["ask", "hi", "--quant", "int3"])
    assert result.exit_code == 2
    assert "Invalid value for '--quant': 'int3' is not one of 'auto', 'none', 'int8', 'int4'." in result.output
    path = tmp_path / "config.toml"
    path.write_text('[engine]\nquant = "q4_k"\n')
    config, warnings = load_config(path)
    assert config.engine.quant == "auto"
    assert warnings == [f'{path}: "engine.quant" must be one of "auto", "none", "int8", "int4", not "q4_k"; '
                        "using the default."]
    with pytest.raises(TuichatError, match=r"^Unknown quant 'int3': use auto, none, int8, int4\.$"):
        engine(dense, "int3")
