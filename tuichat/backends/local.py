"""LocalBackend: the Backend protocol over in-process engines, one per loaded model.

It owns what the engine should not know about: chat templates, and each conversation's real token ids.
A new turn is built by appending the new messages' template tokens to the ids the engine actually saw and
produced, so turn N's prompt starts with exactly the tokens cached by turn N-1 (re-tokenizing rendered
text can split differently and silently lose the prefix-cache hit).

torch is imported lazily, in `load`, so that importing this module costs nothing at TUI start-up.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from tuichat import catalog
from tuichat.backends import context
from tuichat.backends.protocol import (
    EngineOptions,
    EngineStats,
    Message,
    ModelInfo,
    ProgressCallback,
    ResolvedModel,
    SamplingParams,
    ServingOptions,
    StreamEvent,
    TuichatError,
    Usage,
)
from tuichat.engine import stores
from tuichat.engine.heap import collector_paused, process_memory, settle_heap
from tuichat.engine.storage import cache_dir

MAX_LOADED_MODELS = 2  # a third model evicts the least recently used idle one
# Conversations whose last turn's ids are kept for the next: every tab, and a server's recent requests (each
# its own conversation); the least recently replied-to goes first.
MAX_CONVERSATIONS = 512
# The context policy "summarise": the instruction, and the longest summary (its room is kept in every prompt),
# an eighth of the context at most.
SUMMARY_PROMPT = ("Summarise the conversation below in a few sentences, for the assistant to go on from: keep names, "
                  "numbers, decisions and open questions. Write only the summary.")
SUMMARY_TOKENS = 192
PREFILL = "prefill:"  # the in-flight key of a conversation's prefill while its user types


def summary_tokens(context_tokens: int) -> int:
    return min(SUMMARY_TOKENS, context_tokens // 8)


@dataclass
class _Conversation:
    model: str
    prompt_text: str  # the last turn's prompt as the chat template rendered it
    num_messages: int  # of that prompt
    prompt_ids: list[int]  # the ids the engine ran for it
    completion_ids: list[int]  # and the ids it produced
    messages: tuple[Message, ...] = ()  # that prompt's messages (a summary of dropped turns among them)
    dropped: int = 0  # messages of the whole conversation it left out (context.fit)
    summary: str | None = None  # what stood for them


@dataclass
class _Turn:
    """A chat turn's prompt, and what the conversation's meter and the cache-miss report need of it."""

    rendered: str
    ids: list[int]
    messages: list[Message]  # what the prompt holds
    dropped: int
    dropped_tokens: int
    summary: str | None
    reused: int  # of `ids`, the previous turn's own ids
    miss: str | None  # why the history is not all a prefix of what the cache may hold
    context: int  # the most tokens the conversation can hold


@dataclass
class _Loaded:
    engine: object  # tuichat.engine.engine.Engine
    tokenizer: object
    device: str
    dtype: str
    last_used: float
    sampling: dict  # what the model's generation config recommends (read once, at load)
    load_s: float  # its load, from the weights' first byte to the engine ready
    mapped_bytes: int  # of its weights read in place from the file
    huge_page_bytes: int  # of the file, mapped in 2 MB pages at the load's end
    stop: tuple[str, ...] = ()  # added to every reply's stop strings (ResolvedModel.stop)
    leases: int = 0  # streams using the engine now: an engine with leases is never evicted


def chat_text(tokenizer, messages: Sequence[Message]) -> str:
    """The model's own chat template, ready for the assistant's reply; no system message is added here."""
    return tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages], add_generation_prompt=True, tokenize=False
    )


def chat_ids(tokenizer, messages: Sequence[Message]) -> list[int]:
    """A new conversation's prompt ids, as LocalBackend builds them."""
    return tokenizer(chat_text(tokenizer, messages), add_special_tokens=False)["input_ids"]


def shown_text(tokenizer, reply: list[int]) -> str:
    """A reply's text as its stream showed it, stripped: a character cut at the reply's end (a length limit
    inside its bytes) decodes to U+FFFD, which the stream's detokenizer holds back and never shows."""
    return tokenizer.decode(reply, skip_special_tokens=True).rstrip("\ufffd").strip()


