"""Weights and tokenizer: device/dtype choice, the one-time GGUF conversion cache, accelerate device maps."""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from tuichat.engine import families
from tuichat.engine.cpu.build import cpu_flags
from tuichat.engine.heap import collector_paused, settle_heap
from tuichat.engine.storage import cache_dir
from tuichat.engine.types import ProgressCallback, ResolvedModel, TuichatError

_DONE_MARK = "tuichat-source.txt"  # written last: a folder without it is an interrupted conversion


def resolve_device(option: str) -> torch.device:
    if option == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    mps = torch.backends.mps.is_available()
    choices = ["auto", "cpu"]
    if gpus:
        choices += ["cuda", "cuda:0" if gpus == 1 else f"cuda:0 to cuda:{gpus - 1}"]
    if mps:
        choices.append("mps")
    accepted = f"use {', '.join(choices)} (torch sees {gpus or 'no'} CUDA GPU{'' if gpus == 1 else 's'})"
    try:
        device = torch.device(option)
    except RuntimeError:  # torch's message lists every device type it knows, most of them not ours
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise TuichatError(f"Unknown device '{option}': {accepted}.")
    if (device.type == "cuda" and (device.index or 0) >= gpus) or (device.type == "mps" and not mps):
        raise TuichatError(f"--device {option} is not available here: {accepted}.")
    return device


def resolve_dtype(option: str, device: torch.device, family: str | None = None, gguf: bool = False) -> torch.dtype:
    """`family`: the model's model_type, where known, and `gguf`, whether it is a GGUF file: on a CPU they decide
    whether tuichat's C layers will run."""
    if option != "auto":
        try:
            return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[option]
        except KeyError:
            raise TuichatError(f"Unknown dtype '{option}': use auto, float32, bfloat16 or float16.") from None
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # bf16 halves the bytes a CPU decode step must read. torch gains from it only with native bf16 dot products;
    # tuichat's C layers always do (they widen bf16, or read a GGUF's own blocks, and sum in fp32 or int8).
    native_bf16 = cpu_flags() & {"avx512_bf16", "amx_bf16"}
    if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX") and native_bf16:
        return torch.bfloat16
    from tuichat.engine.cpu import build, native

    return torch.bfloat16 if native.runs_in_c(family, gguf) and build.available() else torch.float32


def report(progress: ProgressCallback | None, what: str, fraction: float | None = None) -> None:
    if progress is not None:
        progress(what, fraction)


@contextmanager
def _only_our_progress():
    """transformers draws tqdm bars of its own on stderr ("Loading weights", "Writing model shards"):
    between `ask`'s progress lines, and under the TUI, for stages our callback reports already. A hub
    download keeps huggingface_hub's bars, the only progress it has."""
    from huggingface_hub import utils as hub
    from transformers.utils import logging as hf_logging

    if not hf_logging.is_progress_bar_enabled():  # off already, or this is a nested call
        yield
        return
    downloads = not hub.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()  # the hub's as well
    if downloads:
        hub.enable_progress_bars()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()  # the hub's as well
        if not downloads:
            hub.disable_progress_bars()


