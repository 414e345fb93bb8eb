"""Models where users already keep them, found and opened in place: Ollama's store, LM Studio's folders, the
Hugging Face cache's GGUF files, and folders named in config.toml (`model_dirs`). Nothing is copied, linked or
converted, and a store is only read. No torch here: LocalBackend lists these for the model picker, and resolves
their specs (backends.local.resolve) to the file they name.

Specs, by source (each also accepted by `--model`):
- `ollama/NAME:TAG` (Ollama's own library), `ollama/NAMESPACE/NAME:TAG`, `ollama/REGISTRY/NAMESPACE/NAME:TAG`
  (e.g. `ollama/hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M`); `:TAG` may be left out for `latest`, or
  for the only tag there is. The slash keeps them apart from a remote endpoint's `NAME:MODEL` (an endpoint's
  name holds no slash): `ollama:llama3.2` asks an Ollama server, `ollama/llama3.2:3b` opens its file here.
- `lmstudio/PUBLISHER/REPO/FILE.gguf` (`FILE.gguf` may be left out where the folder holds one model file).
- `hf/ORG/REPO/FILE.gguf`: a GGUF in the Hugging Face cache (a safetensors repo there is its plain hub id).
- a `model_dirs` folder's files by their paths.

Each entry's facts (family, parameters, quantization, context, size, and whether tuichat serves it) come from
the GGUF header alone, read without its vocabulary and remembered per path, size and mtime in the cache dir:
a second listing reads no file.
"""

from __future__ import annotations

import difflib
import json
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from tuichat.engine import families
from tuichat.engine.gguf_file import SPLIT_NAME
from tuichat.engine.storage import cache_dir
from tuichat.engine.types import ModelInfo, ModelNotFound, TuichatError

PREFIXES = ("ollama/", "lmstudio/", "hf/")
_MODEL_LAYER = "application/vnd.ollama.image.model"
_PARAMS_LAYER = "application/vnd.ollama.image.params"
_TEMPLATE_LAYER = "application/vnd.ollama.image.template"
_OLLAMA_LIBRARY = ("registry.ollama.ai", "library")
_FACTS = "stores.json"  # in the cache dir: path -> [size, mtime_ns, facts]
_ARCHITECTURE_TYPES = {"gemma3": "gemma3_text"}  # a GGUF's architecture -> transformers' model_type, where they differ


@dataclass(frozen=True)
class Entry:
    """A model found in a store: its spec, where its file is, and (Ollama) its parameters' stop strings and its
    Go chat template."""

    info: ModelInfo
    stop: tuple[str, ...] = ()
    template: str | None = None


