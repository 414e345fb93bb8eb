"""Remote engines: RemoteBackend and the Router against `tuichat serve` as a real subprocess (conftest's `server`),
against a deliberately faulty server written here on the same ASGI stack, and against llama.cpp's llama-server
when one is found. Every server binds 127.0.0.1 and is stopped at the end."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families
from textual.widgets import Static

from tests.helpers import RUNS_ON, SERVE_KEY, free_port, hf_greedy, loopback_server, server_process, template_ids
from tuichat.backends.endpoints import Endpoint
from tuichat.backends.local import LocalBackend
from tuichat.backends.protocol import Message, SamplingParams
from tuichat.backends.remote import RemoteBackend
from tuichat.backends.router import Router
from tuichat.config import Config, load_config
from tuichat.store import Store
from tuichat.ui.app import TuichatApp
from tuichat.ui.measure import until
from tuichat.ui.screens import ModelPicker
from tuichat.ui.widgets import EnginePanel

KEY_ENV = "TUICHAT_TEST_REMOTE_KEY"
SIZE = (110, 36)


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, SERVE_KEY)


def expected(embedded, question: str, max_tokens: int) -> str:
    """The local float32 reply (transformers' greedy, which tuichat's engine equals token for token)."""
    _, _, reference, tokenizer = embedded
    prompt = template_ids(tokenizer, [Message("user", question)])
    return tokenizer.decode(hf_greedy(reference, prompt, max_tokens, eos_token_id=tokenizer.eos_token_id),
                            skip_special_tokens=True)


def running(base: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "tuichat:num_requests_running")


async def reply(backend, messages, params=None, model=None, conversation="c"):
    """(the text, the final event) of one streamed reply."""
    text, last = [], None
    async for event in backend.stream(conversation, messages, params or SamplingParams(max_tokens=8), model):
        text.append(event.text)
        last = event
    return "".join(text), last


def files_text(*folders: Path) -> str:
    """Every byte tuichat wrote under these folders (history, WAL, config, exports), as text."""
    return "".join(p.read_bytes().decode("latin-1") for folder in folders if folder.exists()
                   for p in folder.rglob("*") if p.is_file())


# --- against tuichat serve -----------------------------------------------------------------------------


def test_ask_streams_a_remote_reply_equal_to_the_local_one(server, embedded, user_dirs):
    question = "What is 2 + 2? Answer in one sentence."
    env = {**os.environ, KEY_ENV: SERVE_KEY}
    result = subprocess.run([sys.executable, "-m", "tuichat", "ask", "--base-url", server, "--api-key-env", KEY_ENV,
                             "--model", "smollm2-135m", "--temperature", "0", "--max-tokens", "24", question],
                            env=env, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected(embedded, question, 24)
    assert "[remote:smollm2-135m · " in result.stderr and "TTFT" in result.stderr
    assert SERVE_KEY not in result.stdout + result.stderr + files_text(user_dirs.config, user_dirs.data)


def test_ask_exits_non_zero_with_the_servers_reason(server):
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    result = subprocess.run([sys.executable, "-m", "tuichat", "ask", "--base-url", f"{server}/v1", "--api-key-env",
                             KEY_ENV, "-m", "smollm2-135m", "hi"], env=env, capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 2 and f"${KEY_ENV} is not set" in result.stderr and "401" in result.stderr


def test_cached_tokens_rise_on_the_second_turn(server):
    backend = RemoteBackend(Endpoint("lab", f"{server}/v1", KEY_ENV))

    async def main():
        first, one = await reply(backend, [Message("user", "Name a colour.")])
        history = [Message("user", "Name a colour."), Message("assistant", first), Message("user", "Another?")]
        _, two = await reply(backend, history)
        await backend.close()
        return one.usage, two.usage

    one, two = asyncio.run(main())
    assert two.prompt_tokens > one.prompt_tokens + one.completion_tokens
    assert two.cached_tokens > one.cached_tokens and two.cached_tokens >= one.prompt_tokens - 16
    assert one.ttft_ms is not None and one.finish_reason in ("stop", "length")


def remote_app(endpoints: list[Endpoint], model: str, max_tokens: int = 16) -> TuichatApp:
    config = Config(model=model, endpoints=endpoints, sampling={"temperature": 0.0, "max_tokens": max_tokens})
    router = Router(LocalBackend(), endpoints, model)
    app = TuichatApp(lambda: router, config, Store())
    app.animation_level = "none"
    return app


async def send(pilot, text: str) -> None:
    pilot.app.active_tab.prompt.insert(text)
    await pilot.press("enter")


def last_row(app, tab=None):
    return app.store.messages((tab or app.active_tab).conversation_id)[-1]


async def answered(app, tab=None) -> None:
    tab = tab or app.active_tab
    await until(lambda: last_row(app, tab).role == "assistant" and last_row(app, tab).status != "streaming"
                and not tab.busy, what="the reply to end", timeout=120)


async def test_a_remote_tab_streams_and_shows_the_servers_models_and_metrics(server, embedded, user_dirs):
    question = "Name a fruit."
    app = remote_app([Endpoint("lab", f"{server}/v1", KEY_ENV)], "lab:smollm2-135m")
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, question)
        await answered(app)
        row = last_row(app)
        assert (row.status, row.content) == ("done", expected(embedded, question, 16))
        assert row.meta["model"] == "lab:smollm2-135m" and row.meta["ttft_ms"] > 0
        assert f"/{row.meta['prompt_tokens']}" in str(app.active_tab.meter.query_one("#meter-text").render())

        await pilot.press("ctrl+b")
        panel = app.query_one(EnginePanel)

        def shown(name: str) -> str:
            return str(panel.query_one(f"#engine-{name}", Static).render())

        await until(lambda: shown("sched") == "running 0 · waiting 0", what="the server's running count")
        assert shown("model").startswith("lab:smollm2-135m\nremote · ") and shown("kv").startswith("KV cache 0%")
        assert shown("prefix").startswith("prefix hits ") and "not reported" not in shown("prefix")
        await pilot.press("ctrl+b")

        await pilot.press("ctrl+o")
        await until(lambda: isinstance(app.screen, ModelPicker) and "lab:smollm2-135m" in app.screen.models,
                    what="the server's models in the picker")
        assert "smollm2-135m" in app.screen.models  # the local ones beside them
        await pilot.press("escape")
    assert SERVE_KEY not in files_text(user_dirs.config, user_dirs.data)


async def test_esc_closes_the_stream_and_the_server_stops_the_request(server):
    app = remote_app([Endpoint("lab", f"{server}/v1", KEY_ENV)], "lab:smollm2-135m", max_tokens=4000)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "Tell me a very long story about a dragon.")
        tab = app.active_tab
        await until(lambda: tab.last_reply() is not None and tab.last_reply().text, what="the first token", timeout=60)
        assert running(server) == 1
        await pilot.press("escape")
        await answered(app)
        assert last_row(app).status == "stopped" and last_row(app).content
        await until(lambda: running(server) == 0, what="the server to drop the request", timeout=30)


# --- against a faulty server ---------------------------------------------------------------------------

CHUNKS = ["Hel", "lo", " there"]


def chunk(text: str | None, finish: str | None = None, usage: dict | None = None) -> str:
    choices = [] if text is None else [{"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}]
    body = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


def faulty_app() -> FastAPI:
    """One model per failure; "ok" answers properly (and only to the right key if asked as "auth"). Its usage is
    a server's: a word is a token, and the cached ones are the prompt's longest prefix an earlier request sent
    (all but its last token, which is computed again, as vLLM does); app.state.usages, every usage sent."""
    app = FastAPI()
    app.state.usages, seen = [], []

    def usage(messages: list[dict]) -> dict:
        tokens = [word for m in messages for word in (m["role"], *m["content"].split())]
        shared = max((next((i for i, (a, b) in enumerate(zip(tokens, old)) if a != b), min(len(tokens), len(old)))
                      for old in seen), default=0)
        seen.append(tokens)
        return {"prompt_tokens": len(tokens), "completion_tokens": len(CHUNKS),
                "total_tokens": len(tokens) + len(CHUNKS),
                "prompt_tokens_details": {"cached_tokens": min(shared, len(tokens) - 1)}}

    def error(status: int, message: str, headers=None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "x", "param": None, "code": None}}, status, headers)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "ok", "object": "model"}, {"id": "cut", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        model = body["model"]
        counted = usage(body["messages"])
        if model == "strict" and "stream_options" in body:
            return error(400, "Unrecognized request argument supplied: stream_options")
        if model == "auth" and request.headers.get("authorization") != "Bearer right-key":
            return error(401, "Incorrect API key provided.")
        if model == "missing":
            return error(404, "The model `missing` does not exist.")
        if model == "busy":
            return error(429, "Rate limit reached.", {"Retry-After": "7"})
        if model == "broken":
            return error(503, "The engine is overloaded.")
        if model == "silent":
            await asyncio.sleep(30)

        async def events():
            for text in CHUNKS:
                yield chunk(text)
                await asyncio.sleep(0)
            if model == "cut":
                raise ConnectionResetError("the stream is cut")  # uvicorn drops the connection mid-body
            if model == "garbage":
                yield "data: {not json\n\n"
            yield chunk("", "stop")
            if "stream_options" in body:
                app.state.usages.append(counted)
                yield chunk(None, usage=counted)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def faulty_server():
    app = faulty_app()
    with loopback_server(app) as base:
        yield base, app.state.usages


@pytest.fixture
def faulty(faulty_server):
    return faulty_server[0]


@pytest.fixture
def sent_usages(faulty_server) -> list[dict]:
    """Every usage the faulty server has sent, in order."""
    return faulty_server[1]


def as_sent(usage) -> tuple[int, int, int]:
    return usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens


def sent(usage: dict) -> tuple[int, int, int]:
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"]


def test_a_good_reply_carries_the_servers_usage(faulty, sent_usages):
    backend = RemoteBackend(Endpoint("bad", f"{faulty}/v1", timeout=2))
    first = [Message("user", "Tell me about the bees of the valley.")]
    second = [*first, Message("assistant", "".join(CHUNKS)), Message("user", "And their honey?")]

    async def main():
        replies = [await reply(backend, first, model="ok"), await reply(backend, second, model="ok")]
        await backend.close()
        return replies

    (text, last), (_, then) = asyncio.run(main())
    assert text == "".join(CHUNKS) and last.finished and last.error is None
    # What the server said of each request, passed through: the second turn's prompt is the first's and more.
    assert [as_sent(last.usage), as_sent(then.usage)] == [sent(u) for u in sent_usages[-2:]]
    assert then.usage.cached_tokens >= last.usage.prompt_tokens > last.usage.cached_tokens
    assert last.usage.finish_reason == "stop" and last.usage.ttft_ms > 0 and len(last.usage.itl_ms) == 2


def test_a_server_that_rejects_stream_options_is_asked_again_without_it(faulty):
    backend = RemoteBackend(Endpoint("bad", f"{faulty}/v1", timeout=2))
    text, last = asyncio.run(reply(backend, [Message("user", "hi")], model="strict"))
    assert text == "".join(CHUNKS) and last.error is None
    assert last.usage.completion_tokens == 3 and last.usage.prompt_tokens == 0  # counted, not reported


@pytest.mark.parametrize("model, said, partial", [
    ("missing", "answered 404 for model 'missing': The model `missing` does not exist.", ""),
    ("busy", "is rate-limiting requests (429), retry after 7 s: Rate limit reached.", ""),
    ("broken", "failed with a server error (503): The engine is overloaded.", ""),
    ("silent", "no reply within 0.5 s", ""),
    ("cut", "the connection was cut mid-reply", "".join(CHUNKS)),
    ("garbage", "sent a malformed event: '{not json'", "".join(CHUNKS)),
])
def test_each_failure_is_said_in_words_and_the_next_reply_works(faulty, model, said, partial):
    backend = RemoteBackend(Endpoint("bad", f"{faulty}/v1", timeout=0.5))

    async def main():
        failed = await reply(backend, [Message("user", "hi")], model=model)
        good = await reply(backend, [Message("user", "hi")], model="ok", conversation="other")
        await backend.close()
        return failed, good

    (text, last), (good, ok) = asyncio.run(main())
    assert last.finished and last.usage.finish_reason == "error"
    assert last.error.startswith(f"bad ({faulty}/v1)") and said in last.error, last.error
    assert text == partial
    assert good == "".join(CHUNKS) and ok.error is None


@pytest.mark.parametrize("url, said", [
    (f"http://127.0.0.1:{free_port()}/v1", "connection refused: nothing listens at 127.0.0.1:"),
    ("http://no-such-host.invalid/v1", "cannot resolve no-such-host.invalid (DNS"),
])
def test_an_unreachable_server_is_said_in_words(url, said):
    backend = RemoteBackend(Endpoint("far", url, timeout=5))
    text, last = asyncio.run(reply(backend, [Message("user", "hi")], model="m"))
    assert text == "" and said in last.error, last.error


def test_tls_to_a_plain_http_server_is_a_tls_error(faulty):
    backend = RemoteBackend(Endpoint("tls", faulty.replace("http://", "https://") + "/v1", timeout=5))
    _, last = asyncio.run(reply(backend, [Message("user", "hi")], model="ok"))
    assert "TLS failed" in last.error, last.error


def test_the_key_comes_from_its_variable_as_a_bearer_token(faulty, monkeypatch):
    backend = RemoteBackend(Endpoint("bad", f"{faulty}/v1", "BAD_KEY", timeout=2))
    monkeypatch.delenv("BAD_KEY", raising=False)
    _, unset = asyncio.run(reply(backend, [Message("user", "hi")], model="auth"))
    assert "refused the request (401)" in unset.error and "$BAD_KEY is not set" in unset.error
    monkeypatch.setenv("BAD_KEY", "right-key")
    text, ok = asyncio.run(reply(backend, [Message("user", "hi")], model="auth"))
    assert ok.error is None and text == "".join(CHUNKS)


def test_the_picker_lists_an_unreachable_endpoint_with_its_reason(faulty):
    router = Router(LocalBackend(), [Endpoint("bad", f"{faulty}/v1"), Endpoint("gone", f"http://127.0.0.1:{free_port()}")],
                    "bad:ok")
    listed = {m.spec: m.description for m in router.list_models()}
    assert {"bad:ok", "bad:cut", "smollm2-135m"} <= set(listed)
    assert listed["gone:"].startswith("unreachable: gone (") and "connection refused" in listed["gone:"]


async def test_a_failed_remote_tab_keeps_its_partial_reply_and_the_other_tab_works(faulty, sent_usages):
    app = remote_app([Endpoint("bad", f"{faulty}/v1", timeout=2)], "bad:cut")
    async with app.run_test(size=SIZE) as pilot:
        first = app.active_tab
        await send(pilot, "hello")
        await answered(app, first)
        row = last_row(app, first)
        assert (row.status, row.content) == ("error", "".join(CHUNKS))
        assert "the connection was cut mid-reply" in row.meta["error"]
        assert "the connection was cut mid-reply" in str(first.last_reply().query_one(".status").render())
        await pilot.press("ctrl+t")
        second = app.active_tab
        assert second is not first
        app.switch_model(second, "bad:ok")
        await send(pilot, "hello again")
        await answered(app, second)
        assert (last_row(app, second).status, last_row(app, second).content) == ("done", "".join(CHUNKS))
        # What the server said; not nothing, as "hello" came first.
        assert last_row(app, second).meta["cached_tokens"] == sent(sent_usages[-1])[1] > 0


def test_bench_runs_single_tabs_and_multiturn_over_the_wire(faulty, sent_usages):
    from click.testing import CliRunner

    from tuichat.cli import main

    result = CliRunner().invoke(main, ["bench", "--base-url", faulty, "--model", "ok", "--quick", "--tabs", "2",
                                       "--turns", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.splitlines()[-1])
    assert data["model"] == "remote:ok" and set(data["scenarios"]) == {"single", "tabs", "multiturn"}
    assert data["scenarios"]["tabs"]["requests"] == 2 and data["scenarios"]["tabs"]["tokens_per_s"] > 0
    # The last requests are the turns: what the server said of each, and turn 2 found all of turn 1 cached.
    turns = data["scenarios"]["multiturn"]["turns"]
    assert [(t["prompt_tokens"], t["cached_tokens"]) for t in turns] == [sent(u)[:2] for u in sent_usages[-2:]]
    assert turns[1]["cached_tokens"] >= turns[0]["prompt_tokens"] > turns[0]["cached_tokens"]
    assert any("peers skipped: hf_generate" in note for note in data["notes"])


def test_endpoints_are_read_from_the_config_with_a_warning_for_each_mistake(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('''model = "lab:qwen"
[[endpoints]]
name = "lab"
base_url = "http://gpu-box:8000"
api_key_env = "LAB_KEY"
headers = { "X-Team" = "nlp" }
timeout = 10

[[endpoints]]
name = "nokey"
base_url = "ftp://x"
api_key = "sk-oops"
''')
    config, warnings = load_config(path)
    assert config.endpoints == [Endpoint("lab", "http://gpu-box:8000/v1", "LAB_KEY", (("X-Team", "nlp"),), 10.0)]
    assert any('unknown setting "api_key"' in w and "api_key_env" in w for w in warnings)
    assert any("base_url must be an http:// or https:// URL" in w for w in warnings)


# --- against llama.cpp's server ------------------------------------------------------------------------


def llama_server_binary() -> str | None:
    return os.environ.get("TUICHAT_LLAMA_SERVER") or shutil.which("llama-server")


@pytest.mark.skipif(llama_server_binary() is None,
                    reason="no llama-server (set TUICHAT_LLAMA_SERVER or put it on PATH; it is never a dependency): "
                    f"runs on {RUNS_ON['llama-server']}")
def test_llama_cpp_server_streams_through_the_remote_backend(tmp_path):
    from tuichat import catalog

    binary = llama_server_binary()
    port = free_port()
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(Path(binary).parent),
                                                                         os.environ.get("LD_LIBRARY_PATH")]))}
    argv = [binary, "-m", str(catalog.embedded_gguf()), "--host", "127.0.0.1", "--port", str(port), "-c", "2048",
            "-t", "1", "--metrics"]
    with server_process(argv, port, tmp_path / "llama.log", env, "llama-server", timeout=120) as base:
        backend = RemoteBackend(Endpoint("llama", base))

        async def main():
            model = await backend.load(None)
            text, last = await reply(backend, [Message("user", "Name a fruit.")], SamplingParams(max_tokens=12), model)
            backend.stats(model)
            await until(lambda: backend.stats(model).note == "", what="llama-server's /metrics")
            stats = backend.stats(model)
            await backend.close()
            return text, last, stats

        text, last, stats = asyncio.run(main())
    assert text and last.error is None and last.usage.prompt_tokens > 0 and last.usage.ttft_ms > 0
    assert stats.running is not None and stats.waiting is not None
