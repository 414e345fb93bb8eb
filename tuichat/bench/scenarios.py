"""The scenarios, each on fresh engines, and the run that chains them (each can be picked with `--scenarios`):

- single         one conversation: TTFT, ITL, decode tok/s; plus a bare transformers forward over the same
                 prompt tokens, so the engine's overhead shows as a ratio (the prefix cache is off here, so the
                 engine computes every prompt token, like the bare forward).
- prefill        one prompt of ~1k tokens (the pasted document, repeated), its first token only, prefix cache off:
                 TTFT and prompt tokens per second, against llama.cpp's on the same ids.
- tabs           N conversations arriving `stagger_ms` apart, natural reply lengths (EOS on, capped), once per
                 batching mode (continuous, static, off).
- multiturn      one conversation of K turns about a pasted text, history growing with the model's real replies;
                 prefix cache on. Cache off replays the very same conversation (the cache-on replies as history)
                 and stops each turn after a few tokens: only its TTFT is compared.
- shared_prefix  N tabs with one long system prompt, arriving `stagger_ms` apart: first-turn TTFT, cache on/off.
- interference   TTFT of a new conversation while N-1 others decode, against its TTFT on an idle engine (prefix
                 cache off in this scenario, so both probes compute the whole prompt).

Threads: every bit of bench torch work (loading the transformers model, its forwards, the bandwidth sum) runs
on a thread that ends with it, never on the main thread, and not while an engine thread lives (see
on_own_thread).
"""

from __future__ import annotations

import asyncio
import functools
import os
import platform
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TextIO

from tuichat.backends.local import chat_ids, resolve
from tuichat.backends.protocol import Message, SamplingParams, TuichatError, chat_sampling
from tuichat.bench.corpus import (
    DOCUMENT,
    FIRST_TURN,
    FOLLOW_UPS,
    GROUNDED_PROMPTS,
    LONG_REPLY_PROMPTS,
    OPEN_PROMPTS,
    PROBE_QUESTION,
    QUESTIONS,
    SHARED_PREFIX_QUESTIONS,
    SINGLE_QUESTIONS,
    SYSTEM_PROMPT,
    WARMUP_QUESTION,
)
from tuichat.bench.floor import BandwidthProbe, measure_bandwidth, step_floor
from tuichat.bench.peers.hf import HFPeer
from tuichat.bench.peers.llama_server import LlamaServerPeer, find_llama_server
from tuichat.bench.peers.serve import ServePeer
from tuichat.bench.peers.tuichat import _Tuichat, run_tabs, stream_once
from tuichat.bench.progress import Progress
from tuichat.bench.report import targets
from tuichat.bench.settings import MODES, SCENARIOS, BenchSettings, plan
from tuichat.bench.stats import RequestResult, median, percentile, ratio, summarize

ENGINE_THREAD = "tuichat-engine-"  # how Engine.start names its threads