# -- the stores ------------------------------------------------------------------------------------------------
def ollama_root() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def lmstudio_roots() -> list[Path]:
    home = Path.home()
    return [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


def _ollama() -> list[Entry]:
    root = ollama_root()
    manifests = root / "manifests"
    entries = []
    for manifest in sorted(p for p in manifests.glob("*/*/*/*") if p.is_file()) if manifests.is_dir() else ():
        registry, namespace, name, tag = manifest.relative_to(manifests).parts
        where = ([] if (registry, namespace) == _OLLAMA_LIBRARY else
                 [namespace] if registry == _OLLAMA_LIBRARY[0] else [registry, namespace])
        spec = "ollama/" + "/".join([*where, f"{name}:{tag}"])
        try:
            layers = json.loads(manifest.read_text(encoding="utf-8"))["layers"]
            digests = {layer["mediaType"]: layer["digest"] for layer in layers}
            sizes = {layer["mediaType"]: layer.get("size") for layer in layers}
            model = digests[_MODEL_LAYER]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            entries.append(_broken(spec, "ollama", manifest, f"its manifest {manifest} does not read as Ollama's "
                                                             f"({_say(exc)})"))
            continue
        blob = root / "blobs" / str(model).replace(":", "-")
        try:  # a blob rewritten or cut short since its manifest was written
            if isinstance(sizes[_MODEL_LAYER], int) and blob.stat().st_size != sizes[_MODEL_LAYER]:
                entries.append(_broken(spec, "ollama", blob, f"its file {blob} is {blob.stat().st_size:,} bytes where "
                                                             f"its manifest says {sizes[_MODEL_LAYER]:,}"))
                continue
        except OSError:
            pass  # missing: file_info says so
        stop: tuple[str, ...] = ()
        if _PARAMS_LAYER in digests:  # {"stop": [...], "temperature": ...}: stop strings a chat template lacks
            try:
                params = json.loads((root / "blobs" / digests[_PARAMS_LAYER].replace(":", "-")).read_text(encoding="utf-8"))
                stop = tuple(s for s in params.get("stop", ()) if isinstance(s, str))
            except (OSError, ValueError, AttributeError):
                pass
        template = None
        if _TEMPLATE_LAYER in digests:  # used only where the GGUF holds no Jinja template of its own
            try:
                template = (root / "blobs" / digests[_TEMPLATE_LAYER].replace(":", "-")).read_text(encoding="utf-8")
            except (OSError, ValueError):
                pass
        entries.append(Entry(file_info(spec, "ollama", blob), stop, template))
    return entries


def _lmstudio() -> list[Entry]:
    entries = []
    for root in lmstudio_roots():
        for path in sorted(root.glob("*/*/*.gguf")) if root.is_dir() else ():
            publisher, repo, file = path.relative_to(root).parts
            if not _later_file(file):  # a split model is listed by its first file
                entries.append(Entry(file_info(f"lmstudio/{publisher}/{repo}/{file}", "lmstudio", path)))
    return entries


def _hf_cache() -> list[Entry]:
    try:
        from huggingface_hub import constants, scan_cache_dir

        repos = [r for r in scan_cache_dir(constants.HF_HUB_CACHE).repos if r.repo_type == "model"]
    except Exception:  # no cache dir yet, or one huggingface_hub cannot read: nothing to list
        return []
    entries = []
    for repo in sorted(repos, key=lambda r: r.repo_id):
        files = {f.file_name: f.file_path for rev in repo.revisions for f in rev.files if f.file_name.endswith(".gguf")}
        for file, path in sorted(files.items()):
            if not _later_file(file):
                entries.append(Entry(file_info(f"hf/{repo.repo_id}/{file}", "hf-cache", Path(path))))
    return entries


def _dirs(folders: list[str]) -> list[Entry]:
    entries = []
    for folder in folders:
        root = Path(folder).expanduser()
        for path in sorted(root.rglob("*.gguf")) if root.is_dir() else ():
            if not _later_file(path.name):
                entries.append(Entry(file_info(str(path), "dir", path)))
    return entries


def _later_file(name: str) -> bool:
    """Whether `name` is the second or a later file of a model split by gguf-split."""
    return (part := SPLIT_NAME.search(name)) is not None and part.group(1) != "00001"


def discover(model_dirs: list[str] | None = None) -> list[Entry]:
    """Every model file found, in store order; a name found twice is marked on both, never picked silently."""
    entries = [*_ollama(), *_lmstudio(), *_hf_cache(), *_dirs(model_dirs or [])]
    _save_facts()
    places: dict[str, list[str]] = {}
    for entry in entries:
        places.setdefault(entry.info.spec, []).append(entry.info.path or "?")
    return [entry if len(places[entry.info.spec]) == 1 else
            replace(entry, info=replace(entry.info, runs=False, reason="the name is in more than one place ("
                                        + ", ".join(places[entry.info.spec]) + "): open one by its path"))
            for entry in entries]


# -- a spec to its file ----------------------------------------------------------------------------------------
def is_store_spec(spec: str) -> bool:
    return spec.startswith(PREFIXES)


def find(spec: str, model_dirs: list[str] | None = None) -> Entry:
    """The entry `spec` names. Raises ModelNotFound (listing the near ones) or TuichatError (a broken entry,
    or a name that fits several)."""
    source = spec.split("/", 1)[0]
    entries = {"ollama": _ollama, "lmstudio": _lmstudio, "hf": _hf_cache}[source]()
    _save_facts()
    exact = [e for e in entries if e.info.spec == spec]
    if not exact:  # a tag left out, or LM Studio's file: the one that fits
        stem = spec + (":" if source == "ollama" else "/")
        exact = [e for e in entries if e.info.spec == stem.rstrip(":") + ":latest"] if source == "ollama" else []
        exact = exact or [e for e in entries if e.info.spec.startswith(stem)]
    if not exact:
        names = [e.info.spec for e in entries]
        near = [n for n in names if n.startswith(spec.split(":")[0])] or difflib.get_close_matches(spec, names, 5, 0.6)
        hint = f" Found there: {', '.join(near[:8])}." if near else " `tuichat models` lists what is there."
        raise ModelNotFound(f"No model '{spec}' in {_where(source)}.{hint}")
    if len({e.info.path for e in exact}) > 1:
        raise TuichatError(f"'{spec}' fits more than one model: {', '.join(e.info.spec + ' (' + str(e.info.path) + ')' for e in exact)}. "
                           "Give the whole name, or the file's path.")
    entry = exact[0]
    if entry.info.runs is False:
        raise TuichatError(f"Cannot open {spec}: {entry.info.reason}.")
    if entry.info.path is None or not Path(entry.info.path).is_file():
        raise TuichatError(f"Cannot open {spec}: its file {entry.info.path} is gone (the store changed since it "
                           "was listed).")
    return entry


def _where(source: str) -> str:
    return {"ollama": f"Ollama's store ({ollama_root()})",
            "lmstudio": "LM Studio's folders (" + ", ".join(map(str, lmstudio_roots())) + ")",
            "hf": "the Hugging Face cache"}[source]


# -- what a file is, from its header ---------------------------------------------------------------------------
_facts_cache: dict | None = None  # the cache file's entries, as read from _facts_from
_facts_from: Path | None = None
_facts_dirty = False


def file_info(spec: str, kind: str, path: Path) -> ModelInfo:
    """The entry for a model file, with its facts (remembered per path, size and mtime)."""
    try:
        stat = path.stat()
    except OSError as exc:
        return _broken(spec, kind, path, f"its file {path} is missing ({_say(exc)})").info
    facts = _facts(path, stat)
    if "error" in facts:
        return ModelInfo(spec, kind, facts["error"], str(path), stat.st_size, "gguf", runs=False, reason=facts["error"])
    family = facts["family"]
    why = families.unsupported_family(family) if family else "its header names no architecture"
    size = facts.get("size", stat.st_size)  # a split model's: all its files'
    described = " · ".join(x for x in (family, _count(facts["parameters"]), facts["quant"], f"{size / 1e9:.2f} GB",
                                       f"ctx {facts['context']}" if facts["context"] else "",
                                       f"{facts['files']} files" if facts.get("files", 1) > 1 else "") if x)
    return ModelInfo(spec, kind, described, str(path), size, "gguf", family, facts["quant"], facts["parameters"],
                     facts["context"], why is None, why)


def _facts(path: Path, stat: os.stat_result) -> dict:
    global _facts_cache, _facts_from, _facts_dirty
    if _facts_cache is None or _facts_from != cache_dir():
        _facts_from, _facts_dirty = cache_dir(), False
        try:
            loaded = json.loads((_facts_from / _FACTS).read_text(encoding="utf-8"))
            _facts_cache = loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError):
            _facts_cache = {}
    key, seen = str(path), [stat.st_size, stat.st_mtime_ns]
    cached = _facts_cache.get(key)
    if isinstance(cached, list) and len(cached) == 3 and cached[:2] == seen and isinstance(cached[2], dict):
        return cached[2]
    facts = _read_facts(path)
    _facts_cache[key] = [*seen, facts]
    _facts_dirty = True
    return facts


