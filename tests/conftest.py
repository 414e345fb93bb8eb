"""Shared fixtures. Every test runs offline against temporary config/data/cache dirs; the embedded model is
converted once per test session into a temporary cache (that conversion is itself under test)."""

from __future__ import annotations

import asyncio
import copy
import os
import stat
import time
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may wait on a network that is not there
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path, session_cache, monkeypatch):
    monkeypatch.setenv("TUICHAT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("TUICHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("TUICHAT_CACHE_DIR", str(session_cache))


@pytest.fixture
def permissive_umask():
    """The usual default umask: new files readable by everyone unless tuichat says otherwise."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def until(condition, what: str, timeout: float = 5.0) -> None:
    """Wait for `condition()` to hold, polling; fail naming `what` if it does not within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


# tuichat's CPU kernels as built for this CPU, for Zen 4-like CPUs (AVX-512 with BF16, no AMX) and for most
# laptops (AVX2): each -march value with the CPU flags it needs to run here.
CPU_BUILDS = {"native": set(), "cooperlake": {"avx512f", "avx512_bf16"}, "haswell": {"avx2", "fma"}}


@pytest.fixture(scope="module", params=list(CPU_BUILDS))
def kernels(request, session_cache):
    """Every test runs on this CPU's build and on the others of CPU_BUILDS that it can run."""
    from tuichat.engine import cpu_kernel

    if not CPU_BUILDS[request.param] <= cpu_kernel.cpu_flags():
        pytest.skip(f"this CPU cannot run a {request.param} build")
    patch = pytest.MonkeyPatch()
    patch.setenv("TUICHAT_CACHE_DIR", str(session_cache))
    patch.setenv("TUICHAT_CPU_ARCH", request.param)
    cpu_kernel.load.cache_clear()
    kernel, why = cpu_kernel.load()
    if kernel is None:
        pytest.skip(f"no kernels here: {why}")
    yield kernel
    patch.undo()
    cpu_kernel.load.cache_clear()

TINY = {
    "llama": dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
    "qwen2": dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
}


def make_tiny(arch: str = "llama", seed: int = 0):
    """A random-weight model (float32, eval) plus an identical twin with its own config object: the engine
    switches its model to paged attention, and models built from one config object would share that."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    config = config_cls(**TINY[arch], eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    reference = model_cls(copy.deepcopy(config)).eval()
    model = model_cls(copy.deepcopy(config)).eval()
    model.load_state_dict(reference.state_dict())
    return model, reference


CONVERSION_STAGES: list[tuple[str, float | None]] = []  # what the session's one GGUF conversion reported


@pytest.fixture(scope="session")
def embedded(session_cache):
    """The embedded model, converted into the session cache and loaded in float32 for exact comparisons:
    (resolved spec, model for engines, reference model for transformers' generate, tokenizer)."""
    import torch

    from tuichat import catalog
    from tuichat.engine import loader

    mp = pytest.MonkeyPatch()
    mp.setenv("TUICHAT_CACHE_DIR", str(session_cache))
    try:
        resolved = catalog.resolve(catalog.EMBEDDED_ALIAS)
        model, tokenizer = loader.load(
            resolved, torch.device("cpu"), torch.float32, progress=lambda *stage: CONVERSION_STAGES.append(stage)
        )
        reference, _ = loader.load(resolved, torch.device("cpu"), torch.float32)
    finally:
        mp.undo()
    return resolved, model, reference, tokenizer


def hf_greedy(reference, prompt_ids: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    """Plain transformers greedy decoding: the ground truth the engine must match token for token."""
    import torch

    out = reference.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )
    return out[0, len(prompt_ids):].tolist()
