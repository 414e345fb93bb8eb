"""`tuichat bench`: streaming, batching and caching measured on this machine, next to the usual alternatives.

Scenarios (each can be picked with `--scenarios`):

- single         one conversation: TTFT, ITL, decode tok/s; plus a bare transformers forward over the same
                 prompt tokens, so the engine's overhead shows as a ratio (the prefix cache is off here, so the
                 engine computes every prompt token, like the bare forward).
- tabs           N conversations arriving `stagger_ms` apart, natural reply lengths (EOS on, capped), once per
                 batching mode (continuous, static, off).
- multiturn      one conversation of K turns about a pasted text, history growing with the model's real replies;
                 prefix cache on. Cache off replays the very same conversation (the cache-on replies as history)
                 and stops each turn after a few tokens: only its TTFT is compared.
- shared_prefix  N tabs with one long system prompt, arriving `stagger_ms` apart: first-turn TTFT, cache on/off.
- interference   TTFT of a new conversation while N-1 others decode, against its TTFT on an idle engine (prefix
                 cache off in this scenario, so both probes compute the whole prompt).

Peers, on the same prompt token ids, greedy, EOS on, same caps: transformers `generate` one request at a time;
a left-padded static batch through `generate`; transformers' own continuous batching (`generate_batch`), all
in tuichat's dtype and device; and llama.cpp's `llama-server` on the same .gguf (its quantized weights), in its
own process on loopback (next to torch, llama.cpp segfaults here; never a dependency): `--llama-server PATH`,
else $TUICHAT_LLAMA_SERVER, else `llama-server` on PATH. It is started once per run with one parallel slot
per tab and the bench's thread count, and always stopped. Its single stream computes every prompt token
(cache_prompt off), its tabs are concurrent requests on the slots, its multiturn keeps one slot's prompt
cache. In `tabs`, the batching peers get the tabs' arrival times too: the static batch starts when its last
prompt has arrived, `generate_batch`'s manager and llama-server get each prompt when it arrives;
`--stagger-ms 0` gives every system all prompts at once. The floor: the bytes a decode step reads (tuichat's
quantized weights; transformers' dense ones) / measured memory bandwidth.

Every tuichat number goes through `LocalBackend.stream` and is timed on the client side with
time.perf_counter (what a front end sees): TTFT = submitted -> first non-empty text; ITL = gaps between text
chunks; TPOT = (e2e - TTFT) / (output tokens - 1); throughput = output tokens / wall time of the scenario.
Output tokens include the EOS token for every system alike.

Caps: 64 tokens per single/tab reply, 96 per turn, 8 tabs, 8 turns (the history passes 1000 tokens).
`--quick` (<= 90 s on 2 cores): 3 single prompts, 24 tokens per tab reply, 4 turns of <= 48 tokens (the
history, which starts with a pasted text of ~550 tokens, reaches ~800 tokens instead of ~1300), and no
transformers TTFT per turn (in the full run, it shows a peer that recomputes the history every turn). The
one-at-a-time peer (`hf_generate`) runs the first 4 tab prompts only: its tok/s does not depend on how many wait.

Threads: every bit of bench torch work (loading the transformers model, its forwards, the bandwidth sum) runs
on a thread that ends with it, never on the main thread, and not while an engine thread lives (see
on_own_thread). libgomp keeps an OpenMP pool for each live thread that ever ran a parallel region; with more
pool threads than cores it stops spinning between regions and a step costs about twice as much. That, not the
main thread as such, is why torch ran slower "from the main thread" here: a second pool was alive.
"""

from __future__ import annotations

import asyncio
import functools
import http.client
import importlib.util
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence, TextIO

from tuichat import catalog
from tuichat.backend import BackendError, EngineOptions, Message, SamplingParams
from tuichat.engine.heap import settle_heap
from tuichat.local import chat_ids

SCENARIOS = ("single", "tabs", "multiturn", "shared_prefix", "interference")
PEERS = ("hf_generate", "hf_static_batch", "hf_generate_batch", "llama_cpp")
MODES = ("continuous", "static", "off")
ENGINE_THREAD = "tuichat-engine-"  # how Engine.start names its threads

# -- prompts ----------------------------------------------------------------------------------------------------
# Natural chat questions: short and long answers mixed, so replies end at their own EOS at different times.
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion simply.",
    "List three fruits that are rich in vitamin C.",
    "Why is the sky blue?",
    "Give me a tip for sleeping better.",
    "What is 12 times 7?",
    "Name a famous painter and one of their works.",
    "How do I boil an egg?",
    "What does a CPU do?",
    "Suggest a name for a grey cat.",
    "How can I learn to play the guitar?",
    "What is the difference between weather and climate?",
    "Translate 'good morning' into Spanish.",
    "Why do leaves change color in autumn?",
    "Give me an idea for a quick vegetarian dinner.",
]

# The single-conversation scenario: questions that get a paragraph-long answer (decode speed needs tokens).
SINGLE_QUESTIONS = [
    "Explain how a refrigerator keeps food cold.",
    "Describe the water cycle in a few sentences.",
    "What are the benefits of regular exercise?",
    "How does a bicycle stay upright when it moves?",
]

# Background tabs in the interference scenario: prompts that get long replies.
LONG_REPLY_PROMPTS = [
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Write a detailed essay on the history of the printing press.",
    "Explain in detail, step by step, how the internet delivers a web page.",
    "Write a long letter to a friend describing a hiking trip in the mountains.",
    "Describe in detail the life cycle of a star, from nebula to its end.",
    "Write a long fairy tale about a dragon who is afraid of fire.",
    "Explain in detail how vaccines train the immune system.",
    "Write a detailed guide to growing tomatoes in a small garden.",
]
PROBE_QUESTION = "What is the boiling point of water at sea level?"
WARMUP_QUESTION = "Hello! Say hi back."

