"""Multi-turn prompts for every tokenizer kind: each turn's prompt must start with the previous turn's real
ids (prompt and reply, as the engine ran and produced them), so that the KV cache covers the whole history
but for one partial block. SmolLM2's byte-level BPE is easy: decoded ids give back the rendered template.
SentencePiece-style tokenizers (Llama 2 and Mistral: a word-start marker and `<s>`; Gemma: no marker, a
template that trims replies) do not, and re-tokenizing the conversation each turn would lose the hit.
The tokenizers are built here, offline, with the `tokenizers` library."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from tests.helpers import hf_greedy
from tuichat.backends.protocol import EngineOptions, Message, SamplingParams
from tuichat.bench.backend import BenchBackend

WORDS = ("the cat sat on a warm mat while rain fell over quiet hills and small birds sang songs about "
         "rivers stones light bread winter tea code python list tuple print loop file read write").split()
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA2 = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + m['content'] + ' [/INST]' }}"
          "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}")
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
           "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}")
GEMMA = ("{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
         "{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")

# kind: (template, special tokens, bos, eos)
KINDS = {
    "byte-level BPE, ChatML (SmolLM2, Qwen)": (CHATML, ["<|im_start|>", "<|im_end|>"], None, "<|im_end|>"),
    "SentencePiece-style, Llama 2": (LLAMA2, ["<unk>", "<s>", "</s>"], "<s>", "</s>"),
    "SentencePiece-style, Mistral": (MISTRAL, ["<unk>", "<s>", "</s>"], "<s>", "</s>"),
    "SentencePiece-style, Gemma (no marker, trimmed replies)": (
        GEMMA, ["<unk>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<end_of_turn>"),
}


def build_tokenizer(kind: str):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template, specials, bos, eos = KINDS[kind]
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(12)) + rng.choice([".", "?", "!", ","]) for _ in range(400)]
    if kind.startswith("byte-level"):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = []  # the corpus's bytes only: a random model then writes no broken UTF-8
    elif "Gemma" in kind:  # spaces become ▁ before BPE; nothing is put before a string's first word
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse()])
        alphabet = []
    else:  # Llama 2 / Mistral: ▁ marks word starts, and one is put before the text's first word
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        alphabet = []
    corpus += ["\n", "[INST] [/INST] user model assistant"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                        initial_alphabet=alphabet + list("[]/\n.?!,")))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                   unk_token="<unk>" if "<unk>" in specials else None, chat_template=template)


@pytest.fixture(scope="module", params=list(KINDS))
def model_folder(request, tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(request.param)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(3)
    model = LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("tokenizer-kind")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return request.param, folder, model, tokenizer


def template_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                        add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def letters(ids: list[int], tokenizer) -> str:
    """The conversation's text without its whitespace: what must survive whatever the spaces around a reply."""
    return "".join(tokenizer.decode(ids, skip_special_tokens=True).split())


def test_every_turn_builds_on_the_last_turns_ids_and_hits_the_cache(model_folder):
    kind, folder, reference, tokenizer = model_folder
    backend = BenchBackend(EngineOptions(dtype="float32"), default_model=str(folder))
    questions = ["the cat sat on a mat?", "and the birds sang songs about rivers?", "write a python loop",
                 "read the file, print the list"]

    async def conversation():
        messages: list[Message] = []
        history: list[int] = []
        for turn, question in enumerate(questions):
            messages.append(Message("user", question))
            events = [e async for e in backend.stream("c", messages, SamplingParams(max_tokens=12))]
            reply, usage = "".join(e.text for e in events), events[-1].usage
            ids = backend.cached_token_ids("c")
            prompt, completion = ids[: usage.prompt_tokens], ids[usage.prompt_tokens:]
            assert completion == hf_greedy(reference, prompt, 12, eos_token_id=tokenizer.eos_token_id)
            template = template_ids(tokenizer, messages)
            assert letters(prompt, tokenizer) == letters(template, tokenizer)
            if turn:
                carried = len(history) - (history[-1] == tokenizer.eos_token_id)
                assert backend.reused_tokens("c") == carried, f"{kind}: turn {turn + 1} re-tokenized its history"
                assert prompt[:carried] == history[:carried]
                assert usage.cached_tokens >= len(history) - 16, f"{kind}: turn {turn + 1} missed the cache"
            history = ids
            messages.append(Message("assistant", reply))
        await backend.close()

    asyncio.run(conversation())


