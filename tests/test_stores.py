"""Models where users keep them (tuichat.stores): an Ollama store, LM Studio's folders, a Hugging Face cache and a
config folder, laid out by the test in a temporary HOME as those programs lay them out, each holding the embedded
model's GGUF. Each is listed with facts read independently here (gguf's own GGUFReader), opened by its spec, and
answers greedily as transformers' float32 model does, with nothing copied into the cache dir; broken entries
(a corrupt manifest, a missing blob, an unsupported family, one name twice) each get a clear line and a clear
error, while the rest of the list stays usable."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tests.helpers import hf_greedy
from tuichat import catalog
from tuichat.backends.endpoints import split_spec
from tuichat.backends.local import LocalBackend, resolve
from tuichat.backends.protocol import EngineOptions, Message, ModelNotFound, SamplingParams, TuichatError
from tuichat.cli import main
from tuichat.engine import stores

OLLAMA = "ollama/smollm2:135m"
LMSTUDIO = "lmstudio/bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_1.gguf"
HF = "hf/HuggingFaceTB/SmolLM2-135M-Instruct-GGUF/smollm2-135m-instruct-q4_1.gguf"


def ollama_model(root: Path, name: str, tag: str, blob_target: Path | None, digest: str, size: int | None = None,
                 params: dict | None = None, namespace: str = "library") -> Path:
    """An Ollama manifest and blobs as `ollama pull` writes them (the model blob a link to `blob_target`)."""
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    layers = [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
               "size": size if size is not None else (blob_target.stat().st_size if blob_target else 0)}]
    if blob_target is not None:
        (blobs / f"sha256-{digest}").symlink_to(blob_target)
    if params is not None:
        params_digest = hashlib.sha256(json.dumps(params).encode()).hexdigest()
        (blobs / f"sha256-{params_digest}").write_text(json.dumps(params))
        layers.append({"mediaType": "application/vnd.ollama.image.params", "digest": f"sha256:{params_digest}", "size": 1})
    manifest = root / "manifests" / "registry.ollama.ai" / namespace / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "config": {}, "layers": layers}))
    return manifest


def hf_cache_file(cache: Path, repo: str, file: str, target: Path) -> None:
    """huggingface_hub's cache layout: blobs, a snapshot whose file links to its blob, refs/main."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    revision = "0123456789abcdef0123456789abcdef01234567"
    (folder / "blobs").mkdir(parents=True)
    (folder / "blobs" / "a").symlink_to(target)
    (folder / "snapshots" / revision).mkdir(parents=True)
    (folder / "snapshots" / revision / file).symlink_to(Path("../../blobs/a"))
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(revision)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> Path:
    """A copy of the embedded GGUF for the stores' links to point at: a test writing through a link must never
    reach the installed package's file."""
    copy = tmp_path_factory.mktemp("gguf") / "model.gguf"
    shutil.copyfile(catalog.embedded_gguf(), copy)
    return copy


@pytest.fixture
def home(tmp_path, monkeypatch, gguf, session_cache):
    """A HOME with the embedded GGUF in each store, and a config folder: (HOME, the model_dirs folder). The cache
    is the test's own, with the session's kernels copied in (modes kept): a load here builds none."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    import huggingface_hub.constants  # read once at its import, which an earlier test may have done

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("TUICHAT_CACHE_DIR", str(tmp_path / "cache"))
    if (session_cache / "kernels").is_dir():
        shutil.copytree(session_cache / "kernels", tmp_path / "cache" / "kernels")
    ollama_model(home / ".ollama" / "models", "smollm2", "135m", gguf, "1" * 64, params={"stop": ["<|im_end|>"]})
    lmstudio = home / ".lmstudio" / "models" / "bartowski" / "SmolLM2-135M-Instruct-GGUF"
    lmstudio.mkdir(parents=True)
    (lmstudio / "SmolLM2-135M-Instruct-Q4_1.gguf").symlink_to(gguf)
    hf_cache_file(tmp_path / "hf", "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "smollm2-135m-instruct-q4_1.gguf", gguf)
    folder = tmp_path / "models" / "small"
    folder.mkdir(parents=True)
    (folder / "mine.gguf").symlink_to(gguf)
    return home, tmp_path / "models"


def reader_facts(path: Path) -> dict:
    """The facts, by gguf's own reader."""
    from gguf import GGUFReader, LlamaFileType

    reader = GGUFReader(str(path))
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    arch = field("general.architecture")
    return {"family": arch, "parameters": int(sum(int(np.prod(t.shape)) for t in reader.tensors)),
            "quant": LlamaFileType(field("general.file_type")).name.removeprefix("MOSTLY_"),
            "context": field(f"{arch}.context_length"), "size_bytes": path.stat().st_size}


