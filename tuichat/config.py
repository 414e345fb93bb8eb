"""User settings: one TOML file in the config dir, read once at start-up.

A mistake in the file never stops tuichat: each bad setting is dropped with a warning that names it and the
rest of the file still applies (the UI shows warnings as notifications, `tuichat ask` prints them).
"""

from __future__ import annotations

import difflib
import json
import math
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuichat import paths
from tuichat.backends.endpoints import Endpoint, read_endpoints
from tuichat.backends.protocol import EngineOptions


@dataclass
class Config:
    model: str = "smollm2-135m"  # default model spec for new tabs
    system_prompt: str | None = None
    theme: str = "tuichat-dark"  # first-run theme; the last one picked is kept in the Store settings and wins
    # The [sampling] settings the user wrote, as SamplingParams fields: backend.chat_sampling lays them over the
    # model's recommendation, so a setting left out is not pinned to a default.
    sampling: dict[str, Any] = field(default_factory=dict)
    engine: EngineOptions = field(default_factory=EngineOptions)
    keymap: dict[str, str] = field(default_factory=dict)  # binding id -> keys, for Textual's App.set_keymap
    models: list[str] = field(default_factory=list)  # extra model specs listed in the model picker
    model_dirs: list[str] = field(default_factory=list)  # folders whose .gguf files are listed (tuichat.stores)
    endpoints: list[Endpoint] = field(default_factory=list)  # remote OpenAI-compatible servers (NAME:MODEL specs)
    prefill_while_typing: bool = True  # a pause in typing prefills the turn so far, in the engine's quiet steps


def config_path() -> Path:
    return paths.config_dir() / "config.toml"


# Written on first start so users find every setting without reading docs. Every setting line is commented
# out, so loading this file as is gives the defaults; tests uncomment each line to check that it is valid.
DEFAULT_CONFIG_TOML = """\
# tuichat settings. Each "# name = value" line shows a setting with its default (or an example where the
# default is "unset"); delete the "# " to change it. A mistake here never stops tuichat: the bad setting is
# ignored and a notification names it.

# Model for new tabs: an alias (see `tuichat models`), a local Hugging Face folder, a .gguf file or a hub id.
# model = "smollm2-135m"

# More models to list in the model picker, next to the ones tuichat finds by itself.
# models = ["HuggingFaceTB/SmolLM2-360M-Instruct", "~/models/qwen2.5-0.5b-instruct"]

# Folders whose .gguf files (at any depth) are listed too. Ollama's store, LM Studio's folders and the Hugging
# Face cache are found without this.
# model_dirs = ["~/models"]

# Remote OpenAI-compatible servers (vLLM, SGLang, llama.cpp, Ollama, another tuichat serve): a model spec
# NAME:MODEL_ID then runs there, e.g. --model lab:Qwen/Qwen2.5-72B-Instruct. The key is read from the environment
# variable api_key_env names (never written here); headers and timeout (seconds) are optional. One [[endpoints]]
# table per server works too.
# endpoints = [{ name = "lab", base_url = "http://gpu-box:8000/v1", api_key_env = "LAB_API_KEY", timeout = 60 }]

# Sent at the start of every conversation. Unset: no system prompt.
# system_prompt = "You are a concise assistant."

# When you pause typing, the engine prefills the conversation and what you typed so far, in steps it has
# nothing else to do (never delaying a reply that streams), so that Enter finds most of the prompt cached.
# prefill_while_typing = true

# Theme on first start; after that, the theme you last picked is remembered. Bundled: tuichat-dark,
# tuichat-light, tuichat-high-contrast, tuichat-solarized-light. Your own .toml themes go in the themes/
# folder next to this file.
# theme = "tuichat-dark"

[sampling]
# Unset, a reply samples as the model's generation config recommends, or else with temperature 0.2, top_p 0.9
# and frequency_penalty 0.5 (the setting that loops least on the embedded model: see docs/design/sampling.md).
# 0 is greedy: always the likeliest token, so the same prompt gives the same reply, untouched by the default
# penalty (only one set here applies). Higher is more varied.
# temperature = 0.2
# Sample only from the likeliest tokens whose probabilities add up to top_p (0 < top_p <= 1). 1.0: off.
# top_p = 0.9
# Sample only from the top_k likeliest tokens. 0: off.
# top_k = 0
# Longest reply, in tokens.
# max_tokens = 512
# Seed for reproducible sampling. Unset: random.
# seed = 1234
# End the reply when one of these strings appears.
# stop = ["\\nUser:"]
# Lower the logits of tokens already in the reply (OpenAI's penalties, -2 to 2): presence once, frequency per
# occurrence. 0: off.
# presence_penalty = 0.0
# frequency_penalty = 0.5

[engine]
# auto | cpu | cuda | cuda:N (auto: a GPU when there is one)
# device = "auto"
# auto | float32 | bfloat16 | float16
# dtype = "auto"
# Memory for the KV cache, in MiB. Unset: a default per device.
# kv_cache_mb = 1024
# continuous: requests join and leave the running batch at every step (tabs answer at once);
# static: a batch runs until all its requests finish; off: one request at a time.
# batching = "continuous"
# Reuse the cached KV of a prompt prefix seen before (the earlier turns of a conversation).
# prefix_cache = true
# Token budget of one engine step. Unset: a default per device.
# max_batched_tokens = 2048
# Most requests running at once.
# max_num_seqs = 64
# Tensor-parallel ranks (processes that each hold a slice of every layer).
# tp = 1
# Split the model's layers over the visible GPUs with accelerate (auto | balanced | balanced_low_0 |
# sequential). Unset: the whole model on `device`.
# device_map = "auto"
# Linear weights, where tuichat's C layers run (CPU, bfloat16, llama/mistral/qwen2): auto reads a .gguf's in the
# file's own blocks (Q8_0, Q4_0, Q4_1; Q5_0, Q5_1 and K-quants re-cut into blocks of 32: a third of the bytes of
# bf16 or less) and a dense model's in bf16; none
# dequantizes a .gguf's to bf16; int8 / int4 quantize a dense model's to Q8_0 / Q4_1 blocks of 32 (int4's
# lm_head Q8_0) at its first load, then cached: about a half / a third of the bytes a step reads, at some fidelity.
# quant = "auto"
# Speculative decoding: each step also checks the tokens that followed the latest earlier occurrence of the
# reply's last few tokens (text the model repeats from the conversation), keeping those the model agrees
# with, so replies are the same as without it. auto: where it pays (a few tabs at once); ngram: always; off.
# speculate = "auto"
# A conversation that outgrows the model's context: drop its oldest turns (keeping the system prompt and the
# latest turns), summarise them with the model into a note kept at the top, or refuse it. `tuichat serve`
# refuses unless told otherwise, as OpenAI's API does. The palette switches it for the session.
# context_policy = "drop"
# Conversations' KV kept in the cache dir (the blocks the KV cache evicts, and all of them when a model unloads
# or tuichat quits), read back instead of prefilled again: a long conversation reopened after a restart
# answers about as fast as before it. At most this many MiB, least recently used first out. 0: off.
# kv_disk_mb = 2048

[keymap]
# Rebind keys: binding id = keys, several keys separated by commas. Ids that contain dots need quotes.
# "binding-id" = "ctrl+j,f5"
"""