DOCUMENT = (
    "Honey bees live in colonies of up to sixty thousand individuals. Each colony has a single queen, a few "
    "hundred male drones and thousands of female worker bees. The queen lays up to two thousand eggs a day in "
    "the wax cells of the comb. Drones exist only to mate with queens from other colonies, and they are driven "
    "out of the hive before winter. Workers do everything else: young workers clean cells, feed the larvae with "
    "royal jelly and pollen, build comb from wax they secrete, and guard the entrance. Older workers become "
    "foragers. A forager that finds a rich patch of flowers returns to the hive and performs a waggle dance: "
    "the angle of the dance relative to vertical tells the others the direction of the flowers relative to the "
    "sun, and the length of the waggle run tells them the distance. Foragers collect nectar, which they store "
    "in a special honey stomach. Back in the hive, they pass it to house bees, who add enzymes and spread it "
    "in cells, fanning their wings until most of the water evaporates. When the honey is thick enough, they "
    "seal the cell with a wax cap. A strong colony can store more than fifty kilograms of honey in a good year, "
    "which feeds it through the winter, when the bees cluster together and shiver their flight muscles to keep "
    "the queen warm. Today colonies face many threats: the varroa mite, pesticides, the loss of wildflowers, "
    "and a changing climate.\n\n"
    "A colony reproduces by swarming. In late spring, when the hive grows crowded, the workers raise several "
    "new queens in large, peanut-shaped cells. Shortly before the first of them emerges, the old queen leaves "
    "with about half of the workers. The swarm settles on a branch while scouts search for a new home, such as "
    "a hollow tree. Each scout that finds a promising cavity dances for it, and the others visit the site and "
    "dance in turn when they approve of it. When enough scouts gather at one site, the swarm lifts off and "
    "flies there together. Back in the old hive, the first new queen to emerge usually kills her rivals in "
    "their cells. A few days later she flies out to mate with a dozen or more drones high in the air, storing "
    "their sperm for the rest of her life, which can last three to five years. A worker lives only five or six "
    "weeks in summer, worn out by foraging, but workers born in autumn can live for several months. Beekeepers "
    "work with these habits: they give colonies room to prevent swarming, check the combs for disease, treat "
    "against mites, and take only the honey that the bees will not need for the winter."
)
FIRST_TURN = "Read this text, then summarize it in two sentences.\n\n" + DOCUMENT
FOLLOW_UPS = [
    "What is the main job of the worker bees?",
    "Explain the waggle dance in more detail.",
    "How exactly do bees turn nectar into honey? Go step by step.",
    "Why are drones driven out before winter?",
    "What threats do bee colonies face today, and why do they matter?",
    "What can a gardener do to help bees? Give several ideas.",
    "Write a short poem about a forager bee.",
    "Summarize our whole conversation in a few bullet points.",
    "Give me three quiz questions about bees, with answers.",
]

SYSTEM_PROMPT = (
    "You are Juniper, the customer support assistant of Northwind Outdoor Gear, an online shop that sells "
    "tents, sleeping bags, backpacks, hiking boots, climbing equipment and camping stoves. Follow these rules "
    "in every answer. Be friendly, concise and precise; answer in the customer's language. Never invent order "
    "numbers, prices, stock levels or delivery dates: when you do not know, say so and offer to connect the "
    "customer with a human agent. Our opening hours are Monday to Friday, 8 am to 6 pm, and Saturday, 9 am to "
    "1 pm, Central European Time. Shipping: orders above 50 euros ship free within the European Union; smaller "
    "orders cost 4.90 euros. Standard delivery takes two to four working days; express delivery takes one "
    "working day and costs 9.90 euros. We do not ship gas canisters by air. Returns: customers may return "
    "unused items within 30 days of delivery for a full refund; used items can be returned only when they are "
    "defective. Refunds are paid to the original payment method within five working days after we receive "
    "the parcel. Warranty: two years on all products, five years on our own Northwind tents and backpacks. "
    "Sizing: hiking boots run half a size small, so advise customers to order half a size up; sleeping bags "
    "list a comfort temperature and a limit temperature, and customers should choose by the comfort one. "
    "Safety: never advise using a camping stove inside a closed tent; always mention ventilation when stoves "
    "or heaters come up. Loyalty program: members collect one point per euro spent and get a ten euro voucher "
    "for every 200 points. Privacy: never ask for full card numbers or passwords. If a customer is angry, "
    "acknowledge the problem first, then offer a concrete next step. Keep answers under 120 words unless the "
    "customer asks for detail, and end with a short question when it helps the customer move forward."
)
SHARED_PREFIX_QUESTIONS = [
    "Do you ship to Norway?",
    "My boots feel tight. What size should I order?",
    "Can I return a tent I slept in once?",
    "Which sleeping bag is good for zero degrees?",
    "How long is the warranty on your backpacks?",
    "Is it safe to cook inside my tent when it rains?",
    "When are you open on Saturday?",
    "How do loyalty points work?",
    "My order is late. What can I do?",
    "Do you sell climbing ropes?",
]


# -- settings -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchSettings:
    model: str = catalog.EMBEDDED_ALIAS
    options: EngineOptions = EngineOptions()
    scenarios: tuple[str, ...] = SCENARIOS
    peers: tuple[str, ...] = PEERS
    quick: bool = False
    tabs: int = 8
    turns: int = 8
    single_tokens: int = 64  # cap of each single-conversation reply
    tab_tokens: int = 64  # cap of each reply in tabs
    turn_tokens: int = 96  # cap of each multiturn reply
    probe_tokens: int = 4  # TTFT-only requests (cache-off replay, shared prefix, interference probes)
    single_prompts: int = 3  # single: medians over this many questions
    sequential_peer_prompts: int = 4  # hf_generate, one at a time, runs this many of the tab prompts (tok/s per request)
    multiturn_peer: bool = True  # transformers generate's TTFT per turn (it recomputes the whole history)
    probes: int = 3  # interference: probes idle and loaded
    stagger_ms: float = 100.0
    bandwidth_mb: int = 512
    default_kv_cache_mb: int = 256  # per engine, unless --kv-cache-mb says otherwise
    llama_server: str | None = None  # the binary; else $TUICHAT_LLAMA_SERVER, else llama-server on PATH

    @classmethod
    def make(cls, quick: bool = False, **overrides: Any) -> "BenchSettings":
        # Quick keeps tabs' full reply cap: with 24-token replies and 100 ms arrivals, a tab lived ~0.4 s of the
        # 0.7 s arrival window, fewer than half the tabs overlapped, and tok/s measured the arrival schedule
        # more than batching. The one-at-a-time peer, slow at that length, runs two prompts instead.
        base = dict(turns=4, single_tokens=32, turn_tokens=48, single_prompts=3, sequential_peer_prompts=2,
                    multiturn_peer=False, bandwidth_mb=256) if quick else {}
        base.update({k: v for k, v in overrides.items() if v is not None})
        settings = cls(quick=quick, **base)
        unknown = set(settings.scenarios) - set(SCENARIOS)
        if unknown:
            raise BackendError(f"Unknown scenario(s): {', '.join(sorted(unknown))}. Pick from {', '.join(SCENARIOS)}.")
        unknown = set(settings.peers) - set(PEERS)
        if unknown:
            raise BackendError(f"Unknown peer(s): {', '.join(sorted(unknown))}. Pick from {', '.join(PEERS)}.")
        if settings.tabs < 1 or settings.turns < 1:
            raise BackendError("--tabs and --turns must be at least 1.")
        return settings

    @property
    def llama_slot_ctx(self) -> int:
        """llama-server's context per slot (one slot per tab; -c is split across them): room for the history."""
        return 1024 * math.ceil((1024 + self.turns * (self.turn_tokens + 64)) / 1024)

    def engine_options(self, **changes: Any) -> EngineOptions:
        options = self.options
        if options.kv_cache_mb is None:
            options = replace(options, kv_cache_mb=self.default_kv_cache_mb)
        return replace(options, **changes)