@contextmanager
def _dequantize_progress(progress: ProgressCallback | None, name: str):
    """transformers reports its GGUF dequantization only as a tqdm bar on stderr (not under its progress
    switch), invisible in the TUI; for the duration of the conversion, route that loop's progress to our
    callback (80-90 %, in quarters)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    if not hasattr(gguf_utils, "tqdm"):
        yield
        return

    def reporting(iterable, *args, **kwargs):
        items = list(iterable)
        step = max(1, len(items) // 4)
        for i, item in enumerate(items):
            if i % step == 0:
                report(progress, f"Dequantizing {name} (first use only)", 0.8 + 0.1 * i / len(items))
            yield item

    original = gguf_utils.tqdm
    gguf_utils.tqdm = reporting
    try:
        yield
    finally:
        gguf_utils.tqdm = original


class _CutShort(Exception):
    def __init__(self, needed: int) -> None:
        self.needed = needed


class _SizedReader(GGUFReader):
    """gguf's reader, which first checks that the tensor table fits the file: cut short, the reader would
    fail on a numpy reshape, without saying how many bytes are missing."""

    def _build_tensors(self, start_offs, fields) -> None:
        end = start_offs
        for field in fields:  # a tensor's info: name length, name, dimension count, dimensions, type, offset
            _, _, _, dims, ggml_type, offset = field.parts
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(int(ggml_type[0]))]
            end = max(end, start_offs + int(offset[0]) + math.prod(map(int, dims)) // block * block_bytes)
        if end > len(self.data):
            raise _CutShort(end)
        super()._build_tensors(start_offs, fields)


def check_gguf(gguf: Path) -> None:
    """Refuse a .gguf cut short (an interrupted download or copy) or one that is not a GGUF file before
    converting: transformers would fail on it with a numpy or struct error, after the ~20 s of reading."""
    try:
        _SizedReader(gguf)
    except _CutShort as short:
        raise TuichatError(
            f"{gguf} is truncated or corrupt: its tensors need {short.needed:,} bytes, the file has "
            f"{gguf.stat().st_size:,}. Download or copy it again."
        ) from None
    except Exception as exc:  # bytes that are no GGUF fail the reader anywhere: magic, lengths, types
        raise TuichatError(f"{gguf} is truncated or corrupt: it does not read as GGUF ({exc}).") from None


@_only_our_progress()
def converted_path(model: ResolvedModel, progress: ProgressCallback | None = None) -> Path:
    """A transformers folder for a .gguf, converting it once into the cache (the conversion takes ~15 s)."""
    from tuichat.engine.gguf_file import SPLIT_NAME

    if SPLIT_NAME.search(Path(model.source).name):  # transformers' GGUF loading reads one file
        raise TuichatError(f"{model.name} is split into several files, which tuichat serves only from the files "
                           "themselves: on a CPU, with --quant auto and --dtype auto or bfloat16, a family whose layers "
                           "run in C (llama, mistral, qwen2, qwen3, gemma3).")
    assert model.converted_dir is not None
    target = model.converted_dir
    if (target / _DONE_MARK).is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(model.source)
    check_gguf(gguf)
    started = time.monotonic()
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        # float32 keeps the dequantized weights exact; the requested dtype is applied at load time.
        # Most of the time goes to transformers reading the GGUF's metadata, with no progress to report.
        report(progress, f"Reading {gguf.name} (first use only, ~20 s)", None)
        with _dequantize_progress(progress, model.name):
            weights = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        report(progress, f"Saving converted {model.name}", 0.9)
        # The weights are plain float32 tensors now; drop the GGUF marker that makes transformers refuse
        # to serialize them.
        weights.hf_quantizer = None
        if hasattr(weights.config, "quantization_config"):
            del weights.config.quantization_config
        weights.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        (tmp / _DONE_MARK).write_text(str(gguf) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise TuichatError(f"Could not convert {gguf}: {exc}") from exc
    report(progress, f"Converted {model.name} in {time.monotonic() - started:.1f} s", 1.0)
    return target


def metadata_cache() -> Path:
    """Where a GGUF's tokenizer and config, made from its metadata, are remembered (gguf_file.config_and_tokenizer)."""
    return cache_dir() / "gguf"


def in_place(model: ResolvedModel, device: torch.device, dtype: torch.dtype, quant: str = "auto", tp: int = 1,
             device_map: str | None = None) -> bool:
    """Whether `model` is served from its file's own blocks (mapped.py): a GGUF of a family whose layers run in
    C, on a CPU in bf16 with the kernels built, its blocks as they are (--quant auto), in one process. Anything
    else goes through a conversion to a transformers folder (converted_path)."""
    if model.kind != "gguf" or device.type != "cpu" or dtype is not torch.bfloat16 or quant != "auto" or tp != 1 or device_map:
        return False
    from tuichat.engine import mapped
    from tuichat.engine.cpu import build

    return mapped.gguf_model_type(model.source) is not None and build.available()


