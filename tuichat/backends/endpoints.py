"""Remote engines as the user names them: the `endpoints` of config.toml, a one-off `--base-url`, and the model
specs `NAME:MODEL_ID` that pick one. No HTTP here (tuichat.backends.remote talks to them): the config and the TUI import
this at start-up."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

ONE_OFF = "remote"  # the endpoint `--base-url` makes
DEFAULT_TIMEOUT_S = 60.0
_NAME = re.compile(r"^[\w.-]+$")
_ENV_VAR = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server. The API key is never held here: only the name of the environment variable
    that has it, read when a request is sent."""

    name: str
    base_url: str  # what OpenAI clients take, ending in /v1
    api_key_env: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    timeout: float = DEFAULT_TIMEOUT_S  # seconds to connect, and to wait for each byte of a reply

    @property
    def root(self) -> str:
        """The server's own root, where /metrics and /health live (vLLM, SGLang, llama.cpp, tuichat serve)."""
        return self.base_url.removesuffix("/v1")


def normalize_url(url: str) -> str:
    """`http://host:8000` and `http://host:8000/v1/` both mean `http://host:8000/v1`."""
    url = url.strip().rstrip("/")
    return url if urlsplit(url).path else url + "/v1"


def url_problem(url: str) -> str | None:
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"must be an http:// or https:// URL such as http://127.0.0.1:8000/v1, not {url!r}"
    return None


def one_off(base_url: str, api_key_env: str | None) -> Endpoint:
    return Endpoint(ONE_OFF, normalize_url(base_url), api_key_env)


def split_spec(spec: str, names: Iterable[str]) -> tuple[str, str] | None:
    """(endpoint name, model id) when `spec` is NAME:MODEL_ID of a known endpoint, else None (a local model:
    a path or a hub id may hold a colon too, but never starts with an endpoint's name and one)."""
    name, colon, model = spec.partition(":")
    return (name, model) if colon and name in set(names) else None


def read_endpoints(value: Any, warn: Callable[[str], None]) -> list[Endpoint]:
    """config.toml's `endpoints` ([[endpoints]] tables, or an inline list of them): the valid ones; a warning
    naming each problem of the others."""
    if not isinstance(value, list):
        warn('"endpoints" must be a list of tables ([[endpoints]]), not a single value; ignored.')
        return []
    endpoints: list[Endpoint] = []
    for index, table in enumerate(value):
        where = f"endpoints[{index}]"
        if not isinstance(table, dict):
            warn(f"{where} must be a table with name and base_url; ignored.")
            continue
        endpoint = _endpoint(table, where, warn)
        if endpoint is None:
            continue
        if any(e.name == endpoint.name for e in endpoints):
            warn(f'{where}: a second endpoint named "{endpoint.name}"; ignored.')
            continue
        endpoints.append(endpoint)
    return endpoints


def _endpoint(table: dict[str, Any], where: str, warn: Callable[[str], None]) -> Endpoint | None:
    for key in sorted(set(table) - {"name", "base_url", "api_key_env", "headers", "timeout"}):
        hint = " (the key itself never goes in the config: name its environment variable in api_key_env)" \
            if key in ("api_key", "key", "token") else ""
        warn(f'{where}: unknown setting "{key}" ignored{hint}.')
    name, url = table.get("name"), table.get("base_url")
    if not (isinstance(name, str) and _NAME.fullmatch(name)):
        warn(f"{where}: name must be letters, digits, '.', '-' or '_' (it prefixes the model: NAME:MODEL), "
             f"not {name!r}; endpoint ignored.")
        return None
    problem = url_problem(url) if isinstance(url, str) else "is missing"
    if problem:
        warn(f'{where} ("{name}"): base_url {problem}; endpoint ignored.')
        return None
    env = table.get("api_key_env")
    if env is not None and not (isinstance(env, str) and _ENV_VAR.fullmatch(env)):
        warn(f'{where} ("{name}"): api_key_env must be the name of an environment variable, not {env!r}; '
             "no key is sent.")
        env = None
    headers = table.get("headers", {})
    if not (isinstance(headers, dict) and all(isinstance(v, str) for v in headers.values())):
        warn(f'{where} ("{name}"): headers must be a table of strings; none are sent.')
        headers = {}
    timeout = table.get("timeout", DEFAULT_TIMEOUT_S)
    if type(timeout) not in (int, float) or not timeout > 0:
        warn(f'{where} ("{name}"): timeout must be a number of seconds above 0, not {timeout!r}; '
             f"using {DEFAULT_TIMEOUT_S:g}.")
        timeout = DEFAULT_TIMEOUT_S
    return Endpoint(name, normalize_url(url), env, tuple(headers.items()), float(timeout))
