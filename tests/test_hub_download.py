"""A hub id that is not in the cache is downloaded by `tuichat ask`: from a hub served on loopback the way
huggingface.co serves one (the repo's revision and tree, files under /resolve/ with their ETag, byte ranges),
with one progress figure for all its bytes, resumed after a dropped connection, and answering as transformers'
own `generate` answers on the same folder."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = "someorg/tiny-chat"
SHA = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """The few routes huggingface_hub's snapshot_download and hf_hub_download call. The first GET of the
    weights is cut half-way, as a dropped connection would cut it."""

    def __init__(self, folder: Path):
        self.files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
        self.requests: list[tuple[str, str, str | None]] = []
        self.cut = {"model.safetensors"}
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub.serve(self, body=False)

            def do_GET(self):
                hub.serve(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def entry(self, name: str) -> dict:
        data = self.files[name]
        entry = {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
        if name.endswith(".safetensors"):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 130}
        return entry

    def serve(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = handler.path.split("?")[0]
        self.requests.append((handler.command, path, handler.headers.get("Range")))
        if path == f"/api/models/{REPO}/revision/main":
            return self.send(handler, json.dumps({"id": REPO, "sha": SHA, "private": False,
                                                  "siblings": [{"rfilename": n} for n in self.files]}).encode(), body)
        if path.startswith(f"/api/models/{REPO}/tree/"):
            return self.send(handler, json.dumps([self.entry(n) for n in self.files]).encode(), body)
        prefix = f"/{REPO}/resolve/"
        if path.startswith(prefix) and (name := path[len(prefix):].split("/", 1)[1]) in self.files:
            data, entry = self.files[name], self.entry(name)
            etag = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]
            headers = {"X-Repo-Commit": SHA, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
            start = int(handler.headers["Range"].split("=")[1].split("-")[0]) if handler.headers.get("Range") else 0
            if body and name in self.cut:
                self.cut.discard(name)
                handler.send_response(200)
                for key, value in {**headers, "Content-Length": str(len(data))}.items():
                    handler.send_header(key, value)
                handler.end_headers()
                handler.wfile.write(data[: len(data) // 2])
                handler.wfile.flush()
                handler.close_connection = True
                handler.connection.shutdown(2)
                return
            if start:
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            return self.send(handler, data[start:], body, headers, 206 if start else 200)
        self.send(handler, b'{"error": "Repository not found"}', body, {"X-Error-Code": "RepoNotFound"}, 404)

    @staticmethod
    def send(handler, data: bytes, body: bool, headers: dict | None = None, status: int = 200) -> None:
        handler.send_response(status)
        for key, value in {"Content-Type": "application/json", **(headers or {}), "Content-Length": str(len(data))}.items():
            handler.send_header(key, value)
        handler.end_headers()
        if body:
            handler.wfile.write(data)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub(tmp_path, embedded):
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = embedded[3]
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None)
    folder = tmp_path / "repo"
    LlamaForCausalLM(copy.deepcopy(config)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "README.md").write_text("not fetched: tuichat takes only what transformers reads\n")
    server = FakeHub(folder)
    yield server, folder
    server.close()


def ask(tmp_path: Path, hub: FakeHub, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HUB_CACHE": str(tmp_path / "hf"),
           "HF_HUB_DISABLE_XET": "1", "HF_HUB_ETAG_TIMEOUT": "10", "HF_HUB_DOWNLOAD_TIMEOUT": "10",
           "HF_TOKEN": "", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1"}
    return subprocess.run([sys.executable, "-m", "tuichat", "ask", "--model", REPO, "--dtype", "float32",
                           "--temperature", "0", "--speculate", "off", *args], capture_output=True, text=True,
                          env=env, timeout=240)


def test_a_hub_id_downloads_once_with_one_progress_figure_and_resumes(tmp_path, hub):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    server, folder = hub
    result = ask(tmp_path, server, "--max-tokens", "8", "--json", "Hello there")
    assert result.returncode == 0, result.stderr[-3000:]
    reply = json.loads(result.stdout)

    # One figure for the whole download, rising to 100 %; no bar of huggingface_hub's own.
    lines = [line for line in result.stderr.splitlines() if "Download" in line]
    fetched = [n for n in server.files if n != "README.md"]
    total_mb = sum(len(server.files[n]) for n in fetched) / 1e6
    assert lines[-1] == f"[tuichat] Downloaded {REPO}: {total_mb:,.1f} MB in {len(fetched)} files", result.stderr[-2000:]
    # Before it, the bytes so far against the total so far (which grows as each file's download starts).
    assert lines[:-1] and all(re.search(r"Downloading someorg/tiny-chat: [\d.,]+ [KM]B of [\d.,]+ [KM]B \(\d+%\)$", line)
                              for line in lines[:-1]), lines
    assert "it/s" not in result.stderr and "Fetching" not in result.stderr

    # The cut file was resumed from where the connection dropped, not fetched again from the start.
    weights = [(method, rng) for method, path, rng in server.requests
               if method == "GET" and path.endswith("/model.safetensors")]
    assert len(weights) == 2 and weights[0][1] is None and weights[1][1].startswith("bytes=")
    assert 0 < int(weights[1][1][6:-1]) <= len(server.files["model.safetensors"]) // 2  # what was written of it
    assert not any(path.endswith("README.md") for _, path, _ in server.requests)
    snapshot = tmp_path / "hf" / "models--someorg--tiny-chat" / "snapshots" / SHA
    assert (snapshot / "model.safetensors").read_bytes() == server.files["model.safetensors"]

    # The reply is transformers' greedy one on the same weights.
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert reply["text"] == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    # A second run reads the cache: no file is fetched again.
    server.requests.clear()
    again = ask(tmp_path, server, "--max-tokens", "1", "Hi")
    assert again.returncode == 0, again.stderr[-2000:]
    assert not any("/resolve/" in path and method == "GET" for method, path, _ in server.requests)
    assert "Download" not in again.stderr


def test_an_unknown_hub_id_is_one_clear_line(tmp_path, hub):
    server, _ = hub
    env = {"HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0", "HF_HUB_CACHE": str(tmp_path / "hf"), "HF_TOKEN": "",
           "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1"}
    result = subprocess.run([sys.executable, "-m", "tuichat", "ask", "--model", "someorg/missing", "hi"],
                            capture_output=True, text=True, env={**os.environ, **env}, timeout=120)
    assert result.returncode != 0
    assert "Could not download 'someorg/missing' from the Hugging Face hub" in result.stderr
    assert "Traceback" not in result.stderr
