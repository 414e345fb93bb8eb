"""The embedded model end to end: GGUF conversion cache, chat templates, streaming text, multi-turn cache
hits through the backend, and `tuichat ask`."""

from __future__ import annotations

import asyncio
import json

import pytest
from click.testing import CliRunner

from tests.helpers import hf_greedy, step_until, template_ids
from tuichat.backends.local import LocalBackend, chat_ids
from tuichat.backends.protocol import EngineOptions, Message, SamplingParams
from tuichat.bench.backend import BenchBackend
from tuichat.cli import main
from tuichat.engine.detok import IncrementalDetokenizer, StopMatcher, _backend_decode
from tuichat.engine.engine import Engine, EngineConfig

QUESTION = [Message("user", "Name three primary colors.")]


def test_conversion_is_cached_and_reused(embedded, session_cache):
    from tests.helpers import CONVERSION_STAGES

    resolved, *_ = embedded
    # The first load converted, with visible progress through every stage.
    what = [w for w, _ in CONVERSION_STAGES]
    assert what[0].startswith("Reading") and any(w.startswith("Dequantizing") for w in what)
    assert what[-1] == "Loaded smollm2-135m"
    fractions = [f for _, f in CONVERSION_STAGES if f is not None]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert (resolved.converted_dir / "tuichat-source.txt").is_file()
    assert resolved.converted_dir.is_relative_to(session_cache)
    stages = []
    backend = LocalBackend(EngineOptions(dtype="float32"))
    backend.load_sync("smollm2-135m", lambda what, fraction: stages.append(what))
    assert stages and not any("Converting" in s for s in stages)
    asyncio.run(backend.close())


def test_greedy_chat_reply_matches_generate_and_streams_the_same_text(embedded):
    _, model, reference, tokenizer = embedded
    engine = Engine(model, tokenizer, EngineConfig(num_blocks=64))
    prompt = chat_ids(tokenizer, QUESTION)
    pieces = []
    seq = engine.submit(prompt, SamplingParams(max_tokens=40), lambda out: pieces.append(out.text))
    step_until(engine, lambda: seq.finish_reason is not None, "the reply")
    expected = hf_greedy(reference, prompt, 40, eos_token_id=tokenizer.eos_token_id)
    assert seq.completion_ids == expected
    assert "".join(pieces) == tokenizer.decode(expected, skip_special_tokens=True)


def test_detokenizer_is_utf8_safe_one_token_at_a_time(embedded):
    tokenizer = embedded[3]
    text = "Größe: 42 € — 東京 😀 naïve café\n```python\nprint('ok')\n```"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for through_transformers in (False, True):
        detok = IncrementalDetokenizer(tokenizer, [])
        if through_transformers:
            detok._decode = detok._decode_through_transformers
        pieces = [detok.add(i) for i in ids]
        assert "".join(pieces) == text
        assert not any("\ufffd" in p for p in pieces)


def test_detokenizer_reads_the_backend_only_where_transformers_would_just_wrap_it(embedded):
    """The fast path skips transformers' decode: a tokenizer class that changes decoding keeps its own."""
    import copy

    tokenizer = embedded[3]
    assert _backend_decode(tokenizer) is not None

    class Shouting(type(tokenizer)):
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).upper()

    shouting = copy.copy(tokenizer)
    shouting.__class__ = Shouting
    assert _backend_decode(shouting) is None
    detok = IncrementalDetokenizer(shouting, [])
    ids = tokenizer("naïve café, twice", add_special_tokens=False)["input_ids"]
    assert "".join(detok.add(i) for i in ids) == "NAÏVE CAFÉ, TWICE"


def test_stop_matcher_never_shows_a_stop_string():
    matcher = StopMatcher(("STOP",))
    shown = [matcher.feed(piece) for piece in ["Hello S", "TO", "P after"]]
    assert shown == [("Hello ", False), ("", False), ("", True)]
    matcher = StopMatcher(("STOP",))
    assert matcher.feed("a ST")[0] == "a " and matcher.feed("ar")[0] == "STar" and matcher.flush() == ""


def test_multi_turn_conversation_hits_the_cache_and_matches_generate(embedded):
    """Each turn's prompt is built from the last turn's real ids (the fast path), and is exactly the prompt
    transformers' chat template gives for the same messages; the reply is `generate`'s on that prompt."""
    _, _, reference, tokenizer = embedded
    backend = BenchBackend(EngineOptions(dtype="float32"))

    async def turn(messages):
        text, last = [], None
        async for event in backend.stream("c1", messages, SamplingParams(max_tokens=24)):
            text.append(event.text)
            last = event
        return "".join(text), last.usage

    async def conversation():
        messages, usages, history = [], [], []
        for question in ["Hi! Who are you?", "What is 2+2?", "And 3+3?"]:
            messages.append(Message("user", question))
            reply, usage = await turn(messages)
            ids = backend.cached_token_ids("c1")
            prompt, completion = ids[: usage.prompt_tokens], ids[usage.prompt_tokens :]
            assert prompt == template_ids(tokenizer, messages)
            assert completion == hf_greedy(reference, prompt, 24, eos_token_id=tokenizer.eos_token_id)
            if history:  # the fast path: the last turn's ids, all but its end-of-turn token, carried over
                carried = len(history) - (history[-1] == tokenizer.eos_token_id)
                assert backend.reused_tokens("c1") == carried and prompt[:carried] == history[:carried]
                assert usage.cached_tokens >= len(history) - 16  # from the cache, bar one partial block
            history = ids
            usages.append(usage)
            messages.append(Message("assistant", reply))
        await backend.close()
        return usages

    usages = asyncio.run(conversation())
    assert usages[0].cached_tokens == 0 and usages[2].cached_tokens > usages[1].cached_tokens > 0