def test_an_edited_reply_gets_the_templates_own_ids(model_folder):
    """What the user changed is not what the model said: the next prompt is the template's, not a splice."""
    _, folder, _, tokenizer = model_folder
    backend = BenchBackend(EngineOptions(dtype="float32"), default_model=str(folder))

    async def conversation():
        messages = [Message("user", "the cat sat on a mat?")]
        events = [e async for e in backend.stream("c", messages, SamplingParams(max_tokens=8))]
        messages += [Message("assistant", "rain fell over quiet hills"), Message("user", "and then?")]
        events = [e async for e in backend.stream("c", messages, SamplingParams(max_tokens=4))]
        prompt = backend.cached_token_ids("c")[: events[-1].usage.prompt_tokens]
        assert backend.reused_tokens("c") == 0
        assert prompt == template_ids(tokenizer, messages)
        await backend.close()

    asyncio.run(conversation())


def test_a_stateless_client_resending_its_history_as_text_keeps_the_real_ids(model_folder):
    """As `tuichat serve` gets it: every turn a new conversation id and the whole history as text, the replies
    as the client received them. The turn it continues is found by its text, and its real ids carried over:
    re-tokenizing the replies would lose the cache's hit with every SentencePiece-style tokenizer here."""
    kind, folder, _, tokenizer = model_folder
    backend = BenchBackend(EngineOptions(dtype="float32"), default_model=str(folder))
    questions = ["the cat sat on a mat?", "and the birds sang songs about rivers?", "write a python loop"]

    async def conversation():
        messages: list[Message] = []
        history: list[int] = []
        for turn, question in enumerate(questions):
            messages.append(Message("user", question))
            events = [e async for e in backend.stream(f"request-{turn}", messages, SamplingParams(max_tokens=12))]
            ids = backend.cached_token_ids(f"request-{turn}")
            if turn:
                carried = len(history) - (history[-1] == tokenizer.eos_token_id)
                assert backend.reused_tokens(f"request-{turn}") == carried, f"{kind}: turn {turn + 1} lost its history"
                assert events[-1].usage.cached_tokens >= len(history) - 16
            history = ids
            messages.append(Message("assistant", "".join(e.text for e in events)))
        await backend.close()

    asyncio.run(conversation())


def test_a_reply_cut_inside_a_character_still_carries_its_ids(embedded, tmp_path):
    """A length limit that falls inside a character's bytes: the stream never shows the cut character (the
    detokenizer holds back a trailing U+FFFD), so the reply the next turn sends lacks it. The model's ids are
    still its reply: the same conversation's next turn and a fork of it (a new id, the history as text) carry
    them. A tiny Llama with SmolLM2's tokenizer, rigged so that greedy decoding writes "cat" then a character's
    first byte, over and over: its layers add nothing to the residual stream (o_proj and down_proj zero), every
    token but "cat" has one embedding, and the lm_head maps each embedding to the next token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = embedded[3]
    cat, lead = tokenizer.convert_tokens_to_ids("cat"), tokenizer.convert_tokens_to_ids("Ã")  # Ã: the byte 0xC3
    assert tokenizer.convert_ids_to_tokens([cat, lead]) == ["cat", "Ã"]
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.model.embed_tokens.weight[cat] = 0.0
        model.model.embed_tokens.weight[cat, 1] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[cat, 0] = model.lm_head.weight[lead, 1] = 10.0
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    backend = BenchBackend(EngineOptions(dtype="float32"), default_model=str(tmp_path))

    async def conversation():
        question = [Message("user", "Say a word")]
        events = [e async for e in backend.stream("c", question, SamplingParams(max_tokens=4, temperature=0))]
        shown, history = "".join(e.text for e in events), backend.cached_token_ids("c")
        assert history[-4:] == [cat, lead, cat, lead]
        assert shown == "cat\ufffdcat"  # the lone byte inside the reply is shown, the one at its end is not
        messages = question + [Message("assistant", shown), Message("user", "And then?")]
        for conversation_id in ("a fork", "c"):  # the fork first: it continues c's last turn, which c's own would replace
            async for _ in backend.stream(conversation_id, messages, SamplingParams(max_tokens=1, temperature=0)):
                pass
            assert backend.reused_tokens(conversation_id) == len(history), conversation_id
        await backend.close()

    asyncio.run(conversation())