def next_prompt(tokenizer, previous: _Conversation | None, messages: Sequence[Message], rendered: str,
                eos_ids) -> tuple[list[int], int]:
    """(the prompt ids for `rendered`, how many of them are the previous turn's real ids).

    The previous prompt and reply are kept as the engine ran and produced them, so the next turn hits the KV
    cache for all of them; only what the template writes after the reply (the end of the assistant's turn,
    the new messages, the generation prompt) is new. Those new tokens are cut from a tokenization of the whole
    rendered text, at the character where the reply ends, so they come out as the template's own ids do
    (tokenizing the tail alone would not: a SentencePiece tokenizer marks a word start at a string's start,
    byte-level BPE may merge differently there). When the reply re-tokenizes to what the model produced, the
    result is exactly the template's ids. When it does not, or the template puts whitespace around the reply
    (Llama 2 writes ' ' + reply + ' '; Gemma trims it), the model's own ids of its reply stay: the text then
    differs from the template's only in how, or with which spaces around it, the reply is written.
    The template's ids are used whenever the conversation is not the last turn plus its reply plus new
    messages: an edited or regenerated reply, a reply cut by a stop string, another template."""
    try:
        full = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError, TypeError):  # a tokenizer without offsets: no splicing
        return tokenizer(rendered, add_special_tokens=False)["input_ids"], 0
    ids, offsets = full["input_ids"], full["offset_mapping"]
    if (previous is None or len(messages) <= previous.num_messages or not rendered.startswith(previous.prompt_text)
            or messages[previous.num_messages].role != "assistant"):
        return ids, 0
    reply = list(previous.completion_ids)
    if reply and reply[-1] in eos_ids:
        reply.pop()  # the template writes the end of the turn itself; its tokens come from the tail below
    content = messages[previous.num_messages].content.strip()
    if shown_text(tokenizer, reply) != content:
        return ids, 0
    after = len(previous.prompt_text)
    start = rendered.find(content, after) if content else after
    if start < 0 or rendered[after:start].strip():
        return ids, 0
    end = start + len(content)
    tail = next((i for i, (first, _) in enumerate(offsets) if first >= end), len(ids))
    if any(last > end for _, last in offsets[:tail]):
        return ids, 0  # a token spans the reply's end: no boundary to cut at
    history = previous.prompt_ids + reply
    return history + ids[tail:], len(history)


def resolve(spec: str) -> ResolvedModel:
    """What `spec` names (catalog.resolve), and the specs of models in users' stores (engine.stores:
    ollama/NAME:TAG, lmstudio/..., hf/...), opened in place."""
    if stores.is_store_spec(spec) and not Path(spec).expanduser().exists():
        entry = stores.find(spec)  # by its whole name: ollama/NAME:TAG with the tag it took
        return dataclasses.replace(catalog.gguf_model(entry.info.spec, Path(entry.info.path)), stop=entry.stop,
                                   template=entry.template)
    return catalog.resolve(spec)