def test_stop_string_cuts_the_reply(embedded):
    backend = LocalBackend(EngineOptions(dtype="float32"))

    async def ask(params):
        events = [e async for e in backend.stream("s", QUESTION, params)]
        return "".join(e.text for e in events), events[-1].usage

    full, _ = asyncio.run(ask(SamplingParams(max_tokens=30)))
    word = full.split()[3]
    cut, usage = asyncio.run(ask(SamplingParams(max_tokens=30, stop=(word,))))
    asyncio.run(backend.close())
    assert usage.finish_reason == "stop"
    assert cut == full[: full.index(word)]


def run_cli(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


def test_ask_json_reports_usage(embedded):
    result = run_cli("ask", "Say hello.", "--json", "--dtype", "float32", "--max-tokens", "8")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("text", "model", "prompt_tokens", "cached_tokens", "completion_tokens", "ttft_ms",
                "tokens_per_s", "finish_reason"):
        assert key in data
    assert data["model"] == "smollm2-135m" and data["text"] and data["completion_tokens"] <= 8
    assert data["ttft_ms"] > 0


def test_ask_says_when_the_kv_cache_cut_the_reply_short(embedded):
    """A pool of 3 MiB holds 64 float32 tokens of this model: the story ends there, and says why."""
    config = embedded[1].config
    token_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    capacity = 3 * 2**20 // (token_bytes * 16) * 16
    result = run_cli("ask", "Tell me a long story about a dragon.", "--json", "--dtype", "float32",
                     "--kv-cache-mb", "3")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["prompt_tokens"] + data["completion_tokens"] == capacity < data["prompt_tokens"] + 512
    assert data["finish_reason"] == "length"
    assert data["finish_detail"] == (f"the KV cache is full ({capacity} tokens); raise kv_cache_mb (--kv-cache-mb) "
                                     "or shorten the conversation")
    assert f"tuichat: the reply was cut short: {data['finish_detail']}.\n" in result.stderr


def test_ask_samples_with_the_chat_default_and_temperature_0_is_transformers_greedy(embedded):
    """The embedded model's generation config recommends no sampling, so ask uses tuichat's default; --temperature 0
    drops its penalty, and the reply is transformers' greedy one to the word."""
    question = "Write a haiku about the sea."
    result = run_cli("ask", question, "--json", "--dtype", "float32", "--max-tokens", "8")
    assert result.exit_code == 0, result.output
    default = json.loads(result.stdout.strip().splitlines()[-1])["sampling"]
    assert default == {"temperature": 0.2, "top_p": 0.9, "top_k": 0, "seed": None, "presence_penalty": 0.0,
                       "frequency_penalty": 0.5}
    result = run_cli("ask", question, "--json", "--dtype", "float32", "--max-tokens", "24", "--temperature", "0")
    assert result.exit_code == 0, result.output
    greedy = json.loads(result.stdout.strip().splitlines()[-1])
    assert greedy["sampling"] == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None,
                                  "presence_penalty": 0.0, "frequency_penalty": 0.0}
    _, _, reference, tokenizer = embedded
    ids = hf_greedy(reference, template_ids(tokenizer, [Message("user", question)]), 24,
                    eos_token_id=tokenizer.eos_token_id)
    assert greedy["text"] == tokenizer.decode(ids, skip_special_tokens=True)


def test_ask_reads_stdin_and_streams(embedded):
    # float32: this prompt's greedy reply is "Paris" in float32 only (bf16, and Q4_1 here or in llama.cpp,
    # start "L'Étoile"; scripts/fidelity.py measures how often each way agrees with float32).
    result = run_cli("ask", "-", "--max-tokens", "8", "--dtype", "float32", "--temperature", "0",
                     input="What is the capital of France?")
    assert result.exit_code == 0, result.output
    assert "Paris" in result.stdout
    assert "TTFT" in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["ask", "hi", "--model", "no-such-model"], "Unknown model 'no-such-model'"),
        (["ask", "   "], "the prompt is empty"),
        (["ask", "word " * 9000], "holds 8,191 tokens a conversation"),
        (["ask", "hi", "--model", "someorg/not-cached"], "HF_HUB_OFFLINE"),
    ],
)
def test_ask_bad_input_is_one_clear_line(embedded, args, message):
    result = run_cli(*args)
    assert result.exit_code == 2
    assert message in result.stderr
    assert "Traceback" not in result.output


def test_models_lists_embedded_and_config_models(embedded, user_dirs):
    user_dirs.config.mkdir(exist_ok=True)
    (user_dirs.config / "config.toml").write_text('models = ["someorg/some-model"]\n')
    result = run_cli("models")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0].startswith("smollm2-135m") and "embedded" in lines[0]
    assert any(line.startswith("someorg/some-model") and "config" in line for line in lines)