@dataclass(frozen=True)
class _Rule:
    expect: str  # completes "must be ..." in the warning
    ok: Callable[[Any], bool]
    convert: Callable[[Any], Any] = lambda value: value


def _int(low: int) -> _Rule:
    # bool is an int subclass in Python; `true` for a count is a mistake, not 1.
    return _Rule(f"a whole number ≥ {low}", lambda v: type(v) is int and v >= low)


def _number(expect: str, ok: Callable[[float], bool]) -> _Rule:
    return _Rule(
        expect,
        lambda v: type(v) in (int, float) and math.isfinite(v) and ok(v),
        float,
    )


def _choice(*options: str) -> _Rule:
    return _Rule("one of " + ", ".join(f'"{o}"' for o in options), lambda v: v in options)


def _text(expect: str = "a non-empty string") -> _Rule:
    return _Rule(expect, lambda v: isinstance(v, str) and v.strip() != "")


_STRINGS = _Rule(
    "a list of non-empty strings",
    lambda v: isinstance(v, list) and all(isinstance(s, str) and s != "" for s in v),
)

_TOP_LEVEL = {
    "model": _text(),
    # An empty prompt means "none": TOML has no null to write instead.
    "system_prompt": _Rule("a string", lambda v: isinstance(v, str), lambda v: v or None),
    "theme": _text("a theme name"),
    "models": _STRINGS,
    "model_dirs": _STRINGS,
    "prefill_while_typing": _Rule("true or false", lambda v: isinstance(v, bool)),
}

_SAMPLING = {
    "temperature": _number("a number ≥ 0", lambda v: v >= 0),
    "top_p": _number("a number above 0 and at most 1", lambda v: 0 < v <= 1),
    "top_k": _int(0),
    "max_tokens": _int(1),
    "seed": _int(0),
    "stop": _Rule(_STRINGS.expect, _STRINGS.ok, tuple),
    "presence_penalty": _number("a number from -2 to 2", lambda v: -2 <= v <= 2),
    "frequency_penalty": _number("a number from -2 to 2", lambda v: -2 <= v <= 2),
}