def parse_list(value: str | None, allowed: Sequence[str], what: str) -> tuple[str, ...] | None:
    """'a,b' -> ('a', 'b'); 'all' -> allowed; 'none' -> (); None -> None (the default)."""
    if value is None:
        return None
    value = value.strip().lower()
    if value == "all":
        return tuple(allowed)
    if value in ("none", ""):
        return ()
    items = tuple(dict.fromkeys(v.strip().replace("-", "_") for v in value.split(",") if v.strip()))
    unknown = [v for v in items if v not in allowed]
    if unknown:
        raise BackendError(f"Unknown {what}: {', '.join(unknown)}. Pick from {', '.join(allowed)} (or all/none).")
    return items


# -- statistics ---------------------------------------------------------------------------------------------------
def percentile(values: Sequence[float | None], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no data."""
    data = sorted(v for v in values if v is not None)
    if not data:
        return None
    k = (len(data) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return data[lo] + (data[hi] - data[lo]) * (k - lo)


def _median(values: Sequence[float | None]) -> float | None:
    return percentile(values, 0.5)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


@dataclass
class RequestResult:
    """One reply, timed on the client side (perf_counter seconds; *_ms relative to submission)."""

    submitted: float
    ttft_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    e2e_ms: float | None = None
    tokens: int = 0  # output tokens, EOS included
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""
    finished: float = 0.0

    def set_token_times(self, times: Sequence[float]) -> None:
        """TTFT, ITL and end-to-end from a peer's per-token timestamps (perf_counter seconds)."""
        if times:
            self.ttft_ms = (times[0] - self.submitted) * 1000
            self.itl_ms = [(b - a) * 1000 for a, b in zip(times, times[1:])]
            self.e2e_ms = (times[-1] - self.submitted) * 1000

    @property
    def tpot_ms(self) -> float | None:
        if self.ttft_ms is None or self.e2e_ms is None or self.tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.tokens - 1)

    @property
    def decode_tokens_per_s(self) -> float | None:
        tpot = self.tpot_ms
        return 1000 / tpot if tpot else None


def summarize(results: Sequence[RequestResult], wall_s: float) -> dict[str, Any]:
    """vLLM's aggregate metrics over a set of replies."""
    tokens = sum(r.tokens for r in results)
    ttfts = [r.ttft_ms for r in results]
    itls = [gap for r in results for gap in r.itl_ms]
    tpots = [r.tpot_ms for r in results]
    return {
        "requests": len(results),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "ttft_ms_p50": percentile(ttfts, 0.5),
        "ttft_ms_p90": percentile(ttfts, 0.9),
        "itl_ms_p50": percentile(itls, 0.5),
        "itl_ms_p90": percentile(itls, 0.9),
        "tpot_ms_p50": percentile(tpots, 0.5),
        "tpot_ms_p90": percentile(tpots, 0.9),
    }


# -- progress -----------------------------------------------------------------------------------------------------
class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, one line per step otherwise."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.started = time.perf_counter()
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.label = ""

    def _draw(self) -> None:
        if not self.enabled:
            return
        fraction = min(self.done / self.total, 1.0)
        elapsed = time.perf_counter() - self.started
        clock = f"{int(elapsed // 60)}:{int(elapsed % 60):02d}"
        if self.tty:
            width = 24
            filled = round(width * fraction)
            bar = "█" * filled + "░" * (width - filled)
            self.stream.write(f"\r\033[K[bench] {bar} {fraction:4.0%} {clock}  {self.label}")
        else:
            self.stream.write(f"[bench {self.done}/{self.total} {fraction:4.0%} {clock}] {self.label}\n")
        self.stream.flush()

    def start(self, label: str) -> None:
        self.label = label
        self._draw()

    def advance(self) -> None:
        self.done += 1
        if self.tty:
            self._draw()

    def step(self, label: str):
        progress = self

        class _Step:
            def __enter__(self):
                progress.start(label)

            def __exit__(self, *exc):
                progress.advance()
                return False

        return _Step()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.label = "done"
            self._draw()
            self.stream.write("\n")
            self.stream.flush()


def plan(settings: BenchSettings) -> list[str]:
    """The steps a run will take (for the progress bar)."""
    steps = ["floor: weights and memory bandwidth"]
    if "single" in settings.scenarios:
        steps += ["single · tuichat, bare forward, hf_generate"]
        steps += ["single · llama_cpp"] if "llama_cpp" in settings.peers else []
    if "tabs" in settings.scenarios:
        steps += [f"tabs · tuichat {m}" for m in MODES] + [f"tabs · {p}" for p in settings.peers]
    if "multiturn" in settings.scenarios:
        steps += ["multiturn · cache on", "multiturn · cache off"]
        steps += ["multiturn · hf_generate"] if "hf_generate" in settings.peers and settings.multiturn_peer else []
        steps += ["multiturn · llama_cpp"] if "llama_cpp" in settings.peers else []
    if "shared_prefix" in settings.scenarios:
        steps += ["shared_prefix · cache on", "shared_prefix · cache off"]
    if "interference" in settings.scenarios:
        steps += ["interference · idle and loaded"]
    return steps


# -- tuichat through the Backend protocol -------------------------------------------------------------------------------
async def stream_once(backend, conversation_id: str, messages: Sequence[Message], params: SamplingParams,
                      submitted: float | None = None) -> RequestResult:
    """Send one turn through LocalBackend.stream and time it as a front end sees it."""
    result = RequestResult(submitted=submitted if submitted is not None else time.perf_counter())
    last_text: float | None = None
    chunks: list[str] = []
    async for event in backend.stream(conversation_id, messages, params):
        now = time.perf_counter()
        if event.text:
            chunks.append(event.text)
            if last_text is None:
                result.ttft_ms = (now - result.submitted) * 1000
            else:
                result.itl_ms.append((now - last_text) * 1000)
            last_text = now
        if event.finished:
            if event.error:
                raise BackendError(event.error)
            usage = event.usage
            result.tokens = usage.completion_tokens
            result.prompt_tokens = usage.prompt_tokens
            result.cached_tokens = usage.cached_tokens
            result.finish_reason = usage.finish_reason
    result.finished = time.perf_counter()
    result.e2e_ms = (result.finished - result.submitted) * 1000
    result.text = "".join(chunks)
    return result


class _Tuichat:
    """One LocalBackend with given options, loaded and warmed up once, closed on exit."""

    def __init__(self, settings: BenchSettings, **changes: Any) -> None:
        from tuichat.local import LocalBackend

        self.backend = LocalBackend(settings.engine_options(**changes), settings.model)
        self.model = settings.model
        self.kernels: dict[str, str] = {}

    def __enter__(self) -> "_Tuichat":
        self.name = asyncio.run(self.backend.load(self.model))  # on a thread that ends with the load
        stats = self.backend.stats(self.name)
        self.kernels = {"decode_matmul": stats.matmul, "decode_layers": stats.layers}
        self.weights, self.weight_bytes = stats.weights, stats.weight_bytes  # what a decode step reads
        asyncio.run(stream_once(self.backend, "warmup", [Message("user", WARMUP_QUESTION)], SamplingParams(max_tokens=4)))
        return self

    def run(self, coro_fn: Callable[..., Any], *args: Any) -> Any:
        return asyncio.run(coro_fn(self.backend, *args))

    def __exit__(self, *exc: Any) -> None:
        asyncio.run(self.backend.close())
        self.backend = None
        settle_heap()  # collect what was closed; freeze what stays


