"""The engine: scheduler + KV cache + runner + sampler, stepped on its own thread.

Callers submit token ids and get RequestOutput callbacks on the engine thread (the backend forwards them
to asyncio). Tests and benchmarks can also drive `step()` directly, with no thread, for exact control.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import get_args

import torch

from tuichat.engine import attention, families, quant, speculate
from tuichat.engine.detok import IncrementalDetokenizer, StopMatcher
from tuichat.engine.families import ModelShape
from tuichat.engine.kv_cache import BlockManager, KVCache
from tuichat.engine.kv_disk import KVDisk
from tuichat.engine.prepare import prepare
from tuichat.engine.request import RequestOutput, Sequence, Status
from tuichat.engine.runner import RunnerBroken
from tuichat.engine.sampler import make_generator, sample
from tuichat.engine.scheduler import ScheduledChunk, Scheduler
from tuichat.engine.types import PromptTooLong, SamplingParams, ServingOptions, SpeculateMode, TuichatError

SPECULATE_MODES = get_args(SpeculateMode)
IDLE_EXIT_S = 1.0  # an engine thread without work ends after this long (see Engine.start)
# The CPU's KV pool: this many tokens (8 tabs of 2k, or one conversation of 16k) unless KV_MEMORY_SHARE of the
# machine's memory holds fewer. The pool is allocated (and touched) at load: RSS stays flat after.
KV_TOKENS = 16384
KV_MEMORY_SHARE = 0.2


def _memory_total() -> int:
    """The machine's memory in bytes (a large number where it cannot be told)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


@dataclass(frozen=True)
class EngineConfig(ServingOptions):
    """The user's ServingOptions and what only the engine's owner (LocalBackend, a test) sets."""

    block_size: int = 16  # small blocks: a chat's prefix hits end at most 15 tokens short
    num_blocks: int | None = None  # overrides kv_cache_mb (tests use tiny pools)
    fast_linears: bool = True  # fused q/k/v and gate/up, AMX or gemv kernels for decode rows (see fusion.py)
    quant_cache: Path | None = None  # the file caching a dense model's int8/int4 blocks (a GGUF's: beside its conversion)
    quant_source: Path | None = None  # the checkpoint folder int8/int4 quantize from (a GGUF's: its conversion)
    kv_disk: tuple[Path, str] | None = None  # (the folder, the model's identity): the KV's second tier, if kept