def _read_facts(path: Path) -> dict:
    from tuichat.engine.gguf_file import GGUFFile  # (numpy, on first use)

    try:
        file = GGUFFile(path, summary=True)
    except TuichatError as exc:
        return {"error": str(exc)}
    try:
        arch = file.architecture
        parameters = sum(_product(t.shape) for t in file.tensors.values())
        return {"family": _ARCHITECTURE_TYPES.get(arch, arch) or None, "parameters": parameters,
                "quant": _file_type(file.fields.get("general.file_type")),
                "context": _int(file.fields.get(f"{arch}.context_length")),
                "size": sum(p.stat().st_size for p in file.paths), "files": len(file.paths)}
    finally:
        file.close()


def _save_facts() -> None:
    """The facts read this listing, written whole and renamed into place (an unwritable cache: read again next
    time)."""
    global _facts_dirty
    if not _facts_dirty or _facts_cache is None or _facts_from is None:
        return
    try:
        folder = _facts_from
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, encoding="utf-8") as tmp:
            json.dump(_facts_cache, tmp)
        os.replace(tmp.name, folder / _FACTS)
        _facts_dirty = False
    except OSError:
        pass


def _file_type(value) -> str | None:
    if value is None:
        return None
    try:
        from gguf import LlamaFileType

        return LlamaFileType(int(value)).name.removeprefix("MOSTLY_").replace("ALL_", "")
    except (ValueError, TypeError):
        return f"file type {value}"


def _product(shape) -> int:
    n = 1
    for dim in shape:
        n *= int(dim)
    return n


def _int(value) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _count(parameters: int | None) -> str:
    if not parameters:
        return ""
    return f"{parameters / 1e9:.1f}B" if parameters >= 1e9 else f"{parameters / 1e6:.0f}M"


def _broken(spec: str, kind: str, path: Path, why: str) -> Entry:
    return Entry(ModelInfo(spec, kind, why, None if not path.exists() else str(path), None, "gguf", runs=False, reason=why))


def _say(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
