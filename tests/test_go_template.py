"""Ollama's Go chat templates read as Jinja (tuichat.engine.go_template), rendered by transformers: against the
embedded model's own Jinja template, and against what Go's text/template writes for Ollama's Llama 3.2
template (written out here by hand from its semantics)."""

from __future__ import annotations

import pytest

from tests.test_stores import SMOLLM_GO_TEMPLATE
from tuichat.backends.protocol import TuichatError
from tuichat.engine.go_template import to_jinja

# An older template, without .Messages: Ollama runs it once a turn and cuts the last run at .Response.
SMOLLM_LEGACY = """{{ if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}{{ if .Prompt }}<|im_start|>user
{{ .Prompt }}<|im_end|>
{{ end }}<|im_start|>assistant
{{ .Response }}<|im_end|>
"""

# Ollama's library template for llama3.2 (its tools branches included).
LLAMA32 = """<|start_header_id|>system<|end_header_id|>

Cutting Knowledge Date: December 2023

{{ if .System }}{{ .System }}
{{- end }}
{{- if .Tools }}When you receive a tool call response, use the output to format an answer to the orginal user question.

You are a helpful assistant with tool calling capabilities.
{{- end }}<|eot_id|>
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 }}
{{- if eq .Role "user" }}<|start_header_id|>user<|end_header_id|>
{{- if and $.Tools $last }}

Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.

{{ range $.Tools }}
{{- . }}
{{ end }}
{{ .Content }}<|eot_id|>
{{- else }}

{{ .Content }}<|eot_id|>
{{- end }}{{ if $last }}<|start_header_id|>assistant<|end_header_id|>

{{ end }}
{{- else if eq .Role "assistant" }}<|start_header_id|>assistant<|end_header_id|>
{{- if .ToolCalls }}
{{ range .ToolCalls }}
{"name": "{{ .Function.Name }}", "parameters": {{ .Function.Arguments }}}{{ end }}
{{- else }}

{{ .Content }}
{{- end }}{{ if not $last }}<|eot_id|>{{ end }}
{{- else if eq .Role "tool" }}<|start_header_id|>ipython<|end_header_id|>

{{ .Content }}<|eot_id|>{{ if $last }}<|start_header_id|>assistant<|end_header_id|>

{{ end }}
{{- end }}
{{- end }}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hi {{ there }} {% x %} #"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "b"}, {"role": "user", "content": " c \n"}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}, {"role": "user", "content": "three"}],
]


def render(tokenizer, template: str, conversation) -> str:
    return tokenizer.apply_chat_template(conversation, chat_template=template, add_generation_prompt=True,
                                         tokenize=False)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_a_messages_template_renders_as_the_models_own_jinja(embedded, conversation):
    tokenizer = embedded[3]
    assert render(tokenizer, to_jinja(SMOLLM_GO_TEMPLATE), conversation) == render(tokenizer, tokenizer.chat_template,
                                                                                  conversation)


@pytest.mark.parametrize("conversation", CONVERSATIONS[1:2])
def test_an_older_template_runs_once_a_turn_cut_at_the_last_response(embedded, conversation):
    tokenizer = embedded[3]
    assert render(tokenizer, to_jinja(SMOLLM_LEGACY), conversation) == render(tokenizer, tokenizer.chat_template,
                                                                              conversation)


def test_llama32s_template_as_go_writes_it(embedded):
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    want = ("<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert render(embedded[3], to_jinja(LLAMA32), conversation) == want


@pytest.mark.parametrize("template, words", [
    ('{{ template "x" . }}', "{{ template }} is not read"),
    ("{{ if .System }}open", "without their {{ end }}"),
    ("{{ .Prompt }}", "must write .Response"),
    ("{{ printf \"%s\" .System }}{{ .Messages }}", "the function printf is not read"),
])
def test_what_the_subset_cannot_read_is_refused_clearly(template, words):
    with pytest.raises(TuichatError, match="Ollama's chat template could not be read") as error:
        to_jinja(template)
    assert words in str(error.value)
