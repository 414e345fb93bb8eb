"""`tuichat serve` as a user runs it: a real subprocess on a loopback port, with the embedded model in float32
(exact: its greedy replies must be transformers' own), driven by the official `openai` client and by raw
HTTP for the SSE framing; its /metrics read by prometheus_client's own parser."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import SERVE_KEY as KEY
from tests.helpers import free_port, hf_greedy, server_process, template_ids, wait_until
from tuichat import catalog
from tuichat.backends.protocol import Message, SamplingParams


def client(base: str, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


def expected_reply(embedded, question: str, max_tokens: int) -> tuple[str, int]:
    """transformers' greedy reply to one user message (its own chat template), and the prompt's length."""
    _, _, reference, tokenizer = embedded
    prompt = template_ids(tokenizer, [Message("user", question)])
    ids = hf_greedy(reference, prompt, max_tokens, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(ids, skip_special_tokens=True), len(prompt)


# A plain completion that runs until its client leaves: the embedded model's greedy continuation of this count
# (float32, as the server fixture runs it) went past 800, some 3,500 tokens, without an end when it was chosen.
ENDLESS = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,", "max_tokens": 4000,
           "temperature": 0, "stream": True}


@contextlib.contextmanager
def running_request(base: str):
    """A streamed request in the engine's running batch from the moment this yields (its first piece of text
    has arrived) until the block ends (its client goes away); then the server is idle again."""
    with httpx.stream("POST", f"{base}/v1/completions", json=ENDLESS, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # held until the block ends: a reader dropped mid-stream closes the connection
        while not next(lines).startswith("data: "):
            pass
        yield
    wait_until(lambda: metrics(base)["tuichat:num_requests_running{}"] == 0, "the request to be cancelled", timeout=30)


def metrics(base: str) -> dict[str, float]:
    """{sample name with its labels: value} of /metrics, as Prometheus reads it."""
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def test_greedy_replies_are_transformers_own_streamed_or_not(server, embedded):
    question = "What is 2 + 2? Answer in one sentence."
    text, prompt_tokens = expected_reply(embedded, question, 24)

    async def main():
        api = client(server)
        whole = await api.chat.completions.create(model="smollm2-135m", temperature=0, max_tokens=24,
                                                  messages=[{"role": "user", "content": question}])
        stream = await api.chat.completions.create(
            model="smollm2-135m", temperature=0, max_tokens=24, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": [{"type": "text", "text": question}]}])
        chunks = [chunk async for chunk in stream]
        await api.close()
        return whole, chunks

    whole, chunks = asyncio.run(main())
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == text
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens == prompt_tokens
    assert whole.usage.total_tokens == prompt_tokens + whole.usage.completion_tokens
    # Streamed: the role first, the same text in deltas, the finish, then the usage chunk with no choices.
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == prompt_tokens
    # The same prompt again: the prefix cache held it, and usage says so.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_the_sse_framing_is_openais(server):
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert all(p["object"] == "chat.completion.chunk" and p["id"] == payloads[0]["id"] for p in payloads)
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length") and payloads[-1]["choices"][0]["delta"] == {}
    assert all(p["choices"][0]["finish_reason"] is None for p in payloads[:-1])


def test_the_api_key_is_required_on_v1_only(server):
    async def main():
        api = client(server, key="wrong")
        with pytest.raises(openai.AuthenticationError) as caught:
            await api.models.list()
        await api.close()
        return caught.value

    error = asyncio.run(main())
    assert error.status_code == 401 and error.body["code"] == "invalid_api_key"
    assert httpx.get(f"{server}/health").status_code == 200  # a load balancer's probe needs no key


def test_models_lists_the_served_model_first(server):
    async def main():
        api = client(server)
        listed = await api.models.list()
        await api.close()
        return [m.id for m in listed.data]

    listed = asyncio.run(main())
    assert listed[0] == "smollm2-135m" and len(set(listed)) == len(listed)


def test_a_gguf_served_from_another_folder_is_listed_first_and_answers_to_its_id(embedded, session_cache, tmp_path,
                                                                                 monkeypatch):
    """`tuichat serve --model ../models/chat-model.gguf` (a copy of the embedded model) from a folder of its own,
    as a user runs it: GET /v1/models lists the file's id first, and the official client completes with that
    id, as with the path it was given; the replies are transformers' own."""
    models, elsewhere = tmp_path / "models", tmp_path / "elsewhere"
    models.mkdir()
    elsewhere.mkdir()
    shutil.copyfile(catalog.embedded_gguf(), models / "chat-model.gguf")
    monkeypatch.chdir(elsewhere)  # the server's working directory: it holds no chat-model.gguf
    port = free_port()
    env = {**os.environ, "TUICHAT_CACHE_DIR": str(session_cache), "TUICHAT_CONFIG_DIR": str(tmp_path / "config"),
           "TUICHAT_DATA_DIR": str(tmp_path / "data"), "HF_HUB_OFFLINE": "1"}
    env.pop("TUICHAT_API_KEY", None)
    argv = [sys.executable, "-m", "tuichat", "serve", "--model", "../models/chat-model.gguf", "--port", str(port),
            "--dtype", "float32"]
    text, _ = expected_reply(embedded, "Say hello.", 8)

    async def main(base: str):
        api = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        listed = [m.id for m in (await api.models.list()).data]
        replies = [await api.chat.completions.create(model=model, temperature=0, max_tokens=8,
                                                     messages=[{"role": "user", "content": "Say hello."}])
                   for model in (listed[0], "../models/chat-model.gguf")]
        await api.close()
        return listed, replies

    with server_process(argv, port, tmp_path / "serve.log", env, "tuichat serve --model chat-model.gguf") as base:
        listed, replies = asyncio.run(main(base))
    assert listed[0] == "chat-model.gguf"
    assert [(r.model, r.choices[0].message.content) for r in replies] == [("chat-model.gguf", text)] * 2


