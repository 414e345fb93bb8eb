"""LocalBackend: the Backend protocol over in-process engines, one per loaded model.

It owns what the engine should not know about: chat templates, and each conversation's real token ids.
A new turn is built by appending the new messages' template tokens to the ids the engine actually saw and
produced, so turn N's prompt starts with exactly the tokens cached by turn N-1 (re-tokenizing rendered
text can split differently and silently lose the prefix-cache hit).

torch is imported lazily, in `load`, so that importing this module costs nothing at TUI start-up.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from tuichat import catalog
from tuichat.backend import (
    BackendError,
    EngineOptions,
    EngineStats,
    Message,
    ModelInfo,
    ProgressCallback,
    SamplingParams,
    StreamEvent,
    Usage,
)

MAX_LOADED_MODELS = 2  # a third model evicts the least recently used idle one


@dataclass
class _Conversation:
    model: str
    token_ids: list[int]  # everything the engine has seen and produced for it
    text: str  # those ids decoded, special tokens kept: compared against the next rendered prompt


@dataclass
class _Loaded:
    engine: object  # tuichat.engine.engine.Engine
    tokenizer: object
    device: str
    dtype: str
    last_used: float


def chat_text(tokenizer, messages: Sequence[Message]) -> str:
    """The model's own chat template, ready for the assistant's reply; no system message is added here."""
    return tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages], add_generation_prompt=True, tokenize=False
    )


def chat_ids(tokenizer, messages: Sequence[Message]) -> list[int]:
    """A new conversation's prompt ids, as LocalBackend builds them."""
    return tokenizer(chat_text(tokenizer, messages), add_special_tokens=False)["input_ids"]