def eos_token_ids(model, tokenizer=None) -> set[int]:
    """Every EOS id the model's configs and the tokenizer name: chat models often list several."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return ids


def recommended_sampling(model) -> dict:
    """The sampling a model's generation config ships, as SamplingParams fields (what vLLM serves by default
    too): only the fields it sets, and only when it samples at all. Its repetition_penalty is left out: it
    divides logits, where SamplingParams' penalties are OpenAI's, which subtract."""
    config = getattr(model, "generation_config", None)
    if config is None or not config.do_sample:
        return {}
    given = config.to_diff_dict()
    chosen = {"temperature": float(config.temperature)}
    if "top_p" in given:
        chosen["top_p"] = float(config.top_p)
    if "top_k" in given and config.top_k:
        chosen["top_k"] = int(config.top_k)
    return chosen


class Engine:
    def __init__(
        self, model, tokenizer=None, config: EngineConfig = EngineConfig(), name: str = "model", source=None
    ) -> None:
        """`source` (a types.ResolvedModel) lets tensor-parallel workers load their own copy of the weights."""
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.name = name
        if config.quant not in ("auto", "none", *quant.QUANT_FORMATS):
            raise TuichatError(f"Unknown quant '{config.quant}': use auto, none, {', '.join(quant.QUANT_FORMATS)}.")
        first_param = next(model.parameters())
        self.device, self.dtype = first_param.device, first_param.dtype
        text_config = families.text_config(model.config)
        what = f"{name} ({getattr(text_config, 'model_type', 'unknown')})"
        if (why := families.unsupported(model.config)) is not None:
            raise TuichatError(f"tuichat cannot run {what}: {why}.")
        self.max_model_len = getattr(text_config, "max_position_embeddings", None) or 1 << 30
        shape = ModelShape.of(model.config)
        self.attention = self._inspect_attention(model, shape, what)
        num_layers, kv_heads, head_dim = shape.layers, shape.kv_heads, shape.head_dim
        local_kv_heads = kv_heads // config.tp  # each rank caches only its own heads
        num_blocks = config.num_blocks or self._default_num_blocks(num_layers, local_kv_heads, head_dim)
        self.blocks = BlockManager(num_blocks, config.block_size, config.prefix_cache)
        budget = config.max_batched_tokens or (8192 if self.device.type == "cuda" else 512)
        self.scheduler = Scheduler(self.blocks, budget, config.max_num_seqs, config.batching)
        # Each layer's KV where the layer computes: an accelerate device map spreads layers over GPUs, or
        # offloads some to the CPU or disk and computes them on its execution device.
        self.kv = KVCache(num_layers, num_blocks, config.block_size, local_kv_heads, head_dim, self.dtype,
                          self.attention.devices)
        sliding = [i for i, window in enumerate(self.attention.windows) if window]
        if sliding and self.kv.releasable and config.tp == 1:  # their K/V freed as it leaves every window
            self.blocks.window = max(self.attention.windows[i] for i in sliding)
            self.blocks.release = functools.partial(self.kv.release, layers=sliding)
        prepared = prepare(model, source, config, self.kv, self.blocks, self.attention, what)
        # One process holds the whole KV only without tensor parallelism (each rank caches its own heads).
        self.kv_disk = (KVDisk(*config.kv_disk, self.kv, config.block_size, config.kv_disk_mb * 2**20)
                        if config.kv_disk is not None and config.kv_disk_mb and config.tp == 1 else None)
        self.blocks.lower = self.kv_disk
        self.runner = prepared.runner
        # The labels the stats panel and the bench show (prepare.Prepared says what each holds).
        self.matmul, self.layers = prepared.matmul, prepared.layers
        self.weights, self.weight_bytes = prepared.weights, prepared.weight_bytes
        self._draw_kernels = prepared.kernels  # sampled rows drawn in C (sampler.c) where the kernels are built
        self.eos_ids = eos_token_ids(model, tokenizer)
        self._sequences: dict[int, Sequence] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # submissions and cancels from other threads
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None  # the engine thread while it runs (see start)
        self._started = False
        self._lock = threading.Lock()
        self._closed = False
        self.broken: str | None = None  # why the engine cannot serve any more (a tensor-parallel rank failed, ...)
        self._orphans: list[Sequence] = []  # requests whose consumer went away mid-step
        # Metrics.
        self.last_batch_size = 0
        # Speculation since start: draft tokens proposed and kept; sampled sequence-steps and the tokens they gave.
        self.draft_tokens = self.accepted_tokens = 0
        self._step_cost = speculate.StepCost()
        self.sampled_steps = self.sampled_tokens = 0
        self._generated: deque[tuple[float, int]] = deque()

    @staticmethod
    def _inspect_attention(model, shape: ModelShape, what: str) -> attention.ModelAttention:
        """Switch the model to paged attention and learn each layer's kind; refuse what we cannot run exactly."""
        try:
            model.set_attn_implementation(attention.register())
            found = attention.inspect(model, shape.layers)
        except (attention.UnsupportedAttention, ValueError) as exc:
            raise TuichatError(f"tuichat cannot run {what} faithfully: {exc}.") from None
        if (found.heads, found.kv_heads, found.head_dim) != (shape.heads, shape.kv_heads, shape.head_dim):
            raise TuichatError(
                f"tuichat cannot run {what} faithfully: its attention runs {found.heads} heads over {found.kv_heads} "
                f"KV heads of size {found.head_dim}, but its config says {shape.heads} over {shape.kv_heads} of "
                f"{shape.head_dim}."
            )
        return found

    # -- sizing -------------------------------------------------------------------------------------------
    def _default_num_blocks(self, num_layers: int, kv_heads: int, head_dim: int) -> int:
        per_block = KVCache.bytes_per_block(num_layers, self.config.block_size, kv_heads, head_dim, self.dtype)
        if self.config.kv_cache_mb is not None:
            budget = self.config.kv_cache_mb * 2**20
        elif self.device.type == "cuda":
            budget = int(torch.cuda.mem_get_info(self.device)[0] * 0.4)
        else:
            # Tokens, not bytes: KV_TOKENS of this model (a 1B Llama's are 16 times a 135M's per token), within a
            # share of the machine's memory and no more than its sequences can fill.
            tokens = min(KV_TOKENS, self.max_model_len * self.config.max_num_seqs)
            budget = min(tokens * per_block // self.config.block_size, int(_memory_total() * KV_MEMORY_SHARE))
        return max(1, budget // per_block)

    @property
    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for cache in (self.kv.k, self.kv.v) for t in cache)

    @property
    def capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.blocks.block_size

    # -- public API (thread-safe) ---------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int]) -> None:
        """Raise TuichatError for a prompt that can never run, before anything is queued."""
        if not prompt_ids:
            raise TuichatError("The prompt is empty.")
        if len(prompt_ids) >= self.max_model_len:
            raise PromptTooLong(
                f"The prompt is {len(prompt_ids)} tokens long; {self.name} takes at most {self.max_model_len - 1}."
            )
        if len(prompt_ids) + 1 > self.capacity_tokens:
            raise PromptTooLong(
                f"The prompt is {len(prompt_ids)} tokens long, but the whole KV cache holds {self.capacity_tokens}. "
                "Raise the engine's kv_cache_mb or start a new conversation."
            )
        vocab = self.model.get_input_embeddings().num_embeddings
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_ids):
            bad = next(t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab))
            raise TuichatError(f"Token id {bad!r} is outside {self.name}'s vocabulary of {vocab}.")

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, on_output: Callable[[RequestOutput], None] | None = None,
        background: bool = False,
    ) -> Sequence:
        """`background`: only in steps with nothing else to do (scheduler.py), never delaying another request."""
        self.validate(prompt_ids)
        seq = Sequence(list(prompt_ids), params, on_output, background=background)
        with self._lock:  # against close(): nothing may enter the inbox after the thread drained it for good
            if self._closed:
                raise TuichatError(f"The engine for {self.name} was shut down; load the model again.")
            if self.broken is not None:
                raise TuichatError(self.broken)
            self._inbox.put(("add", seq))
            self._spawn()
        self._wake.set()
        return seq

    def cancel(self, request_id: int) -> None:
        self._post("cancel", request_id)

    def set_speculate(self, mode: str) -> None:
        """Speculation's mode from the next step on, for the requests running too: the bench compares the modes
        on one engine, request by request, so that what the host does meanwhile falls on both alike."""
        if mode not in SPECULATE_MODES:
            raise ValueError(f"speculate must be one of {', '.join(SPECULATE_MODES)}, not {mode!r}")
        self._post("speculate", mode)

    def _post(self, op: str, item) -> None:
        """An operation for the engine thread, which applies it at its next step, in order with submissions."""
        with self._lock:
            self._inbox.put((op, item))
            self._spawn()
        self._wake.set()

    def _apply_speculate(self, mode: str) -> None:
        self.config = replace(self.config, speculate=mode)
        for seq in self.scheduler.running:  # a draft proposed under the old mode is not verified under the new
            seq.draft = []

    def has_work(self) -> bool:
        return self.scheduler.has_work() or not self._inbox.empty()

    # -- the step ----------------------------------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while True:
            try:
                op, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if op == "add":
                self._sequences[item.id] = item
                if self.broken is not None:  # submitted just before the engine broke
                    item.error = self.broken
                    self._finish(item, "error", time.monotonic())
                    continue
                try:
                    item.generator = make_generator(item.params)
                    if self.tokenizer is not None:
                        item.detok = IncrementalDetokenizer(self.tokenizer, item.token_ids)
                    item.stop_matcher = StopMatcher(item.params.stop)
                except Exception as exc:
                    self._fail(item, exc)
                    continue
                self.scheduler.add(item)
            elif op == "speculate":
                self._apply_speculate(item)
            elif (seq := self._sequences.get(item)) is not None:
                seq.cancelled = True
                self._finish(seq, "cancelled", time.monotonic())

    def step(self) -> None:
        """One scheduling round and one model forward. A failure that belongs to some requests ends those
        (with an error event) and leaves the others running; see _loop for the rest."""
        self._drain_inbox()
        self._propose()
        chunks = self.scheduler.schedule()
        if chunks:
            self.last_batch_size = len(chunks)
            started = time.perf_counter()
            chunks, logits = self._forward(chunks)
            self._step_cost.add(sum(c.length for c in chunks), time.perf_counter() - started)
            for chunk in chunks:
                chunk.seq.num_computed = chunk.start + chunk.length - len(chunk.draft)  # a draft's, once accepted
                self.blocks.register_computed(chunk.seq)
                self.blocks.release_window(chunk.seq)
            sampling = [c for c in chunks if c.samples]
            if sampling:
                tokens = self._sample(logits, sampling)
                now = time.monotonic()
                produced, row = 0, 0
                for chunk in sampling:
                    rows = 1 + len(chunk.draft)
                    produced += self._take(chunk, tokens[row : row + rows], now)
                    row += rows
                self._generated.append((now, produced))
                while now - self._generated[0][0] > 10.0:
                    self._generated.popleft()
                self.sampled_steps += len(sampling)
                self.sampled_tokens += produced
        self._end_orphans()

    def _propose(self) -> None:
        """Drafts for the sequences about to decode: what followed the latest earlier occurrence of their last
        few tokens (speculate.py). auto sizes each draft by what pays: a row is worth adding while the chance
        its token is kept beats the share of the step it adds times the tokens the step gives (at a large batch
        only drafts that are nearly sure pay), and drafts nothing while a prompt waits to be computed. The
        scheduler fits drafts into the step; `_take` keeps what the model agrees with."""
        mode = self.config.speculate
        if mode == "off":
            return
        decoding = [s for s in self.scheduler.running if s.num_uncomputed == 1]
        # auto leaves the step to prompts waiting to be computed: a draft's rows would delay their first token.
        prefilling = self.scheduler.waiting or len(decoding) < len(self.scheduler.running)
        worth = 0.0 if mode == "ngram" else self._step_cost.row_share(len(decoding)) * len(decoding)
        room = min(self.capacity_tokens, self.max_model_len)
        for seq in decoding:
            if seq.proposer is None:
                seq.proposer = speculate.NgramProposer()
            # The token each step adds after its draft counts against max_tokens and the context too.
            limit = min(seq.params.max_tokens - seq.num_completion_tokens, room - len(seq)) - 1
            if mode == "ngram":
                wanted = speculate.MAX_DRAFT
            else:
                wanted = 0 if prefilling else speculate.draft_length(seq.proposer.acceptance, worth)
            seq.draft = seq.proposer.propose(seq.token_ids, min(limit, wanted))

    def _take(self, chunk: ScheduledChunk, tokens: list[int | None], now: float) -> int:
        """Append what the sampled rows of `chunk` give: a row's token goes in, and while it equals the draft
        token its row was computed from, the next row's follows (that token's K/V came with this step). So
        the reply holds exactly the tokens one-token steps would have produced. Returns how many went in."""
        seq, draft = chunk.seq, chunk.draft
        seq.steps += 1  # counted before _accept: a finishing token's final usage includes this step
        seq.draft_tokens += len(draft)
        self.draft_tokens += len(draft)
        taken = accepted = 0
        for i, token in enumerate(tokens):
            if token is None:  # its sampling failed, and _sample ended it
                break
            drafted = i < len(draft) and token == draft[i]
            accepted += drafted
            seq.accepted_tokens += drafted
            self.accepted_tokens += drafted
            try:
                self._accept(seq, token, now, computed=drafted)
            except Exception as exc:  # the detokenizer or stop matcher, on this request's text
                self._fail(seq, exc)
                break
            taken += 1
            if not drafted or seq.status is Status.FINISHED:
                break
        if draft:
            seq.proposer.verified(len(draft), accepted)
            if seq.status is not Status.FINISHED:
                self.blocks.register_computed(seq)
        return taken

    def _forward(self, chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], torch.Tensor | None]:
        """(the chunks that ran, the logits of those that sample). If the step's forward fails, each chunk runs
        alone, so that only the requests that fail alone fail: an OOM or a model bug one request triggers must
        not end the other tabs' replies. Running a chunk again is harmless: it writes the same K/V into its
        own slots."""
        try:
            return chunks, self.runner.execute([c.plan() for c in chunks])
        except RunnerBroken:
            raise
        except Exception as exc:
            if len(chunks) == 1:
                self._fail(chunks[0].seq, exc)
                return [], None
        ran, rows = [], []
        for chunk in chunks:
            try:
                logits = self.runner.execute([chunk.plan()])
            except RunnerBroken:
                raise
            except Exception as exc:
                self._fail(chunk.seq, exc)
                continue
            ran.append(chunk)
            if logits is not None:
                rows.append(logits)
        return ran, torch.cat(rows) if rows else None

    @staticmethod
    def _rows(chunks: list[ScheduledChunk]) -> list[tuple[Sequence, list[int]]]:
        """Each sampled row: its sequence and the draft tokens before it in this step."""
        return [(c.seq, c.draft[:i]) for c in chunks for i in range(1 + len(c.draft))]

    @staticmethod
    def _replies(rows: list[tuple[Sequence, list[int]]]) -> list[list[int]] | None:
        """Each row's reply before it, for the penalties; None (nothing copied each step) when none has one."""
        if any(s.params.presence_penalty or s.params.frequency_penalty for s, _ in rows):
            return [s.completion_ids + before for s, before in rows]
        return None

    def _sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> list[int | None]:
        """One token per sampled row; a sequence whose sampling fails gets None for its rows and an error, the
        others their tokens."""
        def run(rows: list[tuple[Sequence, list[int]]], logits: torch.Tensor) -> list[int]:
            return sample(logits, [s.params for s, _ in rows], [s.generator for s, _ in rows],
                          [len(s) + len(before) for s, before in rows], self._replies(rows), self._draw_kernels)

        rows = self._rows(chunks)
        try:
            return run(rows, logits)
        except Exception:
            pass
        tokens: list[int | None] = []
        for chunk in chunks:
            mine = self._rows([chunk])
            try:
                tokens += run(mine, logits[len(tokens) : len(tokens) + len(mine)])
            except Exception as exc:
                self._fail(chunk.seq, exc)
                tokens += [None] * len(mine)
        return tokens

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        seq.error = f"The engine failed on this request: {type(exc).__name__}: {exc}"
        self._finish(seq, "error", time.monotonic())

    def _accept(self, seq: Sequence, token: int, now: float, computed: bool = False) -> None:
        """`computed`: the token's K/V is in the cache already (a kept draft token, computed by this step)."""
        seq.token_ids.append(token)
        seq.num_computed += computed
        if token in self.eos_ids:
            self._finish(seq, "stop", now)
            return
        text = seq.detok.add(token) if seq.detok is not None else ""
        shown, stopped = seq.stop_matcher.feed(text)
        self._emit(seq, shown, [token], now)
        if stopped:
            self._finish(seq, "stop", now)
        elif seq.num_completion_tokens >= seq.params.max_tokens:
            self._finish(seq, "length", now)
        elif len(seq) >= self.capacity_tokens:
            seq.finish_detail = (f"the KV cache is full ({self.capacity_tokens} tokens); raise kv_cache_mb "
                                 "(--kv-cache-mb) or shorten the conversation")
            self._finish(seq, "length", now)
        elif len(seq) >= self.max_model_len:
            seq.finish_detail = f"the reply reached {self.name}'s context length of {self.max_model_len} tokens"
            self._finish(seq, "length", now)

    def _emit(self, seq: Sequence, text: str, token_ids: list[int], now: float, final: bool = False) -> None:
        if text:
            if seq.first_text_time is None:
                seq.first_text_time = now
            else:
                seq.itl_ms.append((now - seq.last_text_time) * 1000)
            seq.last_text_time = now
        if seq.on_output is not None and (text or token_ids or final):
            try:
                seq.on_output(RequestOutput(seq.id, text, token_ids, now, final, seq.usage(now, final), seq.error))
            except Exception:  # the consumer is gone (its event loop closed, say): nobody to generate for
                seq.on_output = None
                if not final:
                    self._orphans.append(seq)

    def _end_orphans(self) -> None:
        while self._orphans:
            seq = self._orphans.pop()
            seq.cancelled = True
            self._finish(seq, "cancelled", time.monotonic())

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        if seq.status is Status.FINISHED:
            return
        # Blocks that filled up with kept draft tokens in this very step: published before they are freed, so
        # the next turn finds them as it would have without speculation.
        self.blocks.register_computed(seq)
        self.scheduler.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self._sequences.pop(seq.id, None)
        tail = seq.stop_matcher.flush() if seq.stop_matcher is not None else ""
        self._emit(seq, tail, [], now, final=True)

    def _fail_everything(self, message: str) -> None:
        """End every request the engine holds or has been sent with `message`, and start from a clean slate:
        after an error outside any one request, the scheduler's and the pool's state cannot be trusted."""
        while True:
            try:
                op, item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if op == "add":
                self._sequences[item.id] = item
            elif op == "speculate":
                self._apply_speculate(item)
        now = time.monotonic()
        for seq in list(self._sequences.values()):
            seq.status = Status.FINISHED  # directly: the scheduler that would drop it is what failed
            seq.finish_reason, seq.error = "error", message
            tail = seq.stop_matcher.flush() if seq.stop_matcher is not None else ""
            self._emit(seq, tail, [], now, final=True)
        self._sequences.clear()
        self._orphans.clear()
        self.blocks = BlockManager(self.blocks.num_blocks, self.blocks.block_size, self.config.prefix_cache)
        self.blocks.lower = self.kv_disk
        self.scheduler = Scheduler(self.blocks, self.scheduler.max_batched_tokens, self.config.max_num_seqs,
                                   self.config.batching)

    # -- the thread -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Serve submissions on an engine thread from now on. The thread ends after IDLE_EXIT_S without work
        and the next submission starts another: libgomp keeps an OpenMP pool for every live thread that ever
        ran a parallel region, and once the pools hold more threads than there are cores it stops spinning
        between regions, so each of a step's hundreds of regions waits for a futex wake (a decode step then
        costs about twice as much). An idle engine, or one of two loaded models, must not hold a pool."""
        with self._lock:
            self._started = True
            self._spawn()

    def _spawn(self) -> None:
        """With self._lock held: an engine thread, unless one runs (or the engine was not started or is closed)."""
        if self._started and self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._loop, name=f"tuichat-engine-{self.name}", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        failures = 0  # in a row: an engine that fails step after step stops instead of spinning
        idle_since = None
        while not self._closed:
            if not self.has_work():
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since >= IDLE_EXIT_S:
                    with self._lock:  # against submit: whatever it queued before this, this thread serves
                        if not self._closed and not self.has_work():
                            self._thread = None
                            return
                self._wake.wait(IDLE_EXIT_S / 2)
                self._wake.clear()
                continue
            idle_since = None
            try:
                self.step()
                failures = 0
            except RunnerBroken as exc:
                self._break(str(exc))
            except Exception as exc:
                failures += 1
                what = f"{type(exc).__name__}: {exc}"
                if failures >= 3:
                    self._break(f"The engine for {self.name} failed three steps in a row ({what}); load the model again.")
                else:
                    self._fail_everything(f"The engine hit an internal error and dropped the replies in flight: {what}")
        self._shut_down()

    def _break(self, message: str) -> None:
        """The engine cannot go on: every stream ends with `message`, and later submits fail at once with it."""
        self.broken = message
        self._fail_everything(message)

    def _shut_down(self) -> None:
        with self._lock:
            self._closed = True
        try:  # before the pool is reset below
            self.blocks.keep_all()
        except Exception:  # best effort: an engine closing must close, whatever the disk says
            pass
        self._fail_everything("The engine was shut down.")
        if hasattr(self.runner, "close"):
            self.runner.close()
        if self._draw_kernels is not None:  # the kernels' scratch outlives steps, not models (scratch.c)
            self._draw_kernels.trim()

    def close(self) -> None:
        """Stop the engine; replies in flight end with an error event. The scheduler is only ever touched by
        the engine thread: if a step is still running after the wait, that thread ends the requests itself."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        self._wake.set()
        if thread is None:
            self._shut_down()
        else:
            thread.join(timeout=30)

    # -- synchronous helper for tests and benchmarks -----------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
        """Run prompts to completion on the calling thread (the engine thread must not be running)."""
        seqs = [self.submit(p, params) for p in prompts]
        while any(s.status is not Status.FINISHED for s in seqs):
            self.step()
        return seqs

    # -- metrics ----------------------------------------------------------------------------------------------
    def tokens_per_s(self, window: float = 5.0) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._generated) if now - t <= window]  # list(): read atomically
        if not recent:
            return 0.0
        return sum(n for _, n in recent) / max(now - recent[0][0], 1e-3)

    @property
    def prefix_hit_rate(self) -> float:
        admitted = self.scheduler.admitted_prompt_tokens
        return self.scheduler.admitted_cached_tokens / admitted if admitted else 0.0
