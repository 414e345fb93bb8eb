"""The engine: scheduler + KV cache + runner + sampler, stepped on its own thread.

Callers submit token ids and get RequestOutput callbacks on the engine thread (the backend forwards them
to asyncio). Tests and benchmarks can also drive `step()` directly, with no thread, for exact control.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from tuichat.backend import BackendError, SamplingParams
from tuichat.engine import attention, cpu_kernel, families, native
from tuichat.engine.fusion import speed_up_linears
from tuichat.engine.detok import IncrementalDetokenizer, StopMatcher
from tuichat.engine.kv_cache import BlockManager, KVCache, ModelShape
from tuichat.engine.request import RequestOutput, Sequence, Status
from tuichat.engine.runner import ModelRunner, StepChunk
from tuichat.engine.sampler import make_generator, sample
from tuichat.engine.scheduler import Scheduler


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16  # small blocks: a chat's prefix hits end at most 15 tokens short
    kv_cache_mb: int | None = None  # None: 512 MiB on CPU, 40 % of free GPU memory on CUDA
    num_blocks: int | None = None  # overrides kv_cache_mb (tests use tiny pools)
    max_batched_tokens: int | None = None  # None: 512 on CPU (a chunk ~0.5 s), 8192 on CUDA
    max_num_seqs: int = 64
    batching: str = "continuous"
    prefix_cache: bool = True
    tp: int = 1  # tensor-parallel ranks; ranks 1.. are worker processes this engine starts
    fast_linears: bool = True  # fused q/k/v and gate/up, AMX or gemv kernels for decode rows (see fusion.py)


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


class Engine:
    def __init__(
        self, model, tokenizer=None, config: EngineConfig = EngineConfig(), name: str = "model", source=None
    ) -> None:
        """`source` (a catalog.ResolvedModel) lets tensor-parallel workers load their own copy of the weights."""
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.name = name
        first_param = next(model.parameters())
        self.device, self.dtype = first_param.device, first_param.dtype
        text_config = families.text_config(model.config)
        what = f"{name} ({getattr(text_config, 'model_type', 'unknown')})"
        if (why := families.unsupported(model.config)) is not None:
            raise BackendError(f"tuichat cannot run {what}: {why}.")
        self.max_model_len = getattr(text_config, "max_position_embeddings", None) or 1 << 30
        shape = ModelShape.of(model.config)
        self.attention = self._inspect_attention(model, shape, what)
        num_layers, kv_heads, head_dim = shape.layers, shape.kv_heads, shape.head_dim
        local_kv_heads = kv_heads // config.tp  # each rank caches only its own heads
        num_blocks = config.num_blocks or self._default_num_blocks(num_layers, local_kv_heads, head_dim)
        self.blocks = BlockManager(num_blocks, config.block_size, config.prefix_cache)
        layer_devices = self._layer_devices(num_layers)
        budget = config.max_batched_tokens or (8192 if self.device.type == "cuda" else 512)
        self.scheduler = Scheduler(self.blocks, budget, config.max_num_seqs, config.batching)
        self.kv = KVCache(num_layers, num_blocks, config.block_size, local_kv_heads, head_dim, self.dtype, layer_devices)
        if config.tp > 1:
            from tuichat.engine import parallel

            parallel.check_shardable(model.config, config.tp)  # before spawning anything
            workers, plan_group = parallel.start_workers(dict(
                resolved=source, device=self.device.type, dtype=str(self.dtype).removeprefix("torch."),
                world=config.tp, num_blocks=num_blocks, block_size=config.block_size, kv_heads=kv_heads,
                head_dim=head_dim, num_layers=num_layers,
            ))
            parallel.shard_model(model, 0, config.tp)
            self.runner = parallel.TensorParallelRunner(
                model, self.kv, config.block_size, self.device, workers, plan_group
            )
        else:
            self.runner = ModelRunner(model, self.kv, config.block_size, self.device)
        # Which kernels short steps use, for the stats panel and the bench.
        self.matmul = "torch"
        self.layers = "transformers"
        if config.fast_linears:  # after sharding: the fused weights are the rank's slices
            kernel = None
            if self.device.type == "cpu" and self.dtype is torch.bfloat16:
                kernel, self.matmul = cpu_kernel.load()
            # transformers' layers take our linear only where it beat torch's at every row count measured:
            # AMX (without it, ours lost to oneDNN on 512-row prefills; see README).
            speed_up_linears(model, kernel if kernel is not None and kernel.isa == "amx" else None)
            if kernel is not None and config.tp == 1:
                why_not = native.unsupported_reason(model, kernel, self.attention)
                if why_not is None:
                    try:
                        self.runner.native = native.NativeDecoder(model, self.kv, config.block_size, kernel)
                        self.layers = "C"
                    except ValueError as exc:
                        why_not = str(exc)
                if why_not is not None:
                    self.layers = f"transformers ({why_not})"
        self._check_serving_path(what)
        self.eos_ids = eos_token_ids(model, tokenizer)
        self._sequences: dict[int, Sequence] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # submissions and cancels from other threads
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        # Metrics.
        self.last_batch_size = 0
        self._generated: deque[tuple[float, int]] = deque()

    @staticmethod
    def _inspect_attention(model, shape: ModelShape, what: str) -> attention.ModelAttention:
        """Switch the model to paged attention and learn each layer's kind; refuse what we cannot run exactly."""
        try:
            model.set_attn_implementation(attention.register())
            found = attention.inspect(model, shape.layers)
        except (attention.UnsupportedAttention, ValueError) as exc:
            raise BackendError(f"tuichat cannot run {what} faithfully: {exc}.") from None
        if (found.heads, found.kv_heads, found.head_dim) != (shape.heads, shape.kv_heads, shape.head_dim):
            raise BackendError(
                f"tuichat cannot run {what} faithfully: its attention runs {found.heads} heads over {found.kv_heads} "
                f"KV heads of size {found.head_dim}, but its config says {shape.heads} over {shape.kv_heads} of "
                f"{shape.head_dim}."
            )
        return found

    def _check_serving_path(self, what: str) -> None:
        """The probe's tokens once more, through the path that will serve them: a prefill chunk, a chunk that
        reads it back from the cache, a decode. The last logits must be the probe's plain forward's. This is
        where what attention cannot show surfaces: state kept outside the KV cache (a recurrent or state-space
        layer beside attention) would make the pieces disagree with the whole."""
        ids = self.attention.token_ids
        table = list(range(self.blocks.blocks_for(len(ids))))
        if len(table) > self.blocks.num_blocks:
            return  # a pool this small is a test's; nothing is served from it anyway
        cuts = [0, len(ids) - 3, len(ids) - 1, len(ids)]
        for a, b in zip(cuts, cuts[1:]):
            logits = self.runner.execute([StepChunk(ids[a:b], a, table, b == len(ids))])
        want = self.attention.logits.to(logits.device)
        error = float((logits[0] - want).abs().max() / want.abs().max().clamp_min(1e-6))
        # Rounding alone: float32 differs in the last bits (~1e-6); bf16 steps by ~1 % of the range.
        if error > (1e-4 if self.dtype is torch.float32 else 0.05):
            raise BackendError(
                f"tuichat cannot run {what} faithfully: served in pieces through its KV cache, it does not reproduce "
                f"its own plain forward (off by {error:.0%} of the logit range). It may keep state outside attention."
            )

    # -- sizing -------------------------------------------------------------------------------------------
    def _default_num_blocks(self, num_layers: int, kv_heads: int, head_dim: int) -> int:
        per_block = KVCache.bytes_per_block(num_layers, self.config.block_size, kv_heads, head_dim, self.dtype)
        if self.config.kv_cache_mb is not None:
            budget = self.config.kv_cache_mb * 2**20
        elif self.device.type == "cuda":
            budget = int(torch.cuda.mem_get_info(self.device)[0] * 0.4)
        else:
            budget = 512 * 2**20
        return max(1, budget // per_block)

    def _layer_devices(self, num_layers: int) -> list[torch.device]:
        """Each layer's KV lives where its weights are (accelerate device maps spread layers over GPUs)."""
        device_map = getattr(self.model, "hf_device_map", None) or {}
        devices = []
        for i in range(num_layers):
            where = next((d for name, d in device_map.items() if name.endswith(f"layers.{i}")), None)
            devices.append(torch.device(f"cuda:{where}" if isinstance(where, int) else (where or self.device)))
        return devices

    @property
    def capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.blocks.block_size

    # -- public API (thread-safe) ---------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int]) -> None:
        """Raise BackendError for a prompt that can never run, before anything is queued."""
        if not prompt_ids:
            raise BackendError("The prompt is empty.")
        if len(prompt_ids) >= self.max_model_len:
            raise BackendError(
                f"The prompt is {len(prompt_ids)} tokens long; {self.name} takes at most {self.max_model_len - 1}."
            )
        if len(prompt_ids) + 1 > self.capacity_tokens:
            raise BackendError(
                f"The prompt is {len(prompt_ids)} tokens long, but the whole KV cache holds {self.capacity_tokens}. "
                "Raise the engine's kv_cache_mb or start a new conversation."
            )

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, on_output: Callable[[RequestOutput], None] | None = None
    ) -> Sequence:
        self.validate(prompt_ids)
        seq = Sequence(list(prompt_ids), params, on_output)
        self._inbox.put(("add", seq))
        self._wake.set()
        return seq

    def cancel(self, request_id: int) -> None:
        self._inbox.put(("cancel", request_id))
        self._wake.set()

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
                item.generator = make_generator(item.params, self.device)
                if self.tokenizer is not None:
                    item.detok = IncrementalDetokenizer(self.tokenizer, item.token_ids)
                item.stop_matcher = StopMatcher(item.params.stop)
                self._sequences[item.id] = item
                self.scheduler.add(item)
            elif (seq := self._sequences.get(item)) is not None:
                seq.cancelled = True
                self._finish(seq, "cancelled", time.monotonic())

    def step(self) -> None:
        """One scheduling round and one model forward."""
        self._drain_inbox()
        chunks = self.scheduler.schedule()
        if not chunks:
            return
        self.last_batch_size = len(chunks)
        try:
            logits = self.runner.execute([c.plan() for c in chunks])
        except Exception as exc:  # an OOM or a model bug must not take the other tabs' engine down for good
            now = time.monotonic()
            for chunk in chunks:
                chunk.seq.error = f"The engine failed on this request: {type(exc).__name__}: {exc}"
                self._finish(chunk.seq, "error", now)
            return
        for chunk in chunks:
            chunk.seq.num_computed = chunk.start + chunk.length
            self.blocks.register_computed(chunk.seq)
        sampling = [c for c in chunks if c.samples]
        if not sampling:
            return
        tokens = sample(logits, [c.seq.params for c in sampling], [c.seq.generator for c in sampling])
        now = time.monotonic()
        self._generated.append((now, len(tokens)))
        while now - self._generated[0][0] > 10.0:
            self._generated.popleft()
        for chunk, token in zip(sampling, tokens):
            self._accept(chunk.seq, token, now)

    def _accept(self, seq: Sequence, token: int, now: float) -> None:
        seq.token_ids.append(token)
        if token in self.eos_ids:
            self._finish(seq, "stop", now)
            return
        text = seq.detok.add(token) if seq.detok is not None else ""
        shown, stopped = seq.stop_matcher.feed(text)
        self._emit(seq, shown, [token], now)
        if stopped:
            self._finish(seq, "stop", now)
        elif seq.num_completion_tokens >= seq.params.max_tokens or len(seq) >= min(
            self.max_model_len, self.capacity_tokens
        ):
            self._finish(seq, "length", now)

    def _emit(self, seq: Sequence, text: str, token_ids: list[int], now: float, final: bool = False) -> None:
        if text:
            if seq.first_text_time is None:
                seq.first_text_time = now
            else:
                seq.itl_ms.append((now - seq.last_text_time) * 1000)
            seq.last_text_time = now
        if seq.on_output is not None and (text or token_ids or final):
            seq.on_output(
                RequestOutput(seq.id, text, token_ids, now, final, seq.usage(now, final), seq.error)
            )

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        if seq.status is Status.FINISHED:
            return
        self.scheduler.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self._sequences.pop(seq.id, None)
        tail = seq.stop_matcher.flush() if seq.stop_matcher is not None else ""
        self._emit(seq, tail, [], now, final=True)

    # -- the thread -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"tuichat-engine-{self.name}", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._closed:
            if not self.has_work():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            self.step()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for seq in list(self._sequences.values()):
            seq.error = "The engine was shut down."
            self._finish(seq, "error", time.monotonic())
        if hasattr(self.runner, "close"):
            self.runner.close()

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
