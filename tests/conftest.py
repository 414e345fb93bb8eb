"""Shared fixtures. Every test runs offline against temporary config/data/cache dirs; the embedded model is
converted once per test session into a temporary cache (that conversion is itself under test). The helpers
tests import are in tests/helpers.py."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

from tests.helpers import CONVERSION_STAGES, CPU_BUILDS, SERVE_KEY, cannot_run, free_port, no_kernels, server_process

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may wait on a network that is not there
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def user_dirs(tmp_path, session_cache, monkeypatch) -> SimpleNamespace:
    """The one place tests get their own config and data folders (not yet created) and the session's cache."""
    dirs = SimpleNamespace(config=tmp_path / "config", data=tmp_path / "data", cache=session_cache)
    monkeypatch.setenv("TUICHAT_CONFIG_DIR", str(dirs.config))
    monkeypatch.setenv("TUICHAT_DATA_DIR", str(dirs.data))
    monkeypatch.setenv("TUICHAT_CACHE_DIR", str(dirs.cache))
    return dirs


@pytest.fixture
def permissive_umask():
    """The usual default umask: new files readable by everyone unless tuichat says otherwise."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def _kernels_built_for(arch: str, session_cache):
    from tuichat.engine.cpu import build

    if not CPU_BUILDS[arch] <= build.cpu_flags():
        pytest.skip(cannot_run(arch, build.cpu_flags()))
    patch = pytest.MonkeyPatch()
    patch.setenv("TUICHAT_CACHE_DIR", str(session_cache))
    patch.setenv("TUICHAT_CPU_ARCH", arch)
    build.load.cache_clear()
    kernel, why = build.load()
    if kernel is None and "build failed" in why:  # a compiler that rejects the sources is a bug, not a machine kind
        patch.undo()
        build.load.cache_clear()
        pytest.fail(f"the {arch} build of the kernels failed: {why}")
    if kernel is None:
        pytest.skip(no_kernels(why))
    yield kernel
    patch.undo()
    build.load.cache_clear()


@pytest.fixture(scope="module", params=list(CPU_BUILDS))
def kernels(request, session_cache):
    """Every test runs on this CPU's build and on the others of CPU_BUILDS that it can run."""
    yield from _kernels_built_for(request.param, session_cache)


@pytest.fixture(scope="module", params=["numpy", *CPU_BUILDS])
def draw_kernels(request, session_cache):
    """What draws a sampled row: None, sampler.py's numpy path (no kernels), or each build's sample_row."""
    if request.param == "numpy":
        yield None
    else:
        yield from _kernels_built_for(request.param, session_cache)


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


@pytest.fixture(scope="module")
def server(embedded, session_cache, tmp_path_factory):
    """`tuichat serve` as a user runs it: a real subprocess on a loopback port, the embedded model in float32
    (exact: its greedy replies are transformers' own), API key SERVE_KEY. Ready (its /health answers once the
    model is loaded), always stopped; its root URL."""
    home = tmp_path_factory.mktemp("serve")
    port = free_port()
    env = {**os.environ, "TUICHAT_CACHE_DIR": str(session_cache), "TUICHAT_CONFIG_DIR": str(home / "config"),
           "TUICHAT_DATA_DIR": str(home / "data"), "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "tuichat", "serve", "--port", str(port), "--api-key", SERVE_KEY, "--dtype", "float32"]
    with server_process(argv, port, home / "serve.log", env, "tuichat serve") as base:
        yield base


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, embedded):
    """A folder with a tiny random Llama that speaks the embedded model's tokenizer and chat template."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = embedded[3]
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None)
    folder = tmp_path_factory.mktemp("tiny-chat")
    LlamaForCausalLM(copy.deepcopy(config)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