class LocalBackend:
    def __init__(self, options: EngineOptions | None = None, default_model: str = catalog.EMBEDDED_ALIAS,
                 extra_models: Sequence[str] = (), model_dirs: Sequence[str] = ()) -> None:
        self.options = options or EngineOptions()
        self.default_model = default_model
        self.extra_models = list(extra_models)
        self.model_dirs = list(model_dirs)
        self._loaded: dict[str, _Loaded] = {}
        self._names: dict[str, str] = {}  # model spec -> canonical name
        self._load_lock = threading.Lock()  # one load at a time (they take seconds: held off the event loop)
        self._lease_lock = threading.Lock()  # _loaded and the leases: held for moments only
        self._conversations: OrderedDict[str, _Conversation] = OrderedDict()
        self._in_flight: dict[str, tuple[object, int]] = {}  # conversation -> (engine, request id)

    # -- models -----------------------------------------------------------------------------------------
    def _ready(self, name: str | None) -> _Loaded | None:
        loaded = self._loaded.get(name) if name is not None else None
        return loaded if loaded is not None and loaded.engine.broken is None else None

    async def load(self, model: str | None = None, progress: ProgressCallback | None = None) -> str:
        spec = model or self.default_model
        # A spec seen before, or the name a load returned (a front end streams by that name: a GGUF's is its file
        # name, which resolves only from its own folder). Every reply calls load: stay on the loop.
        name = self._names.get(spec, spec)
        if (loaded := self._ready(name)) is not None:
            loaded.last_used = time.monotonic()
            return name
        # On a thread that ends with the load, not the loop's executor: a live thread that ran torch keeps an
        # OpenMP pool, and the engine thread's must be the only one (see Engine.start).
        loader_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tuichat-load")
        try:
            return await asyncio.get_running_loop().run_in_executor(loader_thread, self.load_sync, spec, progress)
        finally:
            loader_thread.shutdown(wait=False)

    def load_sync(self, model: str, progress: ProgressCallback | None = None) -> str:
        resolved = resolve(model)
        self._names[model] = resolved.name
        with self._load_lock:
            if (loaded := self._ready(resolved.name)) is not None:
                loaded.last_used = time.monotonic()
                return resolved.name
            # The imports and the load make objects by the hundred thousand that full collections would walk
            # again and again (heap.collector_paused).
            with collector_paused():
                from tuichat.engine import loader
                from tuichat.engine.cpu import build, native
                from tuichat.engine.engine import Engine, EngineConfig, recommended_sampling

                self._drop(resolved.name)  # a broken engine (a tensor-parallel rank failed): start afresh
                self._evict_idle()
                device = loader.resolve_device(self.options.device)
                resolved = loader.download(resolved, progress)
                family = loader.family(resolved, progress)
                # Before the dtype: whether the kernels built is what decides it on a CPU (resolve_dtype).
                if device.type == "cpu" and self.options.dtype in ("auto", "bfloat16") and build.build_pending():
                    loader.report(progress, "Building tuichat's CPU kernels (once)")
                dtype = loader.resolve_dtype(self.options.dtype, device, family, resolved.kind == "gguf")
                started = time.monotonic()  # after the kernels' build (resolve_dtype): a once-per-machine cost
                in_place = loader.in_place(resolved, device, dtype, self.options.quant, self.options.tp, self.options.device_map)
                weights, tokenizer = loader.load(resolved, device, dtype, self.options.device_map, progress, mapped=in_place)
                if resolved.template and tokenizer is not None and not tokenizer.chat_template:
                    from tuichat.engine.go_template import to_jinja

                    tokenizer.chat_template = to_jinja(resolved.template)
                quant_cache = loader.quant_cache(resolved, self.options.quant)
                serving = {f.name: getattr(self.options, f.name) for f in fields(ServingOptions)}
                kv_disk = (cache_dir() / "kv", loader.kv_identity(resolved, dtype, self.options.quant, in_place))
                config = EngineConfig(**serving, quant_cache=quant_cache,  # (served in place: no checkpoint to key by)
                                      quant_source=None if in_place else loader.checkpoint_dir(resolved), kv_disk=kv_disk)
                import torch

                kernels = device.type == "cpu" and dtype is torch.bfloat16  # where tuichat's kernels run
                if (kernels and family in native.SUPPORTED_MODEL_TYPES and self.options.tp == 1 and quant_cache is not None
                        and not quant_cache.is_file()):
                    loader.report(progress, f"Quantizing {resolved.name} to {self.options.quant} (first use only)")
                engine = Engine(weights, tokenizer, config, name=resolved.name, source=resolved)
                engine.start()
                with self._lease_lock:
                    self._loaded[resolved.name] = _Loaded(
                        engine, tokenizer, str(engine.device), str(engine.dtype).removeprefix("torch."), time.monotonic(),
                        recommended_sampling(weights), time.monotonic() - started,
                        getattr(getattr(weights, "tuichat_mapped", None), "in_place_bytes", 0),
                        getattr(getattr(weights, "tuichat_mapped", None), "huge_page_bytes", 0), resolved.stop,
                    )
                return resolved.name  # the pause's end settles: the load's transient buffers back to the system

    def _acquire(self, name: str) -> _Loaded | None:
        """Lease the loaded engine `name` for one stream (None if it was evicted or broke since it loaded)."""
        with self._lease_lock:
            loaded = self._ready(name)
            if loaded is not None:
                loaded.leases += 1
                loaded.last_used = time.monotonic()
            return loaded

    def _release(self, loaded: _Loaded) -> None:
        with self._lease_lock:
            loaded.leases -= 1

    def _drop(self, name: str) -> None:
        with self._lease_lock:
            loaded = self._loaded.pop(name, None)
        if loaded is not None:
            loaded.engine.close()
            self._conversations = OrderedDict((k, c) for k, c in self._conversations.items() if c.model != name)
            del loaded
            settle_heap()  # the model's weights, cache and reference cycles back to the system

    def _evict_idle(self) -> None:
        """Make room for one more model: close the least recently used engines that no stream holds."""
        while True:
            with self._lease_lock:
                idle = [n for n, m in self._loaded.items() if m.leases == 0]
                if len(self._loaded) < MAX_LOADED_MODELS or not idle:
                    return
                name = min(idle, key=lambda n: self._loaded[n].last_used)
            self._drop(name)

    def list_models(self) -> list[ModelInfo]:
        """The catalog's models, the embedded one with its file's facts, and those found in users' stores."""
        models = catalog.list_models(self.extra_models, [entry.info for entry in stores.discover(self.model_dirs)])
        if models and models[0].kind == "embedded" and models[0].path is not None:
            facts = stores.file_info(models[0].spec, "embedded", Path(models[0].path))
            models[0] = dataclasses.replace(facts, description=models[0].description)
        return models

    # -- prompts ------------------------------------------------------------------------------------------
    async def _prompt(self, name: str, loaded: _Loaded, conversation_id: str, messages: Sequence[Message],
                      params: SamplingParams, ahead: bool = False) -> _Turn:
        """The turn's prompt: the conversation fitted in the model's context under the context policy
        (context.fit), rendered by its chat template, spliced onto the previous turn's ids where it continues
        it (next_prompt), with the reason, if any, why it does not. `ahead` (a prefill while typing): a new
        summary is not made for it (TuichatError), since making one is a request of the foreground's priority."""
        if not messages or messages[-1].role != "user" or not messages[-1].content.strip():
            raise TuichatError("The prompt is empty.")
        engine, tokenizer = loaded.engine, loaded.tokenizer

        rendered_for: dict[tuple[Message, ...], str] = {}  # fit's count and the prompt render the same lists

        def render(sent: Sequence[Message]) -> str:
            key = tuple(sent)
            if key not in rendered_for:
                try:
                    rendered_for[key] = chat_text(tokenizer, sent)
                except Exception as exc:  # a template may reject e.g. a system message or two user turns in a row
                    raise TuichatError(f"{name}'s chat template rejected the conversation: {exc}") from exc
            return rendered_for[key]

        def count(sent: list[Message]) -> int:
            return len(tokenizer(render(sent), add_special_tokens=False)["input_ids"])

        previous = self._conversations.get(conversation_id)
        same = previous is not None and previous.model == name
        limit = min(engine.max_model_len, engine.capacity_tokens) - 1
        summarise = self.options.context_policy == "summarise"
        fit = context.fit if self.options.context_policy != "refuse" else context.whole
        fitted = fit(messages, count, limit, min(params.max_tokens, limit // 4), start=previous.dropped if same else 0,
                     extra=summary_tokens(limit) if summarise else 0, name=name)
        system, rest = context.split(messages)
        summary = None
        if summarise and fitted.dropped:
            if same and previous.dropped == fitted.dropped and previous.summary:
                summary = previous.summary
            elif ahead:
                raise TuichatError("A summary is made for the turn itself, not ahead of it.")
            else:
                summary = await self._summarise(name, loaded, rest[:fitted.dropped])
        sent = context.with_summary(system, summary) + rest[fitted.dropped:]
        rendered = render(sent)
        earlier = previous if same else self._continued(name, loaded, sent, rendered)
        ids, reused = next_prompt(tokenizer, earlier, sent, rendered, engine.eos_ids)
        record = previous or earlier  # a stateless client's conversation: the turn its history continues
        known = None if record is None else context.Previous(record.model, record.messages, record.dropped)
        miss = context.miss_reason(known, name, messages, sent, fitted.dropped, reused > 0, self.options.prefix_cache)
        dropped_tokens = count(system + rest) - count(system + rest[fitted.dropped:]) if fitted.dropped else 0
        return _Turn(rendered, ids, sent, fitted.dropped, dropped_tokens, summary, reused, miss, limit)

    async def _summarise(self, name: str, loaded: _Loaded, dropped: list[Message]) -> str:
        """The model's summary of the turns the context policy leaves out (greedy, summary_tokens at most), run
        as a request of its own: its prefill and decode are what the summary costs."""
        transcript = "\n\n".join(f"{m.role.capitalize()}: {m.content}" for m in dropped)
        limit = min(loaded.engine.max_model_len, loaded.engine.capacity_tokens) - 1
        most = summary_tokens(limit)
        ids = loaded.tokenizer(transcript, add_special_tokens=False)["input_ids"]
        # What the instruction and the template take, and a few tokens for how the joins tokenize.
        room = limit - most - len(chat_ids(loaded.tokenizer, [Message("user", SUMMARY_PROMPT)])) - 8
        if len(ids) > room:  # the oldest part goes: the summary keeps what the conversation came to
            transcript = loaded.tokenizer.decode(ids[-room:])
        request = [Message("user", f"{SUMMARY_PROMPT}\n\n{transcript}")]
        text = []
        async for event in self._generate(f"summary-{time.monotonic_ns()}", SamplingParams(max_tokens=most),
                                          name, lambda _, held: self._bare(held, request)):
            if event.error:
                raise TuichatError(f"Summarising the earlier turns failed: {event.error}")
            text.append(event.text)
        return "".join(text).strip()

    @staticmethod
    async def _bare(loaded: _Loaded, request: list[Message]):
        return chat_ids(loaded.tokenizer, request), None, None

    def _continued(self, name: str, loaded: _Loaded, messages: Sequence[Message], rendered: str) -> _Conversation | None:
        """The remembered turn that `messages` continue, for a client that sends its whole history as text each
        turn under a new id (the OpenAI API is stateless): the latest turn whose prompt the new one starts with
        and whose reply is the assistant message after it. Its real ids then keep the prefix cache's hit on
        the reply, which re-tokenizing the reply's text could split otherwise."""
        for turn in reversed(self._conversations.values()):
            if (turn.model == name and turn.num_messages < len(messages) and rendered.startswith(turn.prompt_text)
                    and messages[turn.num_messages].role == "assistant"):
                reply = [i for i in turn.completion_ids if i not in loaded.engine.eos_ids]
                if shown_text(loaded.tokenizer, reply) == messages[turn.num_messages].content.strip():
                    return turn
        return None

    # -- streaming ----------------------------------------------------------------------------------------
    def stream(
        self,
        conversation_id: str,
        messages: Sequence[Message],
        params: SamplingParams,
        model: str | None = None,
    ) -> AsyncIterator[StreamEvent]:
        async def build(name: str, loaded: _Loaded):
            turn = await self._prompt(name, loaded, conversation_id, messages, params)

            def remember(seq) -> None:
                self._conversations.pop(conversation_id, None)  # to the end: the most recent
                while len(self._conversations) >= MAX_CONVERSATIONS:
                    self._conversations.popitem(last=False)
                self._conversations[conversation_id] = _Conversation(
                    name, turn.rendered, len(turn.messages), seq.token_ids[: seq.num_prompt_tokens],
                    seq.completion_ids, tuple(turn.messages), turn.dropped, turn.summary,
                )

            def annotate(usage: Usage) -> None:
                usage.context_tokens = turn.context
                usage.dropped_messages, usage.dropped_tokens, usage.summary = turn.dropped, turn.dropped_tokens, turn.summary
                block = loaded.engine.config.block_size
                usage.cache_miss = turn.miss or (context.evicted_reason(usage.cached_tokens, turn.reused, block)
                                                 if usage.prompt_tokens else None)
                if turn.miss == context.NOT_RUN and usage.restored_tokens:  # a restart, and its KV read back from disk
                    usage.cache_miss = None

            return turn.ids, remember, annotate

        return self._generate(conversation_id, params, model, build)

    def complete(self, request_id: str, prompt: str, params: SamplingParams,
                 model: str | None = None) -> AsyncIterator[StreamEvent]:
        """Continue `prompt` as plain text, with no chat template (what /v1/completions asks for)."""
        async def build(name: str, loaded: _Loaded):
            if not prompt:
                raise TuichatError("The prompt is empty.")
            return loaded.tokenizer(prompt)["input_ids"], None, None  # the tokenizer's own BOS, as generate's users get

        return self._generate(request_id, params, model, build)

    async def prefill(self, conversation_id: str, messages: Sequence[Message], model: str | None = None) -> int:
        """Compute the KV of this turn's prompt as it stands (the history and what the user has typed so far) in
        the engine's quiet steps (a background request: scheduler.py), so that the turn sent later finds it in
        the prefix cache; a newer prefill of the conversation, or its turn, cancels it. Returns the prompt's
        tokens, 0 where nothing was done (it was cancelled, or the prompt cannot run as it is)."""
        async def build(name: str, loaded: _Loaded):
            turn = await self._prompt(name, loaded, conversation_id, messages, SamplingParams(max_tokens=1), ahead=True)
            return turn.ids, None, None

        prompt = 0
        try:
            async for event in self._generate(PREFILL + conversation_id, SamplingParams(max_tokens=1), model, build,
                                              background=True):
                if event.finished and event.usage.finish_reason != "cancelled" and not event.error:
                    prompt = event.usage.prompt_tokens
        except TuichatError:  # too long, an empty message: the turn itself will say so
            return 0
        return prompt

    async def _generate(self, conversation_id: str, params: SamplingParams, model: str | None,
                        build, background: bool = False) -> AsyncIterator[StreamEvent]:
        """One reply's events; build(name, loaded) gives its prompt ids, what to remember of it when it ends, and
        what to add to each event's usage (each None where there is nothing)."""
        for _ in range(3):  # evicted or broken between its load and the lease: load it again
            name = await self.load(model)
            if (loaded := self._acquire(name)) is not None:
                break
        else:
            raise TuichatError(f"{model or self.default_model} was unloaded while starting the reply; send it again.")
        try:
            engine = loaded.engine
            if loaded.stop:
                params = dataclasses.replace(params, stop=tuple(dict.fromkeys(params.stop + loaded.stop)))
            prompt, remember, annotate = await build(name, loaded)
            loop = asyncio.get_running_loop()
            outputs: asyncio.Queue = asyncio.Queue()
            self.cancel(conversation_id)  # one reply per conversation at a time
            if not background:
                self.cancel(PREFILL + conversation_id)  # the turn itself now: its prefill is done or not needed
            seq = engine.submit(prompt, params, lambda out: loop.call_soon_threadsafe(outputs.put_nowait, out),
                                background=background)
            self._in_flight[conversation_id] = (engine, seq.id)
            finished = False
            try:
                while not finished:
                    out = await outputs.get()
                    # A consumer that fell behind (a busy loop, a slow client) takes what has piled up as one
                    # event, as vLLM's output collector does: fewer events to handle exactly when it is short of
                    # time. `t` stays the first piece's, when that text was produced.
                    text, first_t = [out.text], out.t
                    while not out.finished and not outputs.empty():
                        out = outputs.get_nowait()
                        text.append(out.text)
                    finished = out.finished
                    usage = out.usage or Usage()
                    if annotate is not None:
                        annotate(usage)
                    yield StreamEvent("".join(text), first_t, usage, finished, out.error)
            finally:
                if not finished:  # the consumer went away: stop generating for nobody
                    engine.cancel(seq.id)
                if self._in_flight.get(conversation_id, (None, None))[1] == seq.id:
                    del self._in_flight[conversation_id]
                if seq.finish_reason != "error" and remember is not None:
                    remember(seq)
        finally:
            self._release(loaded)

    def set_context_policy(self, policy: str) -> None:
        """What a conversation that outgrows the context gets from its next turn on (EngineOptions.context_policy)."""
        if policy not in ("drop", "summarise", "refuse"):
            raise TuichatError(f"Unknown context policy '{policy}': use drop, summarise or refuse.")
        self.options = dataclasses.replace(self.options, context_policy=policy)

    def cancel(self, conversation_id: str) -> None:
        engine, request_id = self._in_flight.get(conversation_id, (None, None))
        if engine is not None:
            engine.cancel(request_id)

    # -- metrics ------------------------------------------------------------------------------------------
    def stats(self, model: str | None = None) -> EngineStats:
        loaded = self._loaded.get(model or self.default_model) or next(iter(self._loaded.values()), None)
        if loaded is None:
            return EngineStats(model=model or self.default_model, tp=self.options.tp)
        engine = loaded.engine
        rss, peak = process_memory()
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
            weights=engine.weights,
            weight_bytes=engine.weight_bytes,
            speculate=engine.config.speculate,
            draft_tokens=engine.draft_tokens,
            accepted_tokens=engine.accepted_tokens,
            tokens_per_step=engine.sampled_tokens / engine.sampled_steps if engine.sampled_steps else 0.0,
            rss_bytes=rss,
            peak_rss_bytes=peak,
            load_s=loaded.load_s,
            mapped_bytes=loaded.mapped_bytes,
            huge_page_bytes=loaded.huge_page_bytes,
            kv_bytes=engine.kv_bytes,
            kv_disk_bytes=engine.kv_disk.total if engine.kv_disk is not None else 0,
            kv_disk_reads=engine.kv_disk.read_blocks if engine.kv_disk is not None else 0,
        )

    def sampling_defaults(self, model: str) -> dict:
        loaded = self._loaded.get(self._names.get(model, model))
        return dict(loaded.sampling) if loaded is not None else {}

    async def close(self) -> None:
        for loaded in self._loaded.values():
            await asyncio.to_thread(loaded.engine.close)
        self._loaded.clear()