class LocalBackend:
    def __init__(self, options: EngineOptions = EngineOptions(), default_model: str = catalog.EMBEDDED_ALIAS,
                 extra_models: Sequence[str] = ()) -> None:
        self.options = options
        self.default_model = default_model
        self.extra_models = list(extra_models)
        self._loaded: dict[str, _Loaded] = {}
        self._names: dict[str, str] = {}  # model spec -> canonical name
        self._load_lock = threading.Lock()
        self._conversations: dict[str, _Conversation] = {}
        self._in_flight: dict[str, tuple[object, int]] = {}  # conversation -> (engine, request id)

    # -- models -----------------------------------------------------------------------------------------
    async def load(self, model: str | None = None, progress: ProgressCallback | None = None) -> str:
        spec = model or self.default_model
        name = self._names.get(spec)
        if name in self._loaded:  # every reply calls load: skip the resolve and the thread hop
            self._loaded[name].last_used = time.monotonic()
            return name
        return await asyncio.to_thread(self.load_sync, spec, progress)

    def load_sync(self, model: str, progress: ProgressCallback | None = None) -> str:
        resolved = catalog.resolve(model)
        self._names[model] = resolved.name
        with self._load_lock:
            if resolved.name in self._loaded:
                self._loaded[resolved.name].last_used = time.monotonic()
                return resolved.name
            from tuichat.engine import loader
            from tuichat.engine.engine import Engine, EngineConfig

            self._evict_idle()
            device = loader.resolve_device(self.options.device)
            dtype = loader.resolve_dtype(self.options.dtype, device)
            weights, tokenizer = loader.load(resolved, device, dtype, self.options.device_map, progress)
            config = EngineConfig(
                kv_cache_mb=self.options.kv_cache_mb,
                max_batched_tokens=self.options.max_batched_tokens,
                max_num_seqs=self.options.max_num_seqs,
                batching=self.options.batching,
                prefix_cache=self.options.prefix_cache,
                tp=self.options.tp,
            )
            import torch

            from tuichat.engine import cpu_kernel

            if device.type == "cpu" and dtype is torch.bfloat16 and cpu_kernel.build_pending():
                loader.report(progress, "Building tuichat's CPU kernels (once)")
            engine = Engine(weights, tokenizer, config, name=resolved.name, source=resolved)
            engine.start()
            self._loaded[resolved.name] = _Loaded(
                engine, tokenizer, str(engine.device), str(engine.dtype).removeprefix("torch."), time.monotonic()
            )
            return resolved.name

    def _evict_idle(self) -> None:
        busy = {id(engine) for engine, _ in self._in_flight.values()}
        idle = [name for name, m in self._loaded.items() if id(m.engine) not in busy]
        while len(self._loaded) >= MAX_LOADED_MODELS and idle:
            name = min(idle, key=lambda n: self._loaded[n].last_used)
            idle.remove(name)
            self._loaded.pop(name).engine.close()
            self._conversations = {k: c for k, c in self._conversations.items() if c.model != name}

    def list_models(self) -> list[ModelInfo]:
        return catalog.list_models(self.extra_models)

    # -- prompts ------------------------------------------------------------------------------------------
    def prompt_ids(self, model: str, conversation_id: str, messages: Sequence[Message]) -> list[int]:
        """Token ids for the next reply: the conversation's cached ids plus the new turns' template tokens."""
        tokenizer = self._loaded[model].tokenizer
        if not messages or messages[-1].role != "user" or not messages[-1].content.strip():
            raise BackendError("The prompt is empty.")
        try:
            rendered = chat_text(tokenizer, messages)
        except Exception as exc:  # a template may reject e.g. a system message or two user turns in a row
            raise BackendError(f"{model}'s chat template rejected the conversation: {exc}") from exc
        previous = self._conversations.get(conversation_id)
        if previous is not None and previous.model == model and rendered.startswith(previous.text):
            suffix = rendered[len(previous.text) :]
            return previous.token_ids + tokenizer(suffix, add_special_tokens=False)["input_ids"]
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]

    def _remember(self, model: str, conversation_id: str, token_ids: list[int]) -> None:
        tokenizer = self._loaded[model].tokenizer
        text = tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        self._conversations[conversation_id] = _Conversation(model, list(token_ids), text)

    # -- streaming ----------------------------------------------------------------------------------------
    async def stream(
        self,
        conversation_id: str,
        messages: Sequence[Message],
        params: SamplingParams,
        model: str | None = None,
    ) -> AsyncIterator[StreamEvent]:
        name = await self.load(model)
        engine = self._loaded[name].engine
        prompt = self.prompt_ids(name, conversation_id, messages)
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        self.cancel(conversation_id)  # one reply per conversation at a time
        seq = engine.submit(prompt, params, lambda out: loop.call_soon_threadsafe(outputs.put_nowait, out))
        self._in_flight[conversation_id] = (engine, seq.id)
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield StreamEvent(out.text, out.t, out.usage or Usage(), finished, out.error)
        finally:
            if not finished:  # the consumer went away: stop generating for nobody
                engine.cancel(seq.id)
            if self._in_flight.get(conversation_id, (None, None))[1] == seq.id:
                del self._in_flight[conversation_id]
            if seq.finish_reason != "error":
                self._remember(name, conversation_id, seq.token_ids)

    def cancel(self, conversation_id: str) -> None:
        engine, request_id = self._in_flight.get(conversation_id, (None, None))
        if engine is not None:
            engine.cancel(request_id)

    def cached_token_ids(self, conversation_id: str) -> list[int]:
        """The ids the next turn of this conversation builds on (for tests and the bench)."""
        conversation = self._conversations.get(conversation_id)
        return list(conversation.token_ids) if conversation else []

    # -- metrics ------------------------------------------------------------------------------------------
    def stats(self, model: str | None = None) -> EngineStats:
        loaded = self._loaded.get(model or self.default_model) or next(iter(self._loaded.values()), None)
        if loaded is None:
            return EngineStats(model=model or self.default_model, tp=self.options.tp)
        engine = loaded.engine
        return EngineStats(
            model=engine.name,
            device=loaded.device,
            dtype=loaded.dtype,
            tp=self.options.tp,
            running=len(engine.scheduler.running),
            waiting=len(engine.scheduler.waiting),
            batch_size=engine.last_batch_size,
            kv_blocks_used=engine.blocks.num_used,
            kv_blocks_total=engine.blocks.num_blocks,
            prefix_hit_rate=engine.prefix_hit_rate,
            tokens_per_s=engine.tokens_per_s(),
            batching=self.options.batching,
            prefix_cache=self.options.prefix_cache,
            matmul=engine.matmul,
            layers=engine.layers,
        )

    async def close(self) -> None:
        for loaded in self._loaded.values():
            await asyncio.to_thread(loaded.engine.close)
        self._loaded.clear()