def on_own_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) on a thread that ends with it. libgomp keeps an OpenMP pool for every live thread that ever ran
    a torch parallel region, and once the pools hold more threads than there are cores it stops spinning between
    regions: each of a step's regions then waits for a futex wake, and a lasting pool beside the engine thread's
    slows every tuichat step (docs/design/kernels.md, "One OpenMP pool"). That, not the main thread as such, is why torch once
    seemed slower from the main thread. So no bench torch work runs on the main thread or on a thread that
    outlives it, nor while an engine thread lives (an idle one ends after IDLE_EXIT_S): at most one pool is
    alive, for tuichat and its peers alike."""
    deadline = time.monotonic() + 30
    while any(t.name.startswith(ENGINE_THREAD) for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    thread = ThreadPoolExecutor(1, thread_name_prefix="tuichat-bench-torch")
    try:
        return thread.submit(fn, *args).result()
    finally:
        thread.shutdown(wait=True)


class _Run:
    def __init__(self, settings: BenchSettings, progress: Progress) -> None:
        import torch

        from tuichat.engine import loader

        self.settings = settings
        self.progress = progress
        self.resolved = resolve(settings.model)
        self.device = loader.resolve_device(settings.options.device)
        # The family decides, as in LocalBackend: the peers run in the dtype tuichat runs.
        self.dtype = loader.resolve_dtype(settings.options.dtype, self.device, loader.family(self.resolved),
                                          self.resolved.kind == "gguf")
        self.torch = torch
        # A GGUF tuichat serves from its file, with no transformers peer asked for (`--peers llama_cpp`): the
        # tokenizer, floor and bare forward come from transformers' layers over the same blocks, with no converted
        # bf16 copy (a minute and gigabytes at 1B). The transformers peers themselves run the converted model.
        o = settings.options
        self.mapped = (loader.in_place(self.resolved, self.device, self.dtype, o.quant, o.tp, o.device_map)
                       and not any(peer.startswith("hf_") for peer in settings.peers))
        self.peer: HFPeer | None = None
        self.bandwidth: float | None = None
        self.llama: LlamaServerPeer | None = None
        self.serve: ServePeer | None = None
        self.llama_skip: str | None = None
        self.latest: _Tuichat | None = None

    # helpers
    def step(self, label: str):
        return self.progress.step(label)

    def tuichat(self, **changes: Any) -> _Tuichat:
        self.latest = _Tuichat(self.settings, **changes)  # its kernels go into the report's machine facts
        return self.latest

    def wants(self, peer: str) -> bool:
        return peer in self.settings.peers

    def with_llama(self, work: Callable[[LlamaServerPeer], dict[str, Any]]) -> dict[str, Any]:
        """work(the llama-server peer), or {"skipped": why}: a missing or failing server must not end the bench.
        The server starts once, at the first llama.cpp step, and run_bench stops it whatever happens."""
        s = self.settings
        if self.llama is None and self.llama_skip is None:
            binary, self.llama_skip = find_llama_server(s.llama_server, self.resolved)
            if binary is not None:
                try:
                    self.llama = LlamaServerPeer(binary, self.resolved.source, self.torch.get_num_threads(), s.tabs,
                                                 s.llama_slot_ctx, self.ids([Message("user", WARMUP_QUESTION)]),
                                                 gpu=self.device.type == "cuda")
                except (TuichatError, OSError) as exc:
                    self.llama_skip = f"llama-server did not start: {exc}"
        if self.llama is None:
            return {"skipped": self.llama_skip}
        try:
            return work(self.llama)
        except (TuichatError, OSError, KeyError, ValueError) as exc:
            return {"skipped": f"llama-server failed: {exc}"}

    def with_serve(self, work: Callable[[ServePeer], dict[str, Any]]) -> dict[str, Any]:
        """work(`tuichat serve` on the same model and options), or {"skipped": why}; started once, always stopped."""
        try:
            if self.serve is None:
                self.serve = ServePeer(self.settings.model, self.settings.engine_options(),
                                       [Message("user", WARMUP_QUESTION)], self.settings.tabs)
            return work(self.serve)
        except (TuichatError, OSError, KeyError, ValueError) as exc:
            return {"skipped": f"tuichat serve failed: {exc}"}

    def ids(self, messages: Sequence[Message]) -> list[int]:
        return chat_ids(self.peer.tokenizer, messages)

    # sections
    def floor(self) -> dict[str, Any]:
        """The bandwidth, and the floor of transformers' dense weights; tuichat's is added by tuichat_floor."""
        with self.step("floor: weights and memory bandwidth"):
            self.peer = on_own_thread(HFPeer, self.resolved, self.device, self.dtype, self.settings.options.device_map,
                                      self.settings.options.max_batched_tokens, self.mapped)
            self.bandwidth = on_own_thread(measure_bandwidth, self.device, self.settings.bandwidth_mb)
        return {
            "bandwidth_gb_s": self.bandwidth / 1e9,
            "tuichat": None,
            "transformers": step_floor("the file's blocks" if self.mapped else str(self.dtype).removeprefix("torch."),
                                       self.peer.weight_bytes(), self.bandwidth),
            "note": "weights read once per decode step at the measured bandwidth; KV reads and compute not counted",
        }

    def tuichat_floor(self) -> dict[str, Any] | None:
        """The floor of the bytes a tuichat decode step really reads (quantized or not), once an engine ran."""
        if self.latest is None or self.bandwidth is None:
            return None
        return step_floor(self.latest.weights, self.latest.weight_bytes, self.bandwidth)

    def single(self) -> dict[str, Any]:
        s = self.settings
        questions = [SINGLE_QUESTIONS[i % len(SINGLE_QUESTIONS)] for i in range(max(1, s.single_prompts))]
        conversations = [[Message("user", q)] for q in questions]
        params = SamplingParams(max_tokens=s.single_tokens)
        prompts = [self.ids(m) for m in conversations]
        ours, sampled, bare, hf, bandwidth = [], [], [], [], []
        # Interleaved per prompt (tuichat, bare forward, generate), so a noisy neighbour hits all three alike.
        # Speculation off: TPOT stays one step's cost (the floor's target), and llama.cpp runs without its own;
        # the speculative scenario measures what it adds. Every comparison is greedy; the same prompts with the
        # sampling a chat gets by default are timed too: what a user sees, and where a slow sampler would show.
        with self.step("single · tuichat, bare forward, hf_generate"), \
                self.tuichat(batching="continuous", prefix_cache=False, speculate="off") as tc:
            chat = chat_sampling(tc.backend.sampling_defaults(tc.name), {"max_tokens": s.single_tokens, "seed": 0})
            probe = on_own_thread(BandwidthProbe, self.device, s.bandwidth_mb)
            for i, (messages, prompt) in enumerate(zip(conversations, prompts)):
                bandwidth.append(on_own_thread(probe.sample))
                ours.append(tc.run(stream_once, f"single-{i}", messages, params))
                sampled.append(tc.run(stream_once, f"single-sampled-{i}", messages, chat))
                bandwidth.append(on_own_thread(probe.sample))  # after both: on_own_thread waits for the engine thread
                bare.append(on_own_thread(self.peer.bare_forward_ms, prompt))
                if self.wants("hf_generate"):
                    hf.append(on_own_thread(self.peer.generate, prompt, s.single_tokens))
        out: dict[str, Any] = {
            "prompts": len(prompts),
            "prompt_tokens": [r.prompt_tokens for r in ours],
            "max_tokens": s.single_tokens,
            "prefix_cache": False,
            "speculate": "off",
            "tuichat": self._single_summary(ours),
            "tuichat_sampled": {**self._single_summary(sampled),
                                "sampling": {k: getattr(chat, k) for k in ("temperature", "top_p", "top_k",
                                                                            "frequency_penalty", "presence_penalty")}},
            "bare_forward_ms": median(bare),
            "bare_forward_ms_each": bare,
            "peers": {},
        }
        out["ttft_over_bare_forward"] = ratio(out["tuichat"]["ttft_ms"], out["bare_forward_ms"])
        # The floor at the bandwidth measured just before and after each prompt's requests (their median).
        during = median(bandwidth)
        out["floor_during"] = {"bandwidth_gb_s": during / 1e9, "samples": len(bandwidth),
                               "samples_gb_s": [b / 1e9 for b in bandwidth],
                               **step_floor(tc.weights, tc.weight_bytes, during),
                               "at_best_bandwidth_ms": step_floor(tc.weights, tc.weight_bytes, self.bandwidth)["decode_step_ms"]}
        if hf:
            out["peers"]["hf_generate"] = self._single_summary(hf)
        if self.wants("llama_cpp"):
            with self.step("single · llama_cpp"):  # cache_prompt off: it computes every prompt token, as tuichat does here
                out["peers"]["llama_cpp"] = self.with_llama(
                    lambda llama: self._single_summary([llama.generate(p, s.single_tokens) for p in prompts]))
        return out

    def prefill(self) -> dict[str, Any]:
        s = self.settings
        sentences = [f"{sentence.strip()}." for sentence in DOCUMENT.split(".") if sentence.strip()]
        text, i = "Read this text, then say in one word what it is about.\n\n", 0
        while len(self.ids([Message("user", text)])) < s.prefill_tokens:
            text += sentences[i % len(sentences)] + " "
            i += 1
        messages = [Message("user", text)]
        prompt = self.ids(messages)
        params = SamplingParams(max_tokens=1)
        with self.step("prefill · tuichat"), \
                self.tuichat(batching="continuous", prefix_cache=False, speculate="off") as tc:
            ours = [tc.run(stream_once, f"prefill-{i}", messages, params) for i in range(s.prefill_repeats)]
        out: dict[str, Any] = {"prompt_tokens": len(prompt), "repeats": s.prefill_repeats, "prefix_cache": False,
                               "tuichat": self._prefill_summary(ours, len(prompt)), "peers": {}}
        if self.wants("llama_cpp"):
            with self.step("prefill · llama_cpp"):  # cache_prompt off: every prompt token computed
                out["peers"]["llama_cpp"] = self.with_llama(lambda llama: self._prefill_summary(
                    [llama.generate(prompt, 1) for _ in range(s.prefill_repeats)], len(prompt)))
        return out

    @staticmethod
    def _prefill_summary(results: Sequence[RequestResult], tokens: int) -> dict[str, Any]:
        ttft = median([r.ttft_ms for r in results])
        return {"ttft_ms": ttft, "ttft_ms_each": [r.ttft_ms for r in results],
                "prompt_tokens_per_s": tokens / ttft * 1000 if ttft else None}

    @staticmethod
    def _single_summary(results: Sequence[RequestResult]) -> dict[str, Any]:
        itls = [gap for r in results for gap in r.itl_ms]
        return {
            "ttft_ms": median([r.ttft_ms for r in results]),
            "ttft_ms_each": [r.ttft_ms for r in results],
            "itl_ms_p50": percentile(itls, 0.5),
            "itl_ms_p90": percentile(itls, 0.9),
            "tpot_ms": median([r.tpot_ms for r in results]),
            "decode_tokens_per_s": median([r.decode_tokens_per_s for r in results]),
            "output_tokens": [r.tokens for r in results],
            "replies": [r.text for r in results],
        }

    def tabs(self) -> dict[str, Any]:
        s = self.settings
        conversations = [[Message("user", QUESTIONS[i % len(QUESTIONS)])] for i in range(s.tabs)]
        params = SamplingParams(max_tokens=s.tab_tokens)
        stagger = s.stagger_ms / 1000
        modes: dict[str, Any] = {}
        for mode in MODES:
            with self.step(f"tabs · tuichat {mode}"), self.tuichat(batching=mode, prefix_cache=True) as tc:
                results, wall = tc.run(run_tabs, conversations, params, stagger, f"tabs-{mode}")
            modes[mode] = summarize(results, wall)
        prompts = [self.ids(m) for m in conversations]
        sequential = prompts[: max(1, s.sequential_peer_prompts)]
        peers: dict[str, Any] = {}
        for name in s.peers:
            with self.step(f"tabs · {name}"):
                if name == "hf_generate":
                    start = time.perf_counter()
                    results = [on_own_thread(self.peer.generate, p, s.tab_tokens) for p in sequential]
                    peers[name] = summarize(results, time.perf_counter() - start)
                    peers[name]["note"] = (f"one request at a time, over the first {len(sequential)} prompts (its "
                                           "tok/s does not depend on how many wait); TTFT from each request's start")
                elif name == "hf_static_batch":
                    peers[name] = summarize(*on_own_thread(functools.partial(self.peer.static_batch, stagger_s=stagger), prompts, s.tab_tokens))
                elif name == "hf_generate_batch":
                    peers[name] = summarize(*on_own_thread(functools.partial(self.peer.generate_batch, stagger_s=stagger), prompts, s.tab_tokens))
                elif name == "llama_cpp":
                    peers[name] = self.with_llama(lambda llama: {
                        **summarize(*llama.tabs(prompts, s.tab_tokens, stagger)),
                        "note": f"llama-server with {s.tabs} parallel slots, each tab on its own connection"})
                elif name == "tuichat_serve":
                    peers[name] = self.with_serve(lambda serve: {
                        **summarize(*serve.tabs(conversations, s.tab_tokens, stagger)),
                        "note": "the same engine behind tuichat serve, each tab an HTTP client on its own connection"})
        ours = modes["continuous"]
        for peer in list(modes.values()) + list(peers.values()):
            peer["tuichat_over"] = ratio(ours["tokens_per_s"], peer.get("tokens_per_s"))
        return {
            "tabs": s.tabs,
            "stagger_ms": s.stagger_ms,
            "max_tokens": s.tab_tokens,
            "tuichat": dict(ours),
            "modes": modes,
            "peers": peers,
        }

    def multiturn(self) -> dict[str, Any]:
        s = self.settings
        users = [FIRST_TURN] + [FOLLOW_UPS[i % len(FOLLOW_UPS)] for i in range(s.turns - 1)]
        params = SamplingParams(max_tokens=s.turn_tokens)

        async def converse(backend) -> tuple[list[RequestResult], list[Message]]:
            history: list[Message] = []
            results = []
            for user in users:
                history.append(Message("user", user))
                result = await stream_once(backend, "multiturn", list(history), params)
                results.append(result)
                history.append(Message("assistant", result.text))
            return results, history

        async def replay(backend, history: list[Message]) -> list[RequestResult]:
            probe = SamplingParams(max_tokens=s.probe_tokens)
            return [await stream_once(backend, "multiturn", history[: 2 * k + 1], probe) for k in range(len(users))]

        with self.step("multiturn · cache on"), self.tuichat(batching="continuous", prefix_cache=True) as tc:
            on, history = tc.run(converse)
        with self.step("multiturn · cache off"), self.tuichat(batching="continuous", prefix_cache=False) as tc:
            off = tc.run(replay, history)

        def side(results: list[RequestResult]) -> dict[str, Any]:
            return {
                "ttft_ms": [r.ttft_ms for r in results],
                "cached_fraction": [r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0.0 for r in results],
                "prompt_tokens": [r.prompt_tokens for r in results],
                "cached_tokens": [r.cached_tokens for r in results],
            }

        out: dict[str, Any] = {
            "turns": s.turns,
            "max_tokens": s.turn_tokens,
            "cache_on": side(on),
            "cache_off": side(off),
            "reply_tokens": [r.tokens for r in on],
            "history_tokens": on[-1].prompt_tokens + on[-1].tokens if on else 0,
            "peers": {},
        }
        on_ttft, off_ttft = out["cache_on"]["ttft_ms"], out["cache_off"]["ttft_ms"]
        out["last_over_first_cache_on"] = ratio(on_ttft[-1], on_ttft[0])
        # Turn 1 carries the pasted text; turn 2 on are all served from the cache: their trend is the flatness.
        out["last_over_second_cache_on"] = ratio(on_ttft[-1], on_ttft[1]) if len(on_ttft) > 1 else None
        out["off_over_on_last_turn"] = ratio(off_ttft[-1], on_ttft[-1])
        prompts = [self.ids(history[: 2 * k + 1]) for k in range(len(users))]
        if self.wants("hf_generate") and s.multiturn_peer:
            with self.step("multiturn · hf_generate"):
                results = [on_own_thread(self.peer.generate, p, 1) for p in prompts]
            out["peers"]["hf_generate"] = {
                "ttft_ms": [r.ttft_ms for r in results],
                "note": "transformers generate keeps no KV between calls: every turn computes the whole history",
            }
        if self.wants("llama_cpp"):
            with self.step("multiturn · llama_cpp"):
                out["peers"]["llama_cpp"] = self.with_llama(lambda llama: self._llama_multiturn(llama, history, prompts))
        return out

    def _llama_multiturn(self, llama: LlamaServerPeer, history: list[Message], prompts: list[list[int]]) -> dict[str, Any]:
        """The same history, turn by turn, in one slot with its prompt cache on: TTFT per turn. After each turn
        the slot gets the history up to the next question (tuichat's reply included) without generating, so it
        holds what it would after writing that reply itself, as tuichat's cache does."""
        results = []
        for k, prompt in enumerate(prompts):
            results.append(llama.generate(prompt, self.settings.probe_tokens, cache_prompt=True, slot=0))
            if k + 1 < len(prompts):
                llama.prefill(os.path.commonprefix([self.ids(history[: 2 * k + 2]), prompts[k + 1]]), slot=0)
        return {
            "ttft_ms": [r.ttft_ms for r in results],
            "cached_fraction": [r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0.0 for r in results],
            "prompt_tokens": [r.prompt_tokens for r in results],
            "note": "one llama-server slot with cache_prompt on; each turn's reply put in its cache untimed",
        }

    def shared_prefix(self) -> dict[str, Any]:
        s = self.settings
        conversations = [
            [Message("system", SYSTEM_PROMPT), Message("user", SHARED_PREFIX_QUESTIONS[i % len(SHARED_PREFIX_QUESTIONS)])]
            for i in range(s.tabs)
        ]
        params = SamplingParams(max_tokens=s.probe_tokens)
        out: dict[str, Any] = {"tabs": s.tabs, "stagger_ms": s.stagger_ms, "max_tokens": s.probe_tokens}
        for label, cache in (("cache_on", True), ("cache_off", False)):
            with self.step(f"shared_prefix · {label.replace('_', ' ')}"), \
                    self.tuichat(batching="continuous", prefix_cache=cache) as tc:
                results, wall = tc.run(run_tabs, conversations, params, s.stagger_ms / 1000, f"shared-{label}")
            ttfts = [r.ttft_ms for r in results]
            out[label] = {
                "ttft_ms": ttfts,
                "ttft_ms_p50": percentile(ttfts, 0.5),
                "ttft_ms_p90": percentile(ttfts, 0.9),
                "cached_fraction": [r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0.0 for r in results],
                "prompt_tokens": [r.prompt_tokens for r in results],
            }
        out["off_over_on_p50"] = ratio(out["cache_off"]["ttft_ms_p50"], out["cache_on"]["ttft_ms_p50"])
        return out

    def interference(self) -> dict[str, Any]:
        s = self.settings
        probe = [Message("user", PROBE_QUESTION)]
        probe_params = SamplingParams(max_tokens=s.probe_tokens)
        background = [[Message("user", LONG_REPLY_PROMPTS[i % len(LONG_REPLY_PROMPTS)])] for i in range(s.tabs - 1)]
        long_params = SamplingParams(max_tokens=4096)

        async def measure(backend) -> dict[str, Any]:
            idle = [await stream_once(backend, f"idle-{i}", probe, probe_params) for i in range(s.probes)]
            started = [asyncio.Event() for _ in background]

            async def talk(i: int, messages) -> RequestResult:
                result = RequestResult(submitted=time.perf_counter())
                async for event in backend.stream(f"bg-{i}", messages, long_params):
                    if event.text:
                        started[i].set()
                    if event.finished:
                        started[i].set()
                        result.tokens = event.usage.completion_tokens
                return result

            tasks = [asyncio.create_task(talk(i, m)) for i, m in enumerate(background)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=300)
            loaded, decoding = [], []
            for i in range(s.probes):
                decoding.append(backend.stats().running)
                loaded.append(await stream_once(backend, f"loaded-{i}", probe, probe_params))
            for i in range(len(background)):
                backend.cancel(f"bg-{i}")
            finished = await asyncio.gather(*tasks)
            return {
                "idle_ttft_ms": median([r.ttft_ms for r in idle]),
                "loaded_ttft_ms": median([r.ttft_ms for r in loaded]),
                "idle_ttft_ms_each": [r.ttft_ms for r in idle],
                "loaded_ttft_ms_each": [r.ttft_ms for r in loaded],
                "decoding_at_submit": decoding,
                "background_tokens": [r.tokens for r in finished],
                "prompt_tokens": idle[0].prompt_tokens if idle else 0,
            }

        with self.step("interference · idle and loaded"), self.tuichat(batching="continuous", prefix_cache=False) as tc:
            out = tc.run(measure)
        out["tabs"] = s.tabs
        out["loaded_over_idle"] = ratio(out["loaded_ttft_ms"], out["idle_ttft_ms"])
        return out

    def speculative(self) -> dict[str, Any]:
        """Speculation off and auto on prompts that quote themselves and on open-ended ones, one stream at a time
        and as tabs: decode tok/s, what auto gains, and whether every reply is the same. Both modes run on one
        engine, switched request by request (each prompt's pair, then each kind's tabs, in alternating order),
        so that what the host does meanwhile falls on both alike; without the prefix cache, so that neither of a
        pair finds the other's prompt computed."""
        s = self.settings
        params = SamplingParams(max_tokens=s.spec_tokens)
        stagger = s.stagger_ms / 1000
        kinds = {"grounded": GROUNDED_PROMPTS, "open": OPEN_PROMPTS}
        modes = ("off", "auto")
        out: dict[str, Any] = {"max_tokens": s.spec_tokens, "tabs": s.tabs, "modes": {m: {} for m in modes}}
        runs: dict[tuple[str, str], dict[str, list[RequestResult]]] = {}
        with self.step("speculative · off and auto"), self.tuichat(speculate="auto", prefix_cache=False) as tc:

            def run(mode: str, fn, *args):
                tc.backend.set_speculate(tc.name, mode)
                return tc.run(fn, *args)

            for k, (kind, prompts) in enumerate(kinds.items()):
                for mode in modes:
                    runs[mode, kind] = {"single": [], "tabs": []}
                for i, p in enumerate(prompts):
                    for mode in modes if i % 2 == 0 else modes[::-1]:
                        runs[mode, kind]["single"].append(run(mode, stream_once, f"spec-{mode}-{kind}-{i}", [Message("user", p)], params))
                conversations = [[Message("user", prompts[i % len(prompts)])] for i in range(s.tabs)]
                for mode in modes if k % 2 == 0 else modes[::-1]:
                    tabs, wall = run(mode, run_tabs, conversations, params, stagger, f"spec-tabs-{mode}-{kind}")
                    runs[mode, kind]["tabs"] = tabs
                    out["modes"][mode][kind] = {"single": self._single_summary(runs[mode, kind]["single"]),
                                                "tabs": summarize(tabs, wall)}
        for mode in modes:
            replies = [r for kind in kinds for r in runs[mode, kind]["single"] + runs[mode, kind]["tabs"]]
            out["modes"][mode]["acceptance"] = ratio(sum(r.accepted_tokens for r in replies), sum(r.draft_tokens for r in replies))
            out["modes"][mode]["tokens_per_step"] = ratio(sum(r.tokens for r in replies), sum(r.steps for r in replies))
        off, auto = out["modes"]["off"], out["modes"]["auto"]
        for kind in kinds:
            out[f"{kind}_single_auto_over_off"] = ratio(auto[kind]["single"]["decode_tokens_per_s"],
                                                       off[kind]["single"]["decode_tokens_per_s"])
            out[f"{kind}_tabs_auto_over_off"] = ratio(auto[kind]["tabs"]["tokens_per_s"], off[kind]["tabs"]["tokens_per_s"])
            # A tab's own decode rate (its meter's, 1000 / its TPOT, the median tab's): with tabs that arrive
            # apart and overlap little, the aggregate measures the arrivals and this what speculation gave each.
            out[f"{kind}_tab_decode_auto_over_off"] = ratio(off[kind]["tabs"]["tpot_ms_p50"], auto[kind]["tabs"]["tpot_ms_p50"])
        out["same_replies"] = all([r.text for r in runs["auto", kind][part]] == [r.text for r in runs["off", kind][part]]
                                  for kind in kinds for part in ("single", "tabs"))
        return out

    def close(self) -> None:
        try:
            for server in (self.llama, self.serve):
                if server is not None:
                    server.close()
        finally:
            if self.peer is not None:
                self.peer.close()


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((l.partition(":")[2].strip() for l in text.splitlines() if l.startswith("model name")), "")


def _versions() -> dict[str, str]:
    import torch
    import transformers

    versions = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        from importlib.metadata import version

        versions["tuichat"] = version("tuichat")
    except Exception:
        pass
    return versions


def run_bench(settings: BenchSettings, progress_stream: TextIO | None = None, show_progress: bool = True) -> dict[str, Any]:
    """Run the selected scenarios and return one JSON-ready dict."""
    import torch
    from transformers.utils import logging as hf_logging

    progress = Progress(len(plan(settings)), progress_stream, show_progress)
    bars_were_on = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()  # "Loading weights" bars would tear our own progress line
    hf_logging.set_verbosity_error()
    started = time.perf_counter()
    run = _Run(settings, progress)
    try:
        result: dict[str, Any] = {
            "model": run.resolved.name,
            "device": str(run.device),
            "dtype": str(run.dtype).removeprefix("torch."),
            "quick": settings.quick,
            "quant": settings.engine_options().quant,
            "settings": {
                "scenarios": list(settings.scenarios), "peers": list(settings.peers), "tabs": settings.tabs,
                "turns": settings.turns, "single_tokens": settings.single_tokens, "tab_tokens": settings.tab_tokens,
                "turn_tokens": settings.turn_tokens, "probe_tokens": settings.probe_tokens,
                "stagger_ms": settings.stagger_ms, "kv_cache_mb": settings.engine_options().kv_cache_mb,
            },
            "machine": {"platform": platform.platform(), "cpu": _cpu_model(), "cpus": os.cpu_count(),
                        "torch_threads": torch.get_num_threads(),
                        "gpu": torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else None},
            "versions": _versions(),
        }
        result["floor"] = run.floor()
        result["scenarios"] = {}
        for name in SCENARIOS:
            if name in settings.scenarios:
                t0 = time.perf_counter()
                result["scenarios"][name] = getattr(run, name)()
                result["scenarios"][name]["scenario_wall_s"] = time.perf_counter() - t0
                if run.latest is not None:
                    result["machine"].update(run.latest.kernels)
        result["floor"]["tuichat"] = run.tuichat_floor()
        result["weights"] = run.latest.weights if run.latest is not None else None  # tuichat's weight format
        result["memory"] = {name: {"ready_s": peer.ready_s, **(peer.memory() or {})}
                            for name, peer in (("llama_server", run.llama), ("tuichat_serve", run.serve)) if peer is not None}
        if run.latest is not None:  # in this process, beside the peers: its load time, not an RSS of its own
            result["memory"]["tuichat"] = {"load_s": run.latest.load_s, "mapped_mb": run.latest.mapped_bytes / 2**20,
                                           "huge_page_mb": run.latest.huge_page_bytes / 2**20}
        if run.llama is not None:
            result["versions"]["llama_server"] = run.llama.build
            result["llama_server"] = run.llama.command
    finally:
        run.close()
        progress.close()
        hf_logging.set_verbosity(verbosity)
        if bars_were_on:
            hf_logging.enable_progress_bar()
    result["wall_s"] = time.perf_counter() - started
    result["targets"] = targets(result)
    return result
