"""What a run measures and with which caps: `BenchSettings`, the `--scenarios`/`--peers` lists, and the run's
steps for the progress bar.

The prefill scenario sends one prompt of ~1,024 tokens for its first token only (3 times; 2 with `--quick`).
Caps: 64 tokens per single reply, 128 per tab reply, 96 per turn and per speculative reply, 8 tabs, 8 turns.
`--quick`: 3 single prompts of <= 32 tokens, 4 turns of <= 48 tokens (a shorter history), speculative replies of <=
64, and no transformers TTFT per turn (in the full run, it shows a peer that recomputes the history every turn); the
tabs keep their full cap. The one-at-a-time peer (`hf_generate`) runs the first tab prompts only (4, or 2 with
`--quick`): its tok/s does not depend on how many wait.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from tuichat import catalog
from tuichat.backends.protocol import EngineOptions, TuichatError

SCENARIOS = ("single", "prefill", "tabs", "multiturn", "shared_prefix", "interference", "speculative")
PEERS = ("hf_generate", "hf_static_batch", "hf_generate_batch", "llama_cpp", "tuichat_serve")
MODES = ("continuous", "static", "off")


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
    tab_tokens: int = 128  # cap of each reply in tabs
    turn_tokens: int = 96  # cap of each multiturn reply
    probe_tokens: int = 4  # TTFT-only requests (cache-off replay, shared prefix, interference probes)
    spec_tokens: int = 96  # cap of each reply in the speculative scenario (a rewritten paragraph is ~80)
    single_prompts: int = 3  # single: medians over this many questions
    prefill_tokens: int = 1024  # prefill: the prompt's length (about: whole sentences of the corpus' document)
    prefill_repeats: int = 3  # prefill: TTFT medians over this many sends of it
    sequential_peer_prompts: int = 4  # hf_generate, one at a time, runs this many of the tab prompts (tok/s per request)
    multiturn_peer: bool = True  # transformers generate's TTFT per turn (it recomputes the whole history)
    probes: int = 3  # interference: probes idle and loaded
    stagger_ms: float = 100.0
    bandwidth_mb: int = 512
    default_kv_cache_mb: int = 256  # per engine, unless --kv-cache-mb says otherwise
    llama_server: str | None = None  # the binary; else $TUICHAT_LLAMA_SERVER, else llama-server on PATH

    @classmethod
    def make(cls, quick: bool = False, **overrides: Any) -> BenchSettings:
        # Quick keeps tabs' full reply cap: a short reply ends before the later tabs arrive, so few tabs overlap
        # and tok/s measures the arrival schedule more than batching (`in_flight_mean` shows how many did). The
        # one-at-a-time peer, slow at that length, runs two prompts instead.
        base = dict(turns=4, single_tokens=32, turn_tokens=48, single_prompts=3, sequential_peer_prompts=2, prefill_repeats=2,
                    multiturn_peer=False, bandwidth_mb=256, spec_tokens=64) if quick else {}
        base.update({k: v for k, v in overrides.items() if v is not None})
        settings = cls(quick=quick, **base)
        unknown = set(settings.scenarios) - set(SCENARIOS)
        if unknown:
            raise TuichatError(f"Unknown scenario(s): {', '.join(sorted(unknown))}. Pick from {', '.join(SCENARIOS)}.")
        unknown = set(settings.peers) - set(PEERS)
        if unknown:
            raise TuichatError(f"Unknown peer(s): {', '.join(sorted(unknown))}. Pick from {', '.join(PEERS)}.")
        if settings.tabs < 1 or settings.turns < 1:
            raise TuichatError("--tabs and --turns must be at least 1.")
        return settings

    @property
    def llama_slot_ctx(self) -> int:
        """llama-server's context per slot (one slot per tab; -c is split across them): room for the history."""
        return 1024 * math.ceil(max(1024 + self.turns * (self.turn_tokens + 64), self.prefill_tokens + 256) / 1024)

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
        raise TuichatError(f"Unknown {what}: {', '.join(unknown)}. Pick from {', '.join(allowed)} (or all/none).")
    return items


def plan(settings: BenchSettings) -> list[str]:
    """The steps a run will take (for the progress bar)."""
    steps = ["floor: weights and memory bandwidth"]
    if "single" in settings.scenarios:
        steps += ["single · tuichat, bare forward, hf_generate"]
        steps += ["single · llama_cpp"] if "llama_cpp" in settings.peers else []
    if "prefill" in settings.scenarios:
        steps += ["prefill · tuichat"] + (["prefill · llama_cpp"] if "llama_cpp" in settings.peers else [])
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
    if "speculative" in settings.scenarios:
        steps += ["speculative · off and auto"]
    return steps