async def run_tabs(backend, conversations: Sequence[Sequence[Message]], params: SamplingParams, stagger_s: float,
                   tag: str = "tab") -> tuple[list[RequestResult], float]:
    """Conversations arriving stagger_s apart; returns their results and the wall time (first submit -> last end)."""
    t0 = time.perf_counter()

    async def tab(i: int, messages: Sequence[Message]) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + i * stagger_s - time.perf_counter()))
        return await stream_once(backend, f"{tag}-{i}", messages, params)

    results = await asyncio.gather(*(tab(i, m) for i, m in enumerate(conversations)))
    return list(results), max(r.finished for r in results) - t0


# -- peers: transformers directly -----------------------------------------------------------------------------------


class HFPeer:
    """The model through plain transformers: generate, a padded static batch, generate_batch, a bare forward."""

    def __init__(self, resolved, device, dtype, device_map: str | None = None,
                 max_batched_tokens: int | None = None) -> None:
        import torch

        from tuichat.engine import loader
        from tuichat.engine.engine import eos_token_ids

        self.torch = torch
        # The same per-step token budget as tuichat's engine default (512 on a CPU, 8192 on CUDA).
        self.max_batched_tokens = max_batched_tokens or (8192 if torch.device(device).type == "cuda" else 512)
        self.model, self.tokenizer = loader.load(resolved, device, dtype, device_map)
        self.device = next(self.model.parameters()).device
        self.eos = sorted(eos_token_ids(self.model, self.tokenizer))  # the set the engine stops on
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos[0]
        self._warm: set[str] = set()

    # weights and time
    def weight_bytes(self) -> int:
        seen, total = set(), 0
        for p in self.model.parameters():  # tied embeddings / lm_head are read once per step
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
        return total

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def _config(self, max_tokens: int):
        from transformers import GenerationConfig

        return GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=self.eos,
                                pad_token_id=self.pad)

    def _clock(self):
        from transformers import StoppingCriteria, StoppingCriteriaList

        torch = self.torch

        class Clock(StoppingCriteria):
            """Called by generate after every new token: a timestamp per step, never stops anything."""

            def __init__(self) -> None:
                self.times: list[float] = []

            def __call__(self, input_ids, scores, **kwargs):
                self.times.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        clock = Clock()
        return clock, StoppingCriteriaList([clock])

    def _count(self, row: list[int]) -> int:
        """Tokens up to and including the first EOS (the rest of a batch row is padding)."""
        for i, token in enumerate(row):
            if token in self.eos:
                return i + 1
        return len(row)

    def _warmup(self, kind: str) -> None:
        if kind in self._warm:
            return
        self._warm.add(kind)
        prompt = chat_ids(self.tokenizer, [Message("user", WARMUP_QUESTION)])
        if kind == "generate":
            self.generate(prompt, 4, warm=False)
        elif kind == "static":
            self.static_batch([prompt, prompt[:-2] or prompt], 4, warm=False)
        elif kind == "generate_batch":
            self.generate_batch([prompt, prompt], 4, warm=False)
        elif kind == "forward":
            self.bare_forward_ms(prompt, repeats=1, warm=False)

    def bare_forward_ms(self, prompt: list[int], repeats: int = 3, warm: bool = True) -> float:
        """Median time of one forward over the prompt, last position's logits only (what a prefill needs)."""
        torch = self.torch
        if warm:
            self._warmup("forward")
        ids = torch.tensor([prompt], device=self.device)
        times = []
        with torch.inference_mode():
            for _ in range(repeats):
                self._sync()
                start = time.perf_counter()
                self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
                self._sync()
                times.append((time.perf_counter() - start) * 1000)
        return statistics.median(times)

    def generate(self, prompt: list[int], max_tokens: int, warm: bool = True) -> RequestResult:
        torch = self.torch
        if warm:
            self._warmup("generate")
        ids = torch.tensor([prompt], device=self.device)
        clock, criteria = self._clock()
        result = RequestResult(submitted=time.perf_counter(), prompt_tokens=len(prompt))
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=self._config(max_tokens),
                                      stopping_criteria=criteria)
        result.finished = time.perf_counter()
        row = out[0, len(prompt):].tolist()
        result.tokens = self._count(row)
        result.set_token_times(clock.times[: result.tokens])
        result.text = self.tokenizer.decode(row[: result.tokens], skip_special_tokens=True)
        return result

    def static_batch(self, prompts: list[list[int]], max_tokens: int, warm: bool = True,
                     stagger_s: float = 0.0) -> tuple[list[RequestResult], float]:
        """One left-padded batch through generate; it runs until the longest reply ends. Prompt i arrives at
        i * stagger_s: a static batch can only start once its last member is there, and each request's
        TTFT counts from its own arrival."""
        torch = self.torch
        if warm:
            self._warmup("static")
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        clock, criteria = self._clock()
        first_arrival = time.perf_counter()
        time.sleep(stagger_s * (len(prompts) - 1))
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, generation_config=self._config(max_tokens),
                                      stopping_criteria=criteria)
        end = time.perf_counter()
        results = []
        for i, prompt in enumerate(prompts):
            arrived = first_arrival + i * stagger_s
            r = RequestResult(submitted=arrived, prompt_tokens=len(prompt), finished=end)
            r.tokens = self._count(out[i, width:].tolist())
            r.set_token_times(clock.times[: r.tokens])
            results.append(r)
        return results, end - first_arrival

    def generate_batch(self, prompts: list[list[int]], max_tokens: int, warm: bool = True,
                       stagger_s: float = 0.0) -> tuple[list[RequestResult], float]:
        """transformers' own continuous batching: the manager behind `generate_batch` (a thread, its own paged
        cache), with prompt i added at i * stagger_s, as tuichat gets them."""
        if warm:
            self._warmup("generate_batch")
        from transformers import ContinuousBatchingConfig

        # Left alone, it sizes its KV cache to 90 % of free memory (host RAM on a CPU: ~20 GB here, ~15 s to
        # allocate per call). Give it what the workload needs and the engine's per-step token budget.
        cb = ContinuousBatchingConfig()
        cb.num_blocks = math.ceil(sum(len(p) + max_tokens for p in prompts) / cb.page_size) + len(prompts)
        cb.max_batch_tokens = self.max_batched_tokens
        attn = getattr(self.model.config, "_attn_implementation", None)
        done: dict[str, Any] = {}
        arrivals: dict[str, float] = {}
        try:
            with self.model.continuous_batching_context_manager(
                generation_config=self._config(max_tokens), continuous_batching_config=cb, block=True, timeout=5
            ) as manager:
                start = time.perf_counter()
                for i, prompt in enumerate(prompts):
                    time.sleep(max(0.0, start + i * stagger_s - time.perf_counter()))
                    arrivals[f"tab{i}"] = time.perf_counter()
                    manager.add_request(prompt, request_id=f"tab{i}", max_new_tokens=max_tokens, record_timestamps=True)
                while len(done) < len(prompts):
                    output = manager.get_result(timeout=1)
                    if output is not None and output.is_finished():
                        done[output.request_id] = output
                    elif output is None and not manager.is_running():
                        raise BackendError("transformers' continuous batching stopped before finishing the tabs.")
                end = time.perf_counter()
        finally:
            if attn and getattr(self.model.config, "_attn_implementation", None) != attn:
                self.model.set_attn_implementation(attn)  # it may switch to a paged kernel; later peers get theirs back
        results = []
        for request_id, arrived in arrivals.items():
            output = done[request_id]
            if output.error:
                raise BackendError(f"transformers generate_batch failed: {output.error}")
            r = RequestResult(submitted=arrived, prompt_tokens=len(output.prompt_ids), finished=end)
            r.tokens = len(output.generated_tokens)
            r.set_token_times(output.timestamps or [])
            results.append(r)
        return results, end - start

    def close(self) -> None:
        self.model = None
        settle_heap()  # collect what was closed; freeze what stays
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()


