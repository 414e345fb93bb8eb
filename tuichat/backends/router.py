"""The Backend every front end is given: a model spec `NAME:MODEL_ID` of a configured endpoint goes to that
endpoint's RemoteBackend, any other spec to the in-process LocalBackend. The TUI, `ask`, `bench` and their tabs
keep talking to one Backend, and local and remote tabs run side by side."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from tuichat.backends.endpoints import Endpoint, one_off, split_spec
from tuichat.backends.protocol import (
    Backend,
    EngineOptions,
    EngineStats,
    Message,
    ModelInfo,
    ProgressCallback,
    SamplingParams,
    StreamEvent,
    TuichatError,
)


class Router:
    def __init__(self, local: Backend, endpoints: Sequence[Endpoint], default_model: str) -> None:
        self.local = local
        self.endpoints = {e.name: e for e in endpoints}
        self.default_model = default_model
        self._remotes: dict[str, Backend] = {}

    def _remote(self, name: str) -> Backend:
        if name not in self._remotes:
            from tuichat.backends.remote import RemoteBackend  # httpx: only once a remote model is used

            self._remotes[name] = RemoteBackend(self.endpoints[name])
        return self._remotes[name]

    def _route(self, spec: str | None) -> tuple[Backend, str | None, str]:
        """(the backend for `spec`, the model as that backend names it, the prefix that gives back the spec)."""
        spec = spec or self.default_model
        remote = split_spec(spec, self.endpoints)
        if remote is None:
            return self.local, spec, ""
        name, model = remote
        return self._remote(name), model, f"{name}:"

    async def load(self, model: str | None = None, progress: ProgressCallback | None = None) -> str:
        backend, name, prefix = self._route(model)
        return prefix + await backend.load(name, progress)

    def stream(self, conversation_id: str, messages: Sequence[Message], params: SamplingParams,
               model: str | None = None) -> AsyncIterator[StreamEvent]:
        backend, name, _ = self._route(model)
        return backend.stream(conversation_id, messages, params, name)

    def complete(self, request_id: str, prompt: str, params: SamplingParams,
                 model: str | None = None) -> AsyncIterator[StreamEvent]:
        backend, name, _ = self._route(model)
        return backend.complete(request_id, prompt, params, name)

    async def prefill(self, conversation_id: str, messages: Sequence[Message], model: str | None = None) -> int:
        backend, model_id, _ = self._route(model)
        return await backend.prefill(conversation_id, messages, model_id)

    def set_context_policy(self, policy: str) -> None:
        """The local engine's context policy from now on (remote servers apply their own)."""
        self.local.set_context_policy(policy)

    def cancel(self, conversation_id: str) -> None:
        for backend in (self.local, *self._remotes.values()):
            backend.cancel(conversation_id)

    def stats(self, model: str | None = None) -> EngineStats:
        backend, name, prefix = self._route(model)
        return backend.stats(prefix + name if prefix else name)

    def sampling_defaults(self, model: str) -> dict:
        backend, name, _ = self._route(model)
        return backend.sampling_defaults(name)

    def list_models(self) -> list[ModelInfo]:
        """The local models, then each endpoint's (GET /v1/models, all at once, each with a short timeout); an
        endpoint that does not answer is listed as `NAME:` with the reason."""
        def listed(name: str) -> list[ModelInfo]:
            try:
                return [ModelInfo(f"{name}:{m.spec}", "remote", m.description) for m in self._remote(name).list_models()]
            except TuichatError as exc:
                return [ModelInfo(f"{name}:", "remote", f"unreachable: {exc}")]

        with ThreadPoolExecutor(max(1, len(self.endpoints))) as pool:
            remote = [info for infos in pool.map(listed, self.endpoints) for info in infos]
        return [*self.local.list_models(), *remote]

    async def close(self) -> None:
        for backend in (self.local, *self._remotes.values()):
            await backend.close()


def build(options: EngineOptions, model: str | None, config_model: str, endpoints: Sequence[Endpoint],
          extra_models: Sequence[str] = (), base_url: str | None = None,
          api_key_env: str | None = None, model_dirs: Sequence[str] = ()) -> tuple[Router, str]:
    """(the Router for a front end, the model spec it starts with). `--base-url` adds the endpoint "remote" (in
    place of a configured one of that name), and a `--model` that names no endpoint is that server's model;
    without `--model`, the server's first."""
    from tuichat.backends.local import LocalBackend

    endpoints = list(endpoints)
    if base_url is not None:
        endpoint = one_off(base_url, api_key_env)
        endpoints = [e for e in endpoints if e.name != endpoint.name] + [endpoint]
        if model is None or split_spec(model, [e.name for e in endpoints]) is None:
            model = f"{endpoint.name}:{model or ''}"
    model = model or config_model
    local_default = config_model if split_spec(model, [e.name for e in endpoints]) else model
    return Router(LocalBackend(options, local_default, extra_models, model_dirs), endpoints, model), model