@_only_our_progress()
def load(
    model: ResolvedModel,
    device: torch.device,
    dtype: torch.dtype,
    device_map: str | None = None,
    progress: ProgressCallback | None = None,
    with_tokenizer: bool = True,
    mapped: bool = False,
):
    """Returns (model, tokenizer or None), the model in eval mode on `device` (or spread by `device_map`).
    `mapped` (where in_place says so): served from the GGUF's own blocks (mapped.py)."""
    if mapped:
        from tuichat.engine import mapped as mapping
        from tuichat.engine.cpu import build

        report(progress, f"Mapping {model.name}", None)
        kernel, _ = build.load()
        with collector_paused():
            weights, tokenizer = mapping.load(model.source, kernel, metadata_cache(), with_tokenizer)
        report(progress, f"Loaded {model.name}", 1.0)
        return weights, tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = str(converted_path(model, progress)) if model.kind == "gguf" else model.source
    refuse_unsupported(model.name, source)
    report(progress, f"Loading {model.name}", None)
    kwargs = {"dtype": dtype}
    if device_map:
        kwargs["device_map"] = device_map
    try:
        # The tokenizer (~1 s here) loads on a second thread while the weights load and cast.
        with ThreadPoolExecutor(1) as pool:
            tokenizer = pool.submit(AutoTokenizer.from_pretrained, source) if with_tokenizer else None
            weights = AutoModelForCausalLM.from_pretrained(source, **kwargs)
            tokenizer = tokenizer.result() if tokenizer else None
    except OSError as exc:
        raise TuichatError(f"Could not load model '{model.name}': {exc}") from exc
    if not device_map:
        weights.to(device)
    weights.eval()
    settle_heap()
    report(progress, f"Loaded {model.name}", 1.0)
    return weights, tokenizer


def checkpoint_dir(model: ResolvedModel) -> Path | None:
    """The folder transformers reads `model`'s weights from: a GGUF's conversion, a local folder, a hub
    model's snapshot in the Hugging Face cache (None where there is none: a model not downloaded yet)."""
    if model.kind == "gguf":
        return model.converted_dir
    if model.kind == "local":
        return Path(model.source)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model.source, local_files_only=True))
    except Exception:  # not in the cache (or a cache huggingface_hub cannot read): nothing to key by
        return None


def quant_cache(model: ResolvedModel, quant: str) -> Path | None:
    """Where the engine caches a dense checkpoint's weights quantized for --quant `quant` (int8, int4): a folder
    of the cache dir keyed by the checkpoint's identity, its folder (a hub snapshot's path names its revision)
    and its weight files' (and config's) names, sizes and mtimes, so that a checkpoint rewritten in place is
    quantized anew. None where nothing is cached here: another mode, a GGUF (cached beside its conversion), a
    checkpoint not found."""
    from tuichat.engine.quant import QUANT_FORMATS, cache_name

    folder = checkpoint_dir(model) if quant in QUANT_FORMATS and model.kind != "gguf" else None
    if folder is None or not folder.is_dir():
        return None
    identity = [str(folder.resolve())]
    for path in sorted(folder.iterdir()):
        if (path.suffix in (".safetensors", ".bin") or path.name == "config.json") and path.is_file():
            info = path.stat()  # through a hub snapshot's links: the blob's
            identity.append(f"{path.name} {info.st_size} {info.st_mtime_ns}")
    key = hashlib.sha256("\n".join(identity).encode()).hexdigest()[:32]
    return cache_dir() / "quantized" / key / cache_name(quant)


def kv_identity(model: ResolvedModel, dtype: torch.dtype, quant: str, in_place: bool) -> str:
    """What a model's KV kept on disk (kv_disk.py) is keyed by, besides its layout: the weights' identity and how
    they are served (another quantization computes other K/V). A file's identity is its path, size, mtime and
    the digest of its first and last MiB, not of all of it: hashing gigabytes would cost seconds at every load,
    and a file rewritten in place gets a new mtime."""
    parts = [model.kind, str(dtype), quant, "in place" if in_place else "converted"]
    folder = checkpoint_dir(model) if model.kind != "gguf" else None
    files = [Path(model.source)] if model.kind == "gguf" else sorted(
        p for p in (folder.iterdir() if folder is not None and folder.is_dir() else ())
        if p.suffix in (".safetensors", ".bin", ".json") and p.is_file())
    for path in files:
        info = path.stat()  # through a hub snapshot's links: the blob's
        digest = hashlib.sha256()
        with open(path, "rb") as file:
            digest.update(file.read(2**20))
            file.seek(max(0, info.st_size - 2**20))
            digest.update(file.read(2**20))
        parts.append(f"{path.resolve()} {info.st_size} {info.st_mtime_ns} {digest.hexdigest()}")
    return "\n".join(parts)


