"""`tuichat serve`'s published contract: /openapi.json describes the bodies the app really takes and gives, and
schemathesis holds the app to it, as vLLM's tests/entrypoints/openai/test_openapi_server.py does its server:
no 5xx, every response (each streamed event too) as documented, only documented statuses, a 405 with Allow.

The app runs in process over the real engine, its tokenizer and chat template, serving a tiny GGUF from a
folder of its own (served as the embedded model is, by a path, whose id is the file's name): a fuzzed request
costs the engine a prefill and at most MAX_TOKENS steps of a model that takes a millisecond a step, and each
operation gets a bounded number of examples."""

from __future__ import annotations

import json

import httpx
import jsonschema_rs
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.tiny_gguf import write_gguf
from tuichat.backends.protocol import EngineOptions
from tuichat.server.app import create_app

KEY = "sk-tuichat-contract"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_TOKENS = 3
# Roles and contents, as a real template renders them; it refuses what the embedded model's would not.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def app(tmp_path_factory, session_cache):
    """The app over the real engine, with an API key; a request that leaves max_tokens out gets MAX_TOKENS from
    the config, as a user's [sampling] gives it."""
    from tuichat.backends.local import LocalBackend

    model = tmp_path_factory.mktemp("contract") / "tiny.gguf"
    write_gguf(model, chat_template=TEMPLATE)
    backend = LocalBackend(EngineOptions(dtype="float32"), str(model))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TUICHAT_CACHE_DIR", str(session_cache))
        yield create_app(backend, str(model), {"max_tokens": MAX_TOKENS}, api_key=KEY)
        # schemathesis keeps the app's lifespan up until the interpreter exits; the engine goes now.
        import asyncio

        asyncio.run(backend.close())


@pytest.fixture(scope="module")
def contract(app):
    """The contract as a client reads it: /openapi.json, fetched without the key."""
    return schemathesis.openapi.from_asgi("/openapi.json", app)


def accepted_unless_the_schema_cannot_say(ctx, response, case):
    """schemathesis' positive_data_acceptance, less the 400s for what JSON Schema cannot say of a valid body: a
    conversation whose last message is not a user's with some text, a `model` that names nothing tuichat can
    load, a prompt longer than the model's context. Any other 400 for a body the schema calls valid means the
    schema and the app disagree."""
    if response.status_code == 400:
        error = response.json()["error"]
        if (error["param"] == "model" or error["code"] == "context_length_exceeded"
                or error["message"] == "The prompt is empty."):
            return None
    return positive_data_acceptance(ctx, response, case)


schema = schemathesis.pytest.from_fixture("contract")


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
def test_the_app_keeps_its_published_contract(case):
    if isinstance(case.body, dict):  # a valid cap above MAX_TOKENS is lowered to it: the engine's work stays tiny
        for field in ("max_tokens", "max_completion_tokens"):
            if type(case.body.get(field)) in (int, float) and case.body[field] > MAX_TOKENS:
                case.body[field] = MAX_TOKENS
    case.call_and_validate(headers=AUTH, timeout=120, excluded_checks=[positive_data_acceptance],
                           additional_checks=[accepted_unless_the_schema_cannot_say])


def validator(document: dict, name: str) -> jsonschema_rs.Validator:
    """A validator of the published component `name`, its references resolved within the document."""
    return jsonschema_rs.validator_for({"$schema": "https://json-schema.org/draft/2020-12/schema",
                                        "$ref": f"#/components/schemas/{name}", "components": document["components"]})


async def test_the_contract_is_public_and_says_what_a_stream_is(app):
    """/openapi.json needs no key while /v1/ does (and it says so); a streamed chat reply's events are what it
    publishes, event by event (the role, the text, the finish, the usage, then [DONE]); an error is OpenAI's."""
    # No lifespan here (schemathesis' holds the app's, if it ran first): the first request loads the model.
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve") as http:
        document = (await http.get("/openapi.json")).json()
        refused = await http.get("/v1/models")
        body = {"messages": [{"role": "user", "content": "Say hello."}], "stream": True,
                "stream_options": {"include_usage": True}}
        streamed = await http.post("/v1/chat/completions", json=body, headers=AUTH)
        wrong = await http.post("/v1/chat/completions", json={**body, "n": 3}, headers=AUTH)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    bearer = document["components"]["securitySchemes"]["bearer"]
    assert (bearer["type"], bearer["scheme"]) == ("http", "bearer")
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert chat["security"] == [{"bearer": []}] and set(chat["responses"]) == {"200", "400", "401", "404", "500"}
    assert "HTTPValidationError" not in document["components"]["schemas"]  # no FastAPI 422 anywhere
    assert "security" not in document["paths"]["/health"]["get"]

    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    data = [event.removeprefix("data: ") for event in streamed.text.split("\n\n") if event]
    assert data[-1] == "[DONE]" and len(data) >= 4
    chunk = validator(document, "CreateChatCompletionStreamResponse")
    chunks = [json.loads(event) for event in data[:-1]]
    for each in chunks:
        chunk.validate(each)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] <= MAX_TOKENS and chunks[-1]["model"] == "tiny.gguf"

    assert wrong.status_code == 400
    validator(document, "ErrorResponse").validate(wrong.json())
    assert wrong.json()["error"]["param"] == "n" and "n must be 1" in wrong.json()["error"]["message"]


def test_the_stream_schema_catches_a_wrong_event(app):
    """The published event schema is not vacuous: a chunk with a finish reason OpenAI does not have, or
    without its id, does not validate, nor does an error without its message."""
    document = app.openapi()
    chunk = validator(document, "CreateChatCompletionStreamResponse")
    good = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": None}]}
    chunk.validate(good)
    bad_finish = {**good, "choices": [{**good["choices"][0], "finish_reason": "cancelled"}]}
    assert not chunk.is_valid(bad_finish) and not chunk.is_valid({k: v for k, v in good.items() if k != "id"})
    assert not validator(document, "ErrorResponse").is_valid({"error": {"type": "x", "param": None, "code": None}})