# -- peers: llama.cpp, in its own process ----------------------------------------------------------------------------
LLAMA_SERVER_HINT = (
    "build it from llama.cpp with `cmake -B build -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF && "
    "cmake --build build --target llama-server` (a native AMX build segfaults on prompt batches), then pass "
    "--llama-server PATH or set TUICHAT_LLAMA_SERVER; llama.cpp is never a tuichat dependency"
)


def find_llama_server(given: str | None, resolved) -> tuple[str | None, str | None]:
    """(the llama-server binary, None), or (None, why the llama.cpp peer cannot run): --llama-server, else
    $TUICHAT_LLAMA_SERVER, else llama-server on PATH."""
    if resolved.kind != "gguf":
        return None, (f"llama.cpp needs a .gguf model; {resolved.name} is a transformers folder "
                      "(llama.cpp's convert_hf_to_gguf.py makes one)")
    given = given or os.environ.get("TUICHAT_LLAMA_SERVER")
    found = shutil.which(given or "llama-server")
    if found is None:
        where = f"no executable llama-server at {given}" if given else "no llama-server on PATH"
        return None, f"{where}: {LLAMA_SERVER_HINT}"
    return found, None


class LlamaServerPeer:
    """The same GGUF through llama.cpp's own `llama-server`, a separate process on loopback: loaded next to
    torch, llama.cpp segfaults here. It runs the file's quantized weights with `slots` parallel slots of
    `slot_ctx` tokens each (-c is split across them). Every request streams from the native /completion
    endpoint on its own connection, greedy, stopping at the model's EOS tokens like the other peers."""

    def __init__(self, binary: str, gguf: str, threads: int, slots: int, slot_ctx: int, warmup: list[int],
                 gpu: bool = False, ready_timeout_s: float = 120.0) -> None:
        with socket.socket() as probe:  # a free port; the server binds it a moment later
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        folder = str(Path(binary).resolve().parent)  # its own shared libraries sit beside it in a build
        env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [folder, os.environ.get("LD_LIBRARY_PATH")]))}
        self.command = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
                        "-np", str(slots), "-c", str(slots * slot_ctx), "-ngl", "999" if gpu else "0", "--no-webui"]
        self.log = tempfile.TemporaryFile()  # not a pipe: an unread pipe fills and stalls the server
        self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=self.log,
                                        stderr=subprocess.STDOUT, env=env)
        try:
            self.build = self._wait_ready(ready_timeout_s)
            self.generate(warmup, 4)  # like every other system's warm-up
        except BaseException:
            self.close()
            raise

    def _log_tail(self, lines: int = 5) -> str:
        self.log.seek(0)
        return " | ".join(self.log.read().decode(errors="replace").strip().splitlines()[-lines:])

    def _request(self, method: str, path: str, body: dict | None = None) -> http.client.HTTPResponse:
        # A fresh connection per request: the server closes one after a streamed reply.
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        connection.request(method, path, None if body is None else json.dumps(body),
                           {"Content-Type": "application/json"})
        return connection.getresponse()

    def _wait_ready(self, timeout_s: float) -> str:
        """Poll /health until the model is loaded; the server's build from /props."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BackendError(f"llama-server exited with status {self.process.returncode}: {self._log_tail()}")
            try:
                with self._request("GET", "/health") as response:
                    if response.status == 200:
                        break
            except OSError:
                pass  # not listening yet
            time.sleep(0.1)
        else:
            raise BackendError(f"llama-server was not ready after {timeout_s:.0f} s: {self._log_tail()}")
        with self._request("GET", "/props") as response:
            return json.loads(response.read()).get("build_info", "")

    def generate(self, prompt: list[int], max_tokens: int, cache_prompt: bool = False, slot: int = -1) -> RequestResult:
        """One streamed reply. Each token arrives as its own SSE event (the EOS token too, with empty content):
        their arrival times give TTFT and ITL on the client side. cache_prompt=False computes the whole prompt;
        slot -1 is any idle slot."""
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "stream": True,
                "cache_prompt": cache_prompt, "id_slot": slot}
        result = RequestResult(submitted=time.perf_counter(), prompt_tokens=len(prompt))
        times, chunks, final = [], [], None
        with self._request("POST", "/completion", body) as response:
            if response.status != 200:
                raise BackendError(f"llama-server answered {response.status}: {response.read()[:300]!r}")
            for line in response:
                if line.startswith(b"error:"):
                    raise BackendError(f"llama-server: {line[6:].decode(errors='replace').strip()}")
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:])
                if event.get("tokens"):
                    times.append(time.perf_counter())
                    chunks.append(event["content"])
                if event.get("stop"):
                    final = event
        result.finished = time.perf_counter()
        if final is None:
            raise BackendError("llama-server ended a reply without its final event")
        result.set_token_times(times)
        result.tokens = final["tokens_predicted"]  # EOS included, as for every system
        result.cached_tokens = final["timings"]["cache_n"]
        result.finish_reason = {"eos": "stop", "limit": "length"}.get(final["stop_type"], final["stop_type"])
        result.text = "".join(chunks)
        return result

    def prefill(self, prompt: list[int], slot: int) -> None:
        """Put `prompt` into a slot's cache without generating (n_predict 0)."""
        body = {"prompt": prompt, "n_predict": 0, "cache_prompt": True, "id_slot": slot}
        with self._request("POST", "/completion", body) as response:
            if response.status != 200:
                raise BackendError(f"llama-server answered {response.status}: {response.read()[:300]!r}")
            response.read()

    def tabs(self, prompts: list[list[int]], max_tokens: int, stagger_s: float) -> tuple[list[RequestResult], float]:
        """Prompt i sent at i * stagger_s, each on its own thread and connection, so the server's parallel slots
        batch them as they arrive (the other batching peers get the same arrivals)."""
        start = time.perf_counter()

        def send(i: int) -> RequestResult:
            time.sleep(max(0.0, start + i * stagger_s - time.perf_counter()))
            return self.generate(prompts[i], max_tokens, cache_prompt=True)  # tuichat's tabs run with its cache on

        with ThreadPoolExecutor(len(prompts), thread_name_prefix="tuichat-bench-llama") as pool:
            results = list(pool.map(send, range(len(prompts))))
        return results, max(r.finished for r in results) - start

    def close(self) -> None:
        """Stop the server (and wait for it): after every run, an error or Ctrl-C."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


# -- threads, memory bandwidth and the floor ---------------------------------------------------------------------------
def on_own_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) on a thread that ends with it. libgomp keeps an OpenMP pool for every live thread that ever ran
    a torch parallel region, and once the pools hold more threads than there are cores it stops spinning between
    regions: a lasting pool beside the engine thread's doubled tuichat's decode step here (10.9 -> 19.3 ms). So
    no bench torch work runs on the main thread or on a thread that outlives it, nor while an engine thread
    lives (an idle one ends after IDLE_EXIT_S): at most one pool is alive, for tuichat and its peers alike."""
    deadline = time.monotonic() + 30
    while any(t.name.startswith(ENGINE_THREAD) for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    thread = ThreadPoolExecutor(1, thread_name_prefix="tuichat-bench-torch")
    try:
        return thread.submit(fn, *args).result()
    finally:
        thread.shutdown(wait=True)


def measure_bandwidth(device, megabytes: int = 512, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the best of a few torch sums over one large buffer."""
    import torch

    buffer = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass faults the pages in
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        buffer.sum().item()
        best = min(best, time.perf_counter() - start)
    size = buffer.numel() * 4
    del buffer
    return size / best


def step_floor(weights: str, weight_bytes: int, bandwidth: float) -> dict[str, Any]:
    step_ms = weight_bytes / bandwidth * 1000
    return {"weights": weights, "weight_bytes": weight_bytes, "decode_step_ms": step_ms, "decode_tokens_per_s": 1000 / step_ms}


# -- the run ---------------------------------------------------------------------------------------------------------
class _Run:
    def __init__(self, settings: BenchSettings, progress: Progress) -> None:
        import torch

        from tuichat.engine import loader

        self.settings = settings
        self.progress = progress
        self.resolved = catalog.resolve(settings.model)
        self.device = loader.resolve_device(settings.options.device)
        # The family decides, as in LocalBackend: the peers run in the dtype tuichat runs.
        self.dtype = loader.resolve_dtype(settings.options.dtype, self.device, loader.family(self.resolved))
        self.torch = torch
        self.peer: HFPeer | None = None
        self.bandwidth: float | None = None
        self.llama: LlamaServerPeer | None = None
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
                except (BackendError, OSError) as exc:
                    self.llama_skip = f"llama-server did not start: {exc}"
        if self.llama is None:
            return {"skipped": self.llama_skip}
        try:
            return work(self.llama)
        except (BackendError, OSError, KeyError, ValueError) as exc:
            return {"skipped": f"llama-server failed: {exc}"}

    def ids(self, messages: Sequence[Message]) -> list[int]:
        return chat_ids(self.peer.tokenizer, messages)

    # sections
    def floor(self) -> dict[str, Any]:
        """The bandwidth, and the floor of transformers' dense weights; tuichat's is added by tuichat_floor."""
        with self.step("floor: weights and memory bandwidth"):
            self.peer = on_own_thread(HFPeer, self.resolved, self.device, self.dtype, self.settings.options.device_map,
                                      self.settings.options.max_batched_tokens)
            self.bandwidth = on_own_thread(measure_bandwidth, self.device, self.settings.bandwidth_mb)
        return {
            "bandwidth_gb_s": self.bandwidth / 1e9,
            "tuichat": None,
            "transformers": step_floor(str(self.dtype).removeprefix("torch."), self.peer.weight_bytes(), self.bandwidth),
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
        ours, bare, hf = [], [], []
        # Interleaved per prompt (tuichat, bare forward, generate), so a noisy neighbour hits all three alike.
        with self.step("single · tuichat, bare forward, hf_generate"), \
                self.tuichat(batching="continuous", prefix_cache=False) as tc:
            for i, (messages, prompt) in enumerate(zip(conversations, prompts)):
                ours.append(tc.run(stream_once, f"single-{i}", messages, params))
                bare.append(on_own_thread(self.peer.bare_forward_ms, prompt))
                if self.wants("hf_generate"):
                    hf.append(on_own_thread(self.peer.generate, prompt, s.single_tokens))
        out: dict[str, Any] = {
            "prompts": len(prompts),
            "prompt_tokens": [r.prompt_tokens for r in ours],
            "max_tokens": s.single_tokens,
            "prefix_cache": False,
            "tuichat": self._single_summary(ours),
            "bare_forward_ms": _median(bare),
            "bare_forward_ms_each": bare,
            "peers": {},
        }
        out["ttft_over_bare_forward"] = _ratio(out["tuichat"]["ttft_ms"], out["bare_forward_ms"])
        if hf:
            out["peers"]["hf_generate"] = self._single_summary(hf)
        if self.wants("llama_cpp"):
            with self.step("single · llama_cpp"):  # cache_prompt off: it computes every prompt token, as tuichat does here
                out["peers"]["llama_cpp"] = self.with_llama(
                    lambda llama: self._single_summary([llama.generate(p, s.single_tokens) for p in prompts]))
        return out

    @staticmethod
    def _single_summary(results: Sequence[RequestResult]) -> dict[str, Any]:
        itls = [gap for r in results for gap in r.itl_ms]
        return {
            "ttft_ms": _median([r.ttft_ms for r in results]),
            "ttft_ms_each": [r.ttft_ms for r in results],
            "itl_ms_p50": percentile(itls, 0.5),
            "itl_ms_p90": percentile(itls, 0.9),
            "tpot_ms": _median([r.tpot_ms for r in results]),
            "decode_tokens_per_s": _median([r.decode_tokens_per_s for r in results]),
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
        ours = modes["continuous"]
        for name, peer in list(modes.items()) + list(peers.items()):
            peer["tuichat_over"] = _ratio(ours["tokens_per_s"], peer.get("tokens_per_s"))
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
        out["last_over_first_cache_on"] = _ratio(on_ttft[-1], on_ttft[0])
        # Turn 1 carries the pasted text; turn 2 on are all served from the cache: their trend is the flatness.
        out["last_over_second_cache_on"] = _ratio(on_ttft[-1], on_ttft[1]) if len(on_ttft) > 1 else None
        out["off_over_on_last_turn"] = _ratio(off_ttft[-1], on_ttft[-1])
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
        out["off_over_on_p50"] = _ratio(out["cache_off"]["ttft_ms_p50"], out["cache_on"]["ttft_ms_p50"])
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
                "idle_ttft_ms": _median([r.ttft_ms for r in idle]),
                "loaded_ttft_ms": _median([r.ttft_ms for r in loaded]),
                "idle_ttft_ms_each": [r.ttft_ms for r in idle],
                "loaded_ttft_ms_each": [r.ttft_ms for r in loaded],
                "decoding_at_submit": decoding,
                "background_tokens": [r.tokens for r in finished],
                "prompt_tokens": idle[0].prompt_tokens if idle else 0,
            }

        with self.step("interference · idle and loaded"), self.tuichat(batching="continuous", prefix_cache=False) as tc:
            out = tc.run(measure)
        out["tabs"] = s.tabs
        out["loaded_over_idle"] = _ratio(out["loaded_ttft_ms"], out["idle_ttft_ms"])
        return out

    def close(self) -> None:
        try:
            if self.llama is not None:
                self.llama.close()
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


# -- targets ----------------------------------------------------------------------------------------------------------
def _get(data: dict, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, reported (never asserted): value, bound, and whether it holds."""
    sc = result.get("scenarios", {})
    single, tabs, multi, inter = sc.get("single", {}), sc.get("tabs", {}), sc.get("multiturn", {}), sc.get("interference", {})
    rows = [
        ("tabs: continuous tok/s ÷ hf_static_batch", _get(tabs, "peers.hf_static_batch.tuichat_over"), ">=", 1.5),
        ("tabs: continuous tok/s ÷ hf_generate_batch", _get(tabs, "peers.hf_generate_batch.tuichat_over"), ">=", 3.0),
        ("multiturn: last-turn ÷ first-turn TTFT, cache on", multi.get("last_over_first_cache_on"), "<=", 1.5),
        ("multiturn: last-turn TTFT cache off ÷ on", multi.get("off_over_on_last_turn"), ">=", 5.0),
        ("interference: loaded ÷ idle TTFT", inter.get("loaded_over_idle"), "<=", 3.0),
        ("single: TTFT ÷ bare forward", single.get("ttft_over_bare_forward"), "<=", 1.15),
        ("single: decode tok/s ÷ hf_generate",
         _ratio(_get(single, "tuichat.decode_tokens_per_s"), _get(single, "peers.hf_generate.decode_tokens_per_s")), ">=", 1.5),
        ("single: decode tok/s ÷ llama_cpp",
         _ratio(_get(single, "tuichat.decode_tokens_per_s"), _get(single, "peers.llama_cpp.decode_tokens_per_s")), ">=", 1.0),
        ("single: TTFT ÷ llama_cpp", _ratio(_get(single, "tuichat.ttft_ms"), _get(single, "peers.llama_cpp.ttft_ms")), "<=", 0.5),
        ("tabs: continuous tok/s ÷ llama_cpp (parallel slots)", _get(tabs, "peers.llama_cpp.tuichat_over"), ">=", 3.0),
        ("single: decode step (TPOT, batch 1) ÷ its bytes-read floor",
         _ratio(_get(single, "tuichat.tpot_ms"), _get(result, "floor.tuichat.decode_step_ms")), "<=", 1.5),
    ]
    out = []
    for name, value, op, bound in rows:
        ok = None if value is None else (value >= bound if op == ">=" else value <= bound)
        out.append({"name": name, "value": value, "target": f"{op} {bound}", "ok": ok})
    return out


# -- output -----------------------------------------------------------------------------------------------------------
def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:,.{digits}f}"
    return str(value)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}×"