def refuse_unsupported(name: str, source: str) -> str:
    """Refuse a family tuichat does not serve from its config alone, before seconds or minutes of weights;
    returns the family's model_type."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError, KeyError) as exc:  # no config, or an architecture transformers does not know
        raise TuichatError(f"Could not load model '{name}': {exc}") from exc
    if (why := families.unsupported(config)) is not None:
        raise TuichatError(f"tuichat cannot run {name}: {why}.")
    return families.text_config(config).model_type


# What transformers reads from a hub repo: weights as safetensors, the config, the tokenizer, the chat template
# (not a repo's GGUF files, its PyTorch pickles or Llama's original/ checkpoint).
_HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.jinja", "*.txt"]


def download(model: ResolvedModel, progress: ProgressCallback | None = None) -> ResolvedModel:
    """A hub model as a folder of the Hugging Face cache, downloaded there first where it is not yet: its config
    alone, to refuse a family tuichat does not serve before gigabytes, then the rest, reported as one figure
    (bytes of all files) through `progress`. huggingface_hub resumes a file an earlier attempt left incomplete.
    Any other model is returned as it is."""
    if model.kind != "hub":
        return model
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        with _hub_bars_off():
            config = hf_hub_download(model.source, "config.json")
        refuse_unsupported(model.name, str(Path(config).parent))
        folder = snapshot_download(model.source, allow_patterns=_HUB_FILES,
                                   tqdm_class=_download_bar(progress, model.name))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise TuichatError(f"Could not download '{model.name}' from the Hugging Face hub: {exc}") from exc
    return ResolvedModel(model.name, "local", folder)


@contextmanager
def _hub_bars_off():
    from huggingface_hub import utils as hub

    shown = not hub.are_progress_bars_disabled()
    hub.disable_progress_bars()
    try:
        yield
    finally:
        if shown:
            hub.enable_progress_bars()


def _download_bar(progress: ProgressCallback | None, name: str):
    """A tqdm class for snapshot_download that draws nothing. Its bar of bytes written, summed over every file
    (not the bar of network bytes), goes to `progress` as it rises, at most every percent; its bar of files
    counts the files done, and says the download is complete when the last one is. (The total of bytes grows as
    each file's download starts: a small file done early is not the end.)"""
    from huggingface_hub.utils import tqdm as hub_tqdm

    state = {"files": 0, "written": None}

    class Bar(hub_tqdm):
        def __init__(self, *args, **kwargs):
            self.bytes = kwargs.get("unit") == "B" and not str(kwargs.get("name", "")).endswith(".transfer")
            self.done, self.shown = kwargs.get("initial") or 0, -1.0
            if self.bytes:
                state["written"] = self
            elif kwargs.get("unit", "it") == "it" and isinstance(kwargs.get("total"), int):
                state["files"] = kwargs["total"]
            super().__init__(*args, **{**kwargs, "disable": True})

        def update(self, n=1):
            if not n:
                return
            self.done += n
            written = state["written"]
            if not self.bytes:
                if self.done == state["files"] and written is not None and written.done:  # (none: all cached)
                    report(progress, f"Downloaded {name}: {written.done / 1e6:,.1f} MB in {self.done} files", 1.0)
                return
            fraction = self.done / self.total if self.total else 1.0
            if fraction < 1.0 and abs(fraction - self.shown) >= 0.01:
                self.shown = fraction
                report(progress, f"Downloading {name}: {_size(self.done)} of {_size(self.total)}", fraction)

    return Bar


def _size(count: float) -> str:
    return f"{count / 1e3:,.1f} KB" if count < 1e6 else f"{count / 1e6:,.1f} MB"


def family(model: ResolvedModel, progress: ProgressCallback | None = None) -> str:
    """The model's family (model_type), a GGUF's from its metadata; refuses one tuichat does not serve."""
    if model.kind != "gguf":
        return refuse_unsupported(model.name, model.source)
    from tuichat.engine.gguf_file import GGUFFile, config_and_tokenizer

    file = GGUFFile(model.source)
    try:
        config, _ = config_and_tokenizer(file, metadata_cache(), with_tokenizer=False)
    finally:
        file.close()
    if (why := families.unsupported(config)) is not None:
        raise TuichatError(f"tuichat cannot run {model.name}: {why}.")
    return families.text_config(config).model_type