def test_each_store_lists_its_model_with_the_files_facts(home, gguf):
    _, folder = home
    listed = {info.spec: info for info in LocalBackend(model_dirs=[str(folder)]).list_models()}
    want = reader_facts(gguf)
    specs = [OLLAMA, LMSTUDIO, HF, str(folder / "small" / "mine.gguf")]
    for spec, kind in zip(specs, ["ollama", "lmstudio", "hf-cache", "dir"]):
        info = listed[spec]
        assert info.kind == kind and info.format == "gguf" and info.runs is True and info.reason is None
        assert {k: getattr(info, k) for k in want} == want
        assert Path(info.path).resolve() == gguf


def test_models_json_gives_one_object_a_line(home, monkeypatch, tmp_path):
    _, folder = home
    config = tmp_path / "config"
    config.mkdir()
    (config / "config.toml").write_text(f'model_dirs = ["{folder}"]\n')
    monkeypatch.setenv("TUICHAT_CONFIG_DIR", str(config))
    result = CliRunner().invoke(main, ["models", "--json"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines()]
    by_spec = {row["spec"]: row for row in rows}
    for key in ("spec", "source", "path", "size_bytes", "format", "family", "runs", "reason"):
        assert all(key in row for row in rows)
    assert by_spec[OLLAMA]["source"] == "ollama" and by_spec[HF]["source"] == "hf-cache"
    assert by_spec["smollm2-135m"]["source"] == "embedded"
    assert by_spec[str(folder / "small" / "mine.gguf")]["source"] == "dir"


def test_a_second_listing_reads_no_file(home, monkeypatch):
    _, folder = home
    first = LocalBackend(model_dirs=[str(folder)]).list_models()
    from tuichat.engine import gguf_file

    monkeypatch.setattr(gguf_file.GGUFFile, "__init__", lambda *a, **k: pytest.fail("a header was read again"))
    assert LocalBackend(model_dirs=[str(folder)]).list_models() == first
    monkeypatch.setattr(stores, "_facts_cache", None)  # as a new process: from the cache dir's file
    assert LocalBackend(model_dirs=[str(folder)]).list_models() == first


def test_models_of_every_store_answer_as_transformers_float32_does(home, embedded, session_cache, monkeypatch):
    """Opened by their specs (served in float32: exact), each store's model gives transformers' own greedy reply;
    the session's cache dir gains nothing model-sized (the conversion is the embedded model's, found by its
    content; at most the listing's facts and the tokenizer of the file's header, once)."""
    from tuichat.backends.local import chat_ids

    _, folder = home
    _, _, reference, tokenizer = embedded
    monkeypatch.setenv("TUICHAT_CACHE_DIR", str(session_cache))
    messages = [Message("user", "What is the capital of France?")]
    want = tokenizer.decode(hf_greedy(reference, chat_ids(tokenizer, messages), 8, tokenizer.eos_token_id),
                            skip_special_tokens=True)
    before = {p: p.stat().st_size for p in session_cache.rglob("*") if p.is_file()}
    backend = LocalBackend(EngineOptions(dtype="float32", kv_cache_mb=16))

    async def reply(spec: str) -> str:
        await backend.load(spec)
        text = []
        async for event in backend.stream(spec, messages, SamplingParams(max_tokens=8, temperature=0.0), spec):
            assert not event.error, event.error
            text.append(event.text or "")
        return "".join(text)

    try:
        for spec in (OLLAMA, LMSTUDIO, HF, str(folder / "small" / "mine.gguf")):
            assert asyncio.run(reply(spec)) == want, spec
    finally:
        asyncio.run(backend.close())
    grown = [p for p in session_cache.rglob("*") if p.is_file() and p.stat().st_size != before.get(p)]
    assert not [p for p in grown if p.parent.parent == catalog.converted_root()], grown  # no conversion of its own
    assert sum(p.stat().st_size for p in grown) < 20 * 2**20, grown  # the listing's facts, the header's tokenizer


def test_specs_take_a_default_tag_and_say_what_fits(home, gguf):
    home_dir, _ = home
    root = home_dir / ".ollama" / "models"
    assert resolve("ollama/smollm2").source == resolve(OLLAMA).source  # the only tag
    ollama_model(root, "smollm2", "latest", gguf, "2" * 64)
    assert resolve("ollama/smollm2").name == "ollama/smollm2:latest"
    ollama_model(root, "qwen", "a", gguf, "3" * 64)
    ollama_model(root, "qwen", "b", gguf, "4" * 64)
    with pytest.raises(TuichatError, match=r"fits more than one model: ollama/qwen:a .*ollama/qwen:b"):
        resolve("ollama/qwen")
    with pytest.raises(ModelNotFound, match=r"No model 'ollama/smollm3:1b' in Ollama's store .*Found there: ollama/smollm2"):
        resolve("ollama/smollm3:1b")
    assert resolve(LMSTUDIO.rsplit("/", 1)[0]).source.endswith("Q4_1.gguf")  # its only file
    # An endpoint named ollama keeps its NAME:MODEL specs; the store's have a slash, which no endpoint name has.
    assert split_spec("ollama:llama3.2", ["ollama"]) == ("ollama", "llama3.2")
    assert split_spec(OLLAMA, ["ollama"]) is None


def test_broken_entries_each_say_why_and_the_rest_stay_usable(home, tmp_path, gguf):
    from gguf import GGUFWriter

    home_dir, folder = home
    root = home_dir / ".ollama" / "models"
    (ollama_model(root, "corrupt", "latest", None, "5" * 64)).write_text("{ not json")
    ollama_model(root, "gone", "latest", None, "6" * 64, size=1000)
    ollama_model(root, "cut", "latest", gguf, "7" * 64, size=1000)
    mamba = tmp_path / "mamba.gguf"
    writer = GGUFWriter(str(mamba), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    (folder / "mamba.gguf").symlink_to(mamba)
    twice = home_dir / ".cache" / "lm-studio" / "models" / "bartowski" / "SmolLM2-135M-Instruct-GGUF"
    twice.mkdir(parents=True)
    (twice / "SmolLM2-135M-Instruct-Q4_1.gguf").symlink_to(gguf)
    (folder / "garbage.gguf").write_bytes(b"GGUF" + os.urandom(40))

    listed = {info.spec: info for info in LocalBackend(model_dirs=[str(folder)]).list_models()}
    reasons = {
        "ollama/corrupt:latest": "does not read as Ollama's",
        "ollama/gone:latest": "is missing",
        "ollama/cut:latest": "where its manifest says 1,000",
        str(folder / "mamba.gguf"): "the mamba family is not one tuichat has verified",
        LMSTUDIO: "the name is in more than one place",
        str(folder / "garbage.gguf"): "truncated or corrupt",
    }
    for spec, why in reasons.items():
        assert listed[spec].runs is False and why in listed[spec].reason, (spec, listed[spec])
    assert listed[OLLAMA].runs and listed[HF].runs  # the rest are listed as before
    for spec in ("ollama/corrupt:latest", "ollama/gone:latest", "ollama/cut:latest"):
        with pytest.raises(TuichatError, match=reasons[spec]):
            resolve(spec)
    with pytest.raises(TuichatError, match="fits more than one model"):
        resolve(LMSTUDIO)
    result = CliRunner().invoke(main, ["models"])
    assert result.exit_code == 0 and OLLAMA in result.output and "cannot run: the name is in more than one place" in result.output


def test_a_model_split_into_files_is_listed_once_with_all_its_bytes(home):
    from tests.tiny_gguf import write_gguf

    home_dir, _ = home
    repo = home_dir / ".lmstudio" / "models" / "someone" / "Tiny-GGUF"
    repo.mkdir(parents=True)
    write_gguf(repo / "tiny.gguf", split_max_tensors=5)
    files = sorted(repo.glob("*.gguf"))
    listed = [info for info in LocalBackend().list_models() if info.spec.startswith("lmstudio/someone/")]
    assert [info.spec for info in listed] == [f"lmstudio/someone/Tiny-GGUF/{files[0].name}"]
    assert listed[0].size_bytes == sum(f.stat().st_size for f in files) and listed[0].runs
    assert f"{len(files)} files" in listed[0].description
    assert resolve("lmstudio/someone/Tiny-GGUF").source == str(files[0])  # the folder's one model


def test_an_ollama_models_stop_strings_end_its_replies(home, embedded, session_cache, monkeypatch, gguf):
    """Its params layer's stop strings join every reply's: "Paris" ends the reply before it."""
    from tuichat.backends.local import chat_ids

    home_dir, _ = home
    ollama_model(home_dir / ".ollama" / "models", "smollm2", "stops", gguf, "8" * 64, params={"stop": ["Paris"]})
    _, _, reference, tokenizer = embedded
    monkeypatch.setenv("TUICHAT_CACHE_DIR", str(session_cache))
    messages = [Message("user", "What is the capital of France?")]
    whole = tokenizer.decode(hf_greedy(reference, chat_ids(tokenizer, messages), 8, tokenizer.eos_token_id),
                             skip_special_tokens=True)
    assert "Paris" in whole
    backend = LocalBackend(EngineOptions(dtype="float32", kv_cache_mb=16))

    async def reply(spec: str) -> str:
        await backend.load(spec)
        return "".join([event.text or "" async for event in backend.stream("c", messages, SamplingParams(max_tokens=8, temperature=0.0), spec)])

    try:
        assert asyncio.run(reply("ollama/smollm2:stops")) == whole.split("Paris")[0]
        assert asyncio.run(reply(OLLAMA)) == whole  # its own params stop only at <|im_end|>
    finally:
        asyncio.run(backend.close())


SMOLLM_GO_TEMPLATE = """{{- range $i, $m := .Messages }}
{{- if and (eq $i 0) (ne .Role "system") }}<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
{{ end }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
"""


def test_an_ollama_gguf_without_a_jinja_template_takes_its_go_template(home, embedded, tmp_path):
    """A GGUF whose header holds no chat template (its key renamed in a copy) and the manifest's template layer:
    the prompt is what the embedded model's own Jinja template renders, and the reply is the one the same
    weights give under the file's own template."""
    from tuichat.backends.local import chat_text

    home_dir, _ = home
    data = catalog.embedded_gguf().read_bytes()
    assert data.count(b"tokenizer.chat_template") == 1
    bare = tmp_path / "bare.gguf"
    bare.write_bytes(data.replace(b"tokenizer.chat_template", b"tokenizer.chat_templat_"))
    root = home_dir / ".ollama" / "models"
    ollama_model(root, "smollm2", "go", bare, "9" * 64)
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / "smollm2" / "go"
    layers = json.loads(manifest.read_text())
    digest = hashlib.sha256(SMOLLM_GO_TEMPLATE.encode()).hexdigest()
    (root / "blobs" / f"sha256-{digest}").write_text(SMOLLM_GO_TEMPLATE)
    layers["layers"].append({"mediaType": "application/vnd.ollama.image.template", "digest": f"sha256:{digest}",
                             "size": len(SMOLLM_GO_TEMPLATE)})
    manifest.write_text(json.dumps(layers))
    tokenizer = embedded[3]
    conversation = [Message("user", "What is the capital of France?"), Message("assistant", "Paris."),
                    Message("user", "And of Italy?")]
    backend = LocalBackend(EngineOptions(kv_cache_mb=16))

    async def reply(spec: str) -> tuple[str, str]:
        await backend.load(spec)
        rendered = chat_text(backend._loaded[spec].tokenizer, conversation)
        text = "".join([e.text or "" async for e in backend.stream(spec, conversation, SamplingParams(max_tokens=8, temperature=0.0), spec)])
        return rendered, text

    try:
        rendered, text = asyncio.run(reply("ollama/smollm2:go"))
        assert rendered == chat_text(tokenizer, conversation)
        assert (rendered, text) == asyncio.run(reply(OLLAMA))
    finally:
        asyncio.run(backend.close())