_ENGINE = {
    "device": _Rule(
        '"auto", "cpu", "cuda" or "cuda:N"',
        lambda v: isinstance(v, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", v) is not None,
    ),
    "dtype": _choice("auto", "float32", "bfloat16", "float16"),
    "kv_cache_mb": _int(1),
    "batching": _choice("continuous", "static", "off"),
    "prefix_cache": _Rule("true or false", lambda v: isinstance(v, bool)),
    "max_batched_tokens": _int(1),
    "max_num_seqs": _int(1),
    "tp": _int(1),
    "device_map": _choice("auto", "balanced", "balanced_low_0", "sequential"),
    "quant": _choice("auto", "none", "int8", "int4"),
    "speculate": _choice("auto", "ngram", "off"),
    "context_policy": _choice("drop", "summarise", "refuse"),
    "kv_disk_mb": _int(0),
}

_TABLES = ("sampling", "engine", "keymap")


def _show(value: Any) -> str:
    """A value as it looks in TOML, so the warning matches what the user typed."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, list)):
        return json.dumps(value, ensure_ascii=False, default=str)
    if isinstance(value, dict):
        return "a table"
    return str(value)


class _Reader:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.warnings: list[str] = []

    def warn(self, text: str) -> None:
        self.warnings.append(f"{self.path}: {text}")

    def unknown(self, name: str, known: list[str], prefix: str = "") -> None:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f' (did you mean "{prefix}{close[0]}"?)' if close else ""
        self.warn(f'unknown setting "{prefix}{name}" ignored{hint}.')

    def table(self, data: dict[str, Any], rules: dict[str, _Rule], prefix: str = "") -> dict[str, Any]:
        """The valid settings of one table, converted; a warning for each of the others."""
        good = {}
        for name, value in data.items():
            rule = rules.get(name)
            if rule is None:
                self.unknown(name, list(rules), prefix)
            elif not rule.ok(value):
                self.warn(f'"{prefix}{name}" must be {rule.expect}, not {_show(value)}; using the default.')
            else:
                good[name] = rule.convert(value)
        return good

    def keymap(self, data: dict[str, Any], id_prefix: str = "") -> dict[str, str]:
        keymap = {}
        for name, value in data.items():
            binding = id_prefix + name
            # A dotted id written bare (app.quit = "...") arrives as a nested table: rebuild the dotted id.
            if isinstance(value, dict):
                keymap |= self.keymap(value, f"{binding}.")
            elif isinstance(value, str) and value.strip():
                keymap[binding] = value
            else:
                self.warn(f'"keymap.{binding}" must be keys as a string such as "ctrl+j", not {_show(value)}.')
        return keymap

    def config(self, data: dict[str, Any]) -> Config:
        tables: dict[str, dict[str, Any]] = {}
        top = {}
        for name, value in data.items():
            if name in _TABLES:
                if isinstance(value, dict):
                    tables[name] = value
                else:
                    self.warn(f'"{name}" must be a [{name}] table, not {_show(value)}; using the defaults.')
            elif name in _TOP_LEVEL:
                top[name] = value
            elif name == "endpoints":
                top[name] = read_endpoints(value, self.warn)
            elif name in _SAMPLING or name in _ENGINE:
                table = "sampling" if name in _SAMPLING else "engine"
                self.warn(f'"{name}" ignored: it belongs under [{table}], after the top-level settings.')
            else:
                self.unknown(name, [*_TOP_LEVEL, *_TABLES, "endpoints"])
        endpoints = top.pop("endpoints", [])
        return Config(
            **self.table(top, _TOP_LEVEL),
            endpoints=endpoints,
            sampling=self.table(tables.get("sampling", {}), _SAMPLING, "sampling."),
            engine=EngineOptions(**self.table(tables.get("engine", {}), _ENGINE, "engine.")),
            keymap=self.keymap(tables.get("keymap", {})),
        )


def _where(error: tomllib.TOMLDecodeError) -> str:
    # Python 3.14 adds .lineno; before that the line is only in the message: "... (at line 3, column 7)".
    line = getattr(error, "lineno", None)
    if line is None:
        match = re.search(r"at line (\d+)", str(error))
        line = match and match.group(1)
    return f", line {line}" if line else ""


def load_config(path: Path | None = None) -> tuple[Config, list[str]]:
    """The settings in `path` (default: config_path()) and human-readable warnings about what was ignored.
    Never raises. A missing file is created from DEFAULT_CONFIG_TOML so the user can find and edit it."""
    path = path or config_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(DEFAULT_CONFIG_TOML, encoding="utf-8")
        except OSError:
            pass  # a read-only config dir only costs the template; the defaults are what it would say anyway
        return Config(), []
    except (OSError, UnicodeDecodeError) as error:
        return Config(), [f"{path} cannot be read ({error}); using the default settings."]
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        reason = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(error))
        return Config(), [f"{path}{_where(error)}: not valid TOML ({reason}); using the default settings."]
    reader = _Reader(path)
    config = reader.config(data)
    return config, reader.warnings