@pytest.mark.parametrize("change, status, param", [
    ({"n": 2}, 400, "n"),
    ({"presence_penalty": 3}, 400, "presence_penalty"),
    ({"model": "no-such-model"}, 404, "model"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
    ({"messages": [{"role": "user"}]}, 400, "messages.0.content"),
    ({"messages": []}, 400, "messages"),
    ({"max_tokens": "many"}, 400, "max_tokens"),
    ({"max_tokens": True}, 400, "max_tokens"),
    ({"stop": 5}, 400, "stop"),
    ({"temperature": -1}, 400, "temperature"),
])
def test_bad_requests_get_openais_error_shape_and_the_server_keeps_serving(server, change, status, param):
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 2, **change}
    response = httpx.post(f"{server}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param
    good = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 2}
    ok = httpx.post(f"{server}/v1/chat/completions", json=good, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert ok.status_code == 200


def test_malformed_json_is_a_400(server):
    response = httpx.post(f"{server}/v1/chat/completions", content=b"{not json",
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]


def test_concurrent_clients_are_batched_and_each_gets_its_own_greedy_reply(server, embedded):
    """Eight clients at once while another's request runs: that one is in the running batch before the first of
    them is sent and still after the last has its reply (thousands of tokens from its end), so each of the eight
    ran in a batch with it: a state the engine reports, not a moment a poll has to catch."""
    questions = ["Name a fruit.", "Name a colour.", "What is a cat?", "Say something kind."]
    expected = [expected_reply(embedded, q, 16)[0] for q in questions]

    async def main():
        api = client(server)

        async def ask(question: str) -> str:
            reply = await api.chat.completions.create(model="smollm2-135m", temperature=0, max_tokens=16,
                                                      messages=[{"role": "user", "content": question}])
            return reply.choices[0].message.content

        replies = await asyncio.gather(*(ask(q) for q in questions * 2))
        await api.close()
        return replies

    with running_request(server):
        replies = asyncio.run(main())
        still_running = metrics(server)["tuichat:num_requests_running{}"]
    assert replies == expected * 2
    assert still_running == 1  # the other request, from before the first of the eight to after the last


def test_a_client_that_disconnects_mid_stream_cancels_its_request(server):
    """A reply allowed 4,000 tokens and far from its end (a count it continues): once its client closes the
    stream, the engine stops it and frees its blocks."""
    with running_request(server):
        assert metrics(server)["tuichat:num_requests_running{}"] == 1
    assert metrics(server)["tuichat:kv_cache_usage_perc{}"] == 0


def test_metrics_count_every_finished_request(server, embedded):
    """The generated tokens /metrics counts are those of the replies, as transformers' greedy decoding writes
    them (the EOS included, when a reply ends before its cap)."""
    _, _, reference, tokenizer = embedded
    questions = ["Say hello.", "Name a colour."]
    expected = [len(hf_greedy(reference, template_ids(tokenizer, [Message("user", q)]), 12,
                              eos_token_id=tokenizer.eos_token_id)) for q in questions]
    before = metrics(server)
    replies = [httpx.post(f"{server}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                          json={"messages": [{"role": "user", "content": q}], "max_tokens": 12, "temperature": 0})
               for q in questions]
    after = metrics(server)
    assert [r.json()["usage"]["completion_tokens"] for r in replies] == expected
    count = "tuichat:time_to_first_token_seconds_count{}"
    assert after[count] - before.get(count, 0) == 2
    tokens = "tuichat:generation_tokens_total{}"
    assert after[tokens] - before.get(tokens, 0) == sum(expected)
    assert after["tuichat:prefix_cache_hits_total{}"] <= after["tuichat:prefix_cache_queries_total{}"]


def test_it_will_not_listen_beyond_loopback_without_a_key(tmp_path):
    """Refused before anything loads, with what to do instead."""
    env = {**os.environ, "TUICHAT_CONFIG_DIR": str(tmp_path / "config"), "TUICHAT_DATA_DIR": str(tmp_path / "data")}
    env.pop("TUICHAT_API_KEY", None)
    result = subprocess.run([sys.executable, "-m", "tuichat", "serve", "--host", "0.0.0.0"], env=env,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and "--api-key" in result.stderr and "--insecure-no-auth" in result.stderr



def test_a_stateless_client_resending_its_history_hits_the_cache_for_all_of_it(server):
    """Eight turns, each re-sending the whole conversation as text (as every OpenAI client does): each turn's
    cached_tokens covers the history (the last turn's prompt and reply) but for at most one block."""
    questions = ["Name a fruit.", "Why is it sweet?", "Name another.", "Which is bigger?", "Name a vegetable.",
                 "Is it green?", "Name a tree.", "Is it tall?"]

    async def main():
        api = client(server)
        messages, usages = [], []
        for question in questions:
            messages.append({"role": "user", "content": question})
            reply = await api.chat.completions.create(model="smollm2-135m", temperature=0, max_tokens=12,
                                                      messages=messages)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            usages.append(reply.usage)
        await api.close()
        return usages

    usages = asyncio.run(main())
    for before, turn in zip(usages, usages[1:]):
        history = before.prompt_tokens + before.completion_tokens
        assert turn.prompt_tokens > history
        assert turn.prompt_tokens_details.cached_tokens >= history - 16 - 1, (before, turn)  # a block; the EOS


def test_plain_completions_continue_the_text_as_generate_does(server, embedded):
    _, _, reference, tokenizer = embedded
    prompt = "The three primary colours are"
    ids = tokenizer(prompt)["input_ids"]
    text = tokenizer.decode(hf_greedy(reference, ids, 12, eos_token_id=tokenizer.eos_token_id), skip_special_tokens=True)

    async def main():
        api = client(server)
        whole = await api.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=12, temperature=0)
        stream = await api.completions.create(model="smollm2-135m", prompt=[prompt], max_tokens=12, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        await api.close()
        return whole, chunks

    whole, chunks = asyncio.run(main())
    assert whole.object == "text_completion" and whole.choices[0].text == text
    assert whole.usage.prompt_tokens == len(ids)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    refused = httpx.post(f"{server}/v1/completions", json={"prompt": prompt, "echo": True},
                         headers={"Authorization": f"Bearer {KEY}"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"


def test_a_prompt_longer_than_the_context_is_refused_with_openais_code(server):
    body = {"messages": [{"role": "user", "content": "hello " * 9000}], "max_tokens": 2}
    response = httpx.post(f"{server}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "8191" in error["message"]


async def test_a_requests_omitted_sampling_fields_come_from_the_config_then_the_model():
    """In process over a recording backend: what a request leaves out is the config's [sampling], then what the
    model recommends (else tuichat's default); a request's temperature 0 is exact greedy."""
    from tests.fake_backend import FakeBackend
    from tuichat.server.app import create_app

    backend = FakeBackend(models=["plain", "recommends"])
    backend.recommended = {"recommends": {"temperature": 0.6, "top_k": 20}}
    app = create_app(backend, "plain", {"top_k": 5})
    hi = [{"role": "user", "content": "hi"}]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve") as http:
        api = openai.AsyncOpenAI(base_url="http://serve/v1", api_key="none", http_client=http, max_retries=0)
        sent = []
        for model, fields in (("recommends", {}), ("plain", {}), ("recommends", {"temperature": 0, "max_tokens": 7}),
                              ("plain", {"top_p": 0.5, "frequency_penalty": 0.0})):
            await api.chat.completions.create(model=model, messages=hi, **fields)
            sent.append(backend.calls[-1]["params"])
    assert sent == [SamplingParams(temperature=0.6, top_k=5),
                    SamplingParams(temperature=0.2, top_p=0.9, top_k=5, frequency_penalty=0.5),
                    SamplingParams(top_k=5, max_tokens=7),
                    SamplingParams(temperature=0.2, top_p=0.5, top_k=5)]