def _table(headers: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = lambda cells: indent + "  ".join(  # noqa: E731
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
    )
    return [fmt(headers)] + [fmt(r) for r in rows]


def render(result: dict[str, Any]) -> str:
    """The human-readable report: one small table per scenario, ratios as tuichat ÷ peer."""
    floor = result.get("floor", {})
    llama = result["versions"].get("llama_server")
    lines = [
        f"tuichat bench · {result['model']} · {result['device']} {result['dtype']} · "
        f"quant {result.get('quant') or '?'} · weights {result.get('weights') or '?'} · "
        f"torch {result['versions']['torch']} · {result['machine']['torch_threads']} threads · "
        f"matmul {result['machine'].get('decode_matmul', '?')} · layers {result['machine'].get('decode_layers', '?')}"
        f"{f' · llama-server {llama}' if llama else ''}{' · quick' if result.get('quick') else ''} · {result.get('wall_s', 0):.0f} s",
        f"floor at {_fmt(floor.get('bandwidth_gb_s'))} GB/s, one read of the weights per decode step (batch 1):",
    ]
    for who, f in (("tuichat reads", floor.get("tuichat")), ("transformers reads", floor.get("transformers"))):
        if f:
            lines.append(f"  {who} {f['weight_bytes'] / 1e6:,.0f} MB ({f['weights']}) = {_fmt(f['decode_step_ms'], 2)} ms a step "
                         f"({_fmt(f['decode_tokens_per_s'], 0)} tok/s)")
    lines += ["ratios are tuichat ÷ the row: above 1 is better for tok/s, below 1 is better for TTFT; times in ms", ""]
    sc = result.get("scenarios", {})
    if "single" in sc:
        s = sc["single"]
        t = s["tuichat"]
        lines.append(f"single · one conversation, {s['prompts']} prompts of ~{_median(s['prompt_tokens']) or 0:.0f} tokens, "
                     f"≤{s['max_tokens']} tokens, medians (prefix cache off)")
        rows = [["tuichat", _fmt(t["ttft_ms"]), _fmt(t["itl_ms_p50"]), _fmt(t["itl_ms_p90"]), _fmt(t["decode_tokens_per_s"]), "", ""]]
        rows.append(["bare forward (transformers)", _fmt(s["bare_forward_ms"]), "", "", "", _x(s["ttft_over_bare_forward"]), ""])
        for name, p in s["peers"].items():
            if "skipped" in p:
                rows.append([name, f"skipped: {p['skipped']}", "", "", "", "", ""])
            else:
                rows.append([name, _fmt(p["ttft_ms"]), _fmt(p["itl_ms_p50"]), _fmt(p["itl_ms_p90"]), _fmt(p["decode_tokens_per_s"]),
                             _x(_ratio(t["ttft_ms"], p["ttft_ms"])), _x(_ratio(t["decode_tokens_per_s"], p["decode_tokens_per_s"]))])
        lines += _table(["", "TTFT ms", "ITL p50", "ITL p90", "decode tok/s", "TTFT ÷", "tok/s ÷"], _skips_last(rows))
        lines.append("")
    if "tabs" in sc:
        s = sc["tabs"]
        lines.append(f"tabs · {s['tabs']} conversations, {s['stagger_ms']:.0f} ms apart, ≤{s['max_tokens']} tokens, EOS on "
                     "(the batching peers get the same arrivals)")
        rows = []
        entries = [(f"tuichat {m}", v) for m, v in s["modes"].items()] + list(s["peers"].items())
        for name, v in entries:
            if "skipped" in v:
                rows.append([name, f"skipped: {v['skipped']}"] + [""] * 7)
                continue
            rows.append([name, _fmt(v["tokens_per_s"]), _fmt(v["ttft_ms_p50"], 0), _fmt(v["ttft_ms_p90"], 0), _fmt(v["itl_ms_p50"], 0),
                         _fmt(v["itl_ms_p90"], 0), _fmt(v["tpot_ms_p50"], 0), str(v["output_tokens"]),
                         "" if name == "tuichat continuous" else _x(v.get("tuichat_over"))])
        lines += _table(["", "tok/s", "TTFT p50", "TTFT p90", "ITL p50", "ITL p90", "TPOT p50", "tokens", "tuichat ÷"],
                        _skips_last(rows))
        lines.append("")
    if "multiturn" in sc:
        s = sc["multiturn"]
        on, off = s["cache_on"], s["cache_off"]
        hf = s["peers"].get("hf_generate", {}).get("ttft_ms")
        llama = s["peers"].get("llama_cpp", {})
        lines.append(f"multiturn · {s['turns']} turns, replies ≤{s['max_tokens']} tokens, history {s['history_tokens']} tokens "
                     "(cache off replays the same history)")
        rows = []
        for k in range(len(on["ttft_ms"])):
            rows.append([str(k + 1), str(on["prompt_tokens"][k]), f"{on['cached_fraction'][k]:.0%}", _fmt(on["ttft_ms"][k], 0),
                         _fmt(off["ttft_ms"][k], 0), _x(_ratio(off["ttft_ms"][k], on["ttft_ms"][k])),
                         _fmt(hf[k], 0) if hf else "-",
                         f"{_fmt(llama['ttft_ms'][k], 0)} ({llama['cached_fraction'][k]:.0%})" if "ttft_ms" in llama else "-"])
        lines += _table(["turn", "prompt tok", "cached", "TTFT on", "TTFT off", "off ÷ on", "hf_generate", "llama_cpp (cached)"],
                        rows)
        lines.append(f"  cache on: last ÷ first turn {_x(s['last_over_first_cache_on'])}, "
                     f"last ÷ second turn {_x(s.get('last_over_second_cache_on'))}")
        lines.append("")
    if "shared_prefix" in sc:
        s = sc["shared_prefix"]
        lines.append(f"shared_prefix · {s['tabs']} tabs, one system prompt of ~{s['cache_on']['prompt_tokens'][0]} prompt tokens, "
                     f"{s['stagger_ms']:.0f} ms apart")
        rows = [[label.replace("_", " "), _fmt(v["ttft_ms_p50"], 0), _fmt(v["ttft_ms_p90"], 0),
                 f"{statistics.fmean(v['cached_fraction']):.0%}"] for label, v in (("cache_on", s["cache_on"]), ("cache_off", s["cache_off"]))]
        lines += _table(["first turn", "TTFT p50", "TTFT p90", "cached"], rows)
        lines.append(f"  cache off ÷ on (p50): {_x(s['off_over_on_p50'])}")
        lines.append("")
    if "interference" in sc:
        s = sc["interference"]
        lines.append(f"interference · a new conversation while {s['tabs'] - 1} others decode "
                     f"(decoding at submit: {s['decoding_at_submit']})")
        lines += _table(["", "TTFT ms"], [["idle", _fmt(s["idle_ttft_ms"], 0)], ["loaded", _fmt(s["loaded_ttft_ms"], 0)]])
        lines.append(f"  loaded ÷ idle: {_x(s['loaded_over_idle'])}")
        lines.append("")
    lines.append("targets (reported, not asserted)")
    mark = {True: "ok  ", False: "MISS", None: "n/a "}
    for t in result.get("targets", []):
        lines.append(f"  {mark[t['ok']]} {t['name']}: {_x(t['value'])} (target {t['target']})")
    return "\n".join(lines)


def _skips_last(rows: list[list[str]]) -> list[list[str]]:
    """A 'skipped: why' row would widen its column for everyone: print the reason in the last column instead."""
    out = []
    for row in rows:
        if row[1].startswith("skipped:"):
            row = [row[0], "skipped"] + [""] * (len(row) - 2)
        out.append(row)
    return out


def skipped_notes(result: dict[str, Any]) -> list[str]:
    """One line per skipped peer, saying why."""
    notes: dict[str, str] = {}
    for data in result.get("scenarios", {}).values():
        for name, peer in data.get("peers", {}).items():
            if isinstance(peer, dict) and peer.get("skipped"):
                notes.setdefault(name, f"{name} skipped: {peer['skipped']}")
    return list(notes.values())


def check_plot_available() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise BackendError("--plot needs matplotlib, an optional extra: pip install 'tuichat[plot]' (or pip install matplotlib).")
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise BackendError(f"--plot needs matplotlib, which failed to import: {exc}") from exc


def plot(result: dict[str, Any], path: str) -> None:
    """Two charts: TTFT per turn with the cache on/off, and throughput per batching mode and peer."""
    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sc = result.get("scenarios", {})
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    multi = sc.get("multiturn")
    if multi:
        turns = list(range(1, len(multi["cache_on"]["ttft_ms"]) + 1))
        left.plot(turns, [v or 0 for v in multi["cache_on"]["ttft_ms"]], "o-", label="tuichat, prefix cache on")
        left.plot(turns, [v or 0 for v in multi["cache_off"]["ttft_ms"]], "s--", label="tuichat, prefix cache off")
        hf = multi.get("peers", {}).get("hf_generate")
        if hf:
            left.plot(turns, [v or 0 for v in hf["ttft_ms"]], "^:", label="transformers generate")
        left.set_xticks(turns)
        left.set_xlabel("turn")
        left.set_ylabel("TTFT (ms)")
        left.set_title("multiturn: TTFT per turn")
        left.legend()
    else:
        left.text(0.5, 0.5, "multiturn not run", ha="center", va="center")
        left.set_axis_off()
    tabs = sc.get("tabs")
    if tabs:
        names, values = [], []
        for mode, v in tabs["modes"].items():
            names.append(f"tuichat {mode}")
            values.append(v["tokens_per_s"] or 0)
        for name, v in tabs["peers"].items():
            if v.get("tokens_per_s") is not None:
                names.append(name)
                values.append(v["tokens_per_s"])
        colors = ["tab:blue"] * len(tabs["modes"]) + ["tab:gray"] * (len(names) - len(tabs["modes"]))
        right.bar(names, values, color=colors)
        right.tick_params(axis="x", labelrotation=30)
        right.set_ylabel("output tokens / s")
        right.set_title(f"tabs: {tabs['tabs']} conversations, aggregate throughput")
    else:
        right.text(0.5, 0.5, "tabs not run", ha="center", va="center")
        right.set_axis_off()
    fig.suptitle(f"tuichat bench · {result['model']} · {result['device']} {result['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(settings: BenchSettings, as_json: bool = False, plot_path: str | None = None,
         out: TextIO | None = None, err: TextIO | None = None) -> dict[str, Any]:
    """What `tuichat bench` does: run, print the table (or the JSON), save the plot."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    if plot_path:
        check_plot_available()  # fail before minutes of measuring, not after
    result = run_bench(settings, err)
    if plot_path:
        plot(result, plot_path)
        result["plot"] = plot_path
    if as_json:
        out.write(json.dumps(result, default=str) + "\n")
    else:
        out.write(render(result) + "\n")
        for note in skipped_notes(result):
            out.write(f"note: {note}\n")
        if plot_path:
            out.write(f"plot: {plot_path}\n")
    out.flush()
    return result
