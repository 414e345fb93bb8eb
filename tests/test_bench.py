"""`tuichat bench`: the machinery on the embedded model with tiny settings. Behaviour only (keys, types, list
lengths, cache accounting, ordering of percentiles, rendering, CLI wiring): never timing thresholds."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import shutil
import sys
import threading
import types
import urllib.request
from statistics import median

import pytest
from click.testing import CliRunner

from tests.helpers import RUNS_ON
from tuichat import bench
from tuichat.backends.local import chat_ids
from tuichat.backends.protocol import CHAT_SAMPLING, Message, TuichatError
from tuichat.bench.floor import BandwidthProbe
from tuichat.bench.peers.tuichat import _Tuichat
from tuichat.cli import main

TINY = dict(tabs=2, turns=2, single_tokens=4, tab_tokens=4, turn_tokens=6, probe_tokens=3, single_prompts=1,
            probes=1, stagger_ms=200, bandwidth_mb=16, spec_tokens=24, prefill_tokens=96, prefill_repeats=1)
# stagger_ms: the second tab must arrive once the first one's step has begun, or both are admitted in the
# same step and neither finds the other's system prompt cached (an idle engine first starts its thread).
FAST_PEERS = ("hf_generate", "hf_static_batch", "hf_generate_batch")

REQUIRED = [
    "model", "device", "dtype", "floor.tuichat.decode_step_ms", "floor.transformers.decode_step_ms",
    "scenarios.single.tuichat.ttft_ms", "scenarios.single.tuichat.decode_tokens_per_s",
    "scenarios.single.bare_forward_ms", "scenarios.single.tuichat_sampled.decode_tokens_per_s",
    "scenarios.prefill.tuichat.ttft_ms", "scenarios.prefill.tuichat.prompt_tokens_per_s",
    "scenarios.tabs.tuichat.tokens_per_s", "scenarios.tabs.tuichat.ttft_ms_p50", "scenarios.tabs.tuichat.ttft_ms_p90",
    "scenarios.tabs.tuichat.itl_ms_p50", "scenarios.tabs.tuichat.itl_ms_p90",
    "scenarios.tabs.modes.continuous.tokens_per_s", "scenarios.tabs.modes.static.tokens_per_s",
    "scenarios.tabs.modes.off.tokens_per_s",
    "scenarios.tabs.peers.hf_generate.tokens_per_s", "scenarios.tabs.peers.hf_static_batch.tokens_per_s",
    "scenarios.tabs.peers.hf_generate_batch.tokens_per_s",
    "scenarios.multiturn.cache_on.ttft_ms", "scenarios.multiturn.cache_off.ttft_ms",
    "scenarios.multiturn.cache_on.cached_fraction",
    "scenarios.shared_prefix.cache_on.ttft_ms_p50", "scenarios.shared_prefix.cache_off.ttft_ms_p50",
    "scenarios.interference.idle_ttft_ms", "scenarios.interference.loaded_ttft_ms",
]


def lookup(data, path):
    for key in path.split("."):
        assert isinstance(data, dict) and key in data, f"missing {path} (at {key})"
        data = data[key]
    return data


def positive(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


TORCH_WORK = [(bench.HFPeer, name) for name in ("__init__", "bare_forward_ms", "generate", "static_batch", "generate_batch")]
TORCH_WORK += [(BandwidthProbe, "__init__"), (BandwidthProbe, "sample")]


@pytest.fixture(scope="module")
def run(embedded, session_cache):
    """One tiny run of every scenario (the `embedded` fixture has converted the model into the session cache),
    with no llama-server to be found, recording the threads that ran bench torch work."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TUICHAT_CACHE_DIR", str(session_cache))
    mp.setenv("TUICHAT_LLAMA_SERVER", "/nonexistent/llama-server")
    threads = {"torch": [], "engine_alive": [], "alive_while_tuichat_runs": []}

    def recorded(fn):
        def wrapper(*args, **kwargs):
            threads["torch"].append(threading.current_thread())
            threads["engine_alive"].append(any(t.name.startswith(bench.ENGINE_THREAD) for t in threading.enumerate()))
            return fn(*args, **kwargs)
        return wrapper

    for owner, name in TORCH_WORK:
        mp.setattr(owner, name, recorded(getattr(owner, name)))
    mp.setattr(bench.scenarios, "measure_bandwidth", recorded(bench.measure_bandwidth))  # where the run looks it up
    tuichat_run = _Tuichat.run

    def checking_run(self, *args):
        threads["alive_while_tuichat_runs"] += [t for t in threads["torch"] if t.is_alive()]
        return tuichat_run(self, *args)

    mp.setattr(_Tuichat, "run", checking_run)
    try:
        settings = bench.BenchSettings.make(True, peers=FAST_PEERS + ("llama_cpp",), **TINY)
        err = io.StringIO()
        result = bench.run_bench(settings, err)
    finally:
        mp.undo()
    return result, err.getvalue(), threads


def test_json_has_every_required_key_with_sane_types(run):
    result = run[0]
    assert result["model"] == "smollm2-135m" and result["device"] == "cpu"
    assert result["dtype"] in ("bfloat16", "float32")
    for path in REQUIRED[3:]:
        value = lookup(result, path)
        if path.endswith(("ttft_ms", "cached_fraction")) and "multiturn" in path:
            assert len(value) == TINY["turns"]  # per turn: the next test checks the values
        else:
            assert positive(value), f"{path} = {value!r}"
    json.dumps(result, allow_nan=False)  # one plain JSON object, no NaN
    # The sampled row runs a chat's default: the embedded model recommends none, so tuichat's own.
    sampling = result["scenarios"]["single"]["tuichat_sampled"]["sampling"]
    assert {k: v for k, v in sampling.items() if v} == dict(CHAT_SAMPLING)
    # The TPOT target's floor: tuichat's bytes at the bandwidth read before and after each prompt's requests.
    single, during = result["scenarios"]["single"], result["scenarios"]["single"]["floor_during"]
    assert during["samples"] == 2 * single["prompts"] and during["weight_bytes"] == result["floor"]["tuichat"]["weight_bytes"]
    assert during["decode_step_ms"] == pytest.approx(during["weight_bytes"] / (during["bandwidth_gb_s"] * 1e9) * 1000)
    assert during["at_best_bandwidth_ms"] == pytest.approx(result["floor"]["tuichat"]["decode_step_ms"])


def test_per_turn_lists_have_one_entry_per_turn_and_the_cache_serves_turn_two(run):
    multi = run[0]["scenarios"]["multiturn"]
    for side in ("cache_on", "cache_off"):
        for key in ("ttft_ms", "cached_fraction", "prompt_tokens"):
            assert len(multi[side][key]) == TINY["turns"]
        assert all(positive(t) for t in multi[side]["ttft_ms"])
    on, off = multi["cache_on"]["cached_fraction"], multi["cache_off"]["cached_fraction"]
    assert all(f > 0 for f in on[1:]) and all(0 <= f <= 1 for f in on)
    assert off == [0.0] * TINY["turns"]
    # The replay compares like with like: cache off sees the same history, give or take a re-tokenized token.
    for a, b in zip(multi["cache_on"]["prompt_tokens"], multi["cache_off"]["prompt_tokens"]):
        assert abs(a - b) <= 2
    # Turn 2's prompt is turn 1's prompt plus its reply plus the new question.
    assert multi["cache_on"]["prompt_tokens"][1] > multi["cache_on"]["prompt_tokens"][0] + multi["reply_tokens"][0]


def test_shared_prefix_hits_only_with_the_cache_on(run):
    shared = run[0]["scenarios"]["shared_prefix"]
    assert max(shared["cache_on"]["cached_fraction"]) > 0.5  # the second tab reuses the long system prompt
    assert shared["cache_off"]["cached_fraction"] == [0.0] * TINY["tabs"]


def test_percentiles_are_ordered_and_counts_add_up(run):
    sc = run[0]["scenarios"]
    entries = list(sc["tabs"]["modes"].values()) + [p for p in sc["tabs"]["peers"].values() if "skipped" not in p]
    for entry in entries:
        assert entry["requests"] == TINY["tabs"]
        assert 0 < entry["output_tokens"] <= TINY["tabs"] * TINY["tab_tokens"]
        assert 0 < entry["in_flight_mean"] <= entry["requests"] + 1e-9  # no reply outlives the wall
        # Every request has a TTFT; gaps between tokens exist once some request got a second token.
        metrics = ("ttft_ms", "itl_ms", "tpot_ms") if entry["output_tokens"] > entry["requests"] else ("ttft_ms",)
        for metric in metrics:
            assert entry[f"{metric}_p50"] <= entry[f"{metric}_p90"], metric
    single = sc["single"]["tuichat"]
    assert 0 < single["output_tokens"][0] <= TINY["single_tokens"]
    if single["output_tokens"][0] > 1:
        assert single["itl_ms_p50"] <= single["itl_ms_p90"]
    shared = sc["shared_prefix"]
    for side in ("cache_on", "cache_off"):
        assert shared[side]["ttft_ms_p50"] <= shared[side]["ttft_ms_p90"]


def test_speculative_compares_off_and_auto_on_the_same_replies(run):
    spec = run[0]["scenarios"]["speculative"]
    assert spec["same_replies"] is True  # the bench's own check: every auto reply equals its off reply
    for kind in ("grounded", "open"):
        for mode in ("off", "auto"):
            assert positive(spec["modes"][mode][kind]["single"]["decode_tokens_per_s"])
            assert spec["modes"][mode][kind]["tabs"]["requests"] == TINY["tabs"]
        assert spec[f"{kind}_single_auto_over_off"] == pytest.approx(
            spec["modes"]["auto"][kind]["single"]["decode_tokens_per_s"] / spec["modes"]["off"][kind]["single"]["decode_tokens_per_s"])
    # Drafts were verified on the embedded GGUF's C layers, and the replies still matched.
    assert spec["modes"]["off"]["acceptance"] is None and spec["modes"]["auto"]["acceptance"] > 0
    assert spec["modes"]["off"]["tokens_per_step"] == 1  # switched off on the same engine, it drafts nothing
    assert spec["modes"]["auto"]["tokens_per_step"] > 1
    assert [t["name"] for t in run[0]["targets"] if t["name"].startswith("speculative")] and "speculative ·" in bench.render(run[0])


def test_tuichats_own_load_is_in_the_header(run):
    loaded = run[0]["memory"]["tuichat"]
    assert positive(loaded["load_s"]) and loaded["mapped_mb"] >= 0
    assert f"tuichat: loaded in {loaded['load_s']:.1f} s" in bench.render(run[0])


def test_prefill_sends_a_prompt_of_at_least_the_asked_length(run, embedded):
    prefill = run[0]["scenarios"]["prefill"]
    assert TINY["prefill_tokens"] <= prefill["prompt_tokens"] < TINY["prefill_tokens"] + 64  # whole sentences
    assert len(prefill["tuichat"]["ttft_ms_each"]) == TINY["prefill_repeats"]
    assert prefill["tuichat"]["prompt_tokens_per_s"] == pytest.approx(
        prefill["prompt_tokens"] / prefill["tuichat"]["ttft_ms"] * 1000)
    assert "prefill · one prompt of" in bench.render(run[0])


def test_interference_probes_while_others_decode(run):
    inter = run[0]["scenarios"]["interference"]
    assert inter["decoding_at_submit"] and all(n >= 1 for n in inter["decoding_at_submit"])
    assert positive(inter["loaded_over_idle"])


def test_no_llama_server_is_a_skip_note_with_a_build_hint(run):
    result = run[0]
    for scenario in ("single", "prefill", "tabs", "multiturn"):
        skipped = result["scenarios"][scenario]["peers"]["llama_cpp"]["skipped"]
        assert "no executable llama-server at /nonexistent/llama-server" in skipped
        assert "cmake --build build --target llama-server" in skipped and "GGML_AMX_TILE=OFF" in skipped
    assert any(note.startswith("llama_cpp skipped: ") for note in bench.skipped_notes(result))
    assert "llama_server" not in result["versions"]


def test_the_llama_server_is_found_from_the_flag_the_environment_or_path(monkeypatch, tmp_path):
    gguf = types.SimpleNamespace(kind="gguf", name="m")
    monkeypatch.delenv("TUICHAT_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", "")
    binary, why = bench.find_llama_server(None, gguf)
    assert binary is None and "no llama-server on PATH" in why and "cmake --build build --target llama-server" in why
    server = tmp_path / "llama-server"
    server.write_text("#!/bin/sh\n")
    server.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert bench.find_llama_server(None, gguf) == (str(server), None)
    monkeypatch.setenv("PATH", "")
    monkeypatch.setenv("TUICHAT_LLAMA_SERVER", str(server))
    assert bench.find_llama_server(None, gguf) == (str(server), None)
    assert bench.find_llama_server(str(tmp_path / "other"), gguf)[0] is None  # the flag wins over the environment
    binary, why = bench.find_llama_server(str(server), types.SimpleNamespace(kind="local", name="folder"))
    assert binary is None and ".gguf" in why


LLAMA_SERVER = shutil.which(os.environ.get("TUICHAT_LLAMA_SERVER") or "llama-server")
needs_llama_server = pytest.mark.skipif(LLAMA_SERVER is None, reason="no llama-server (set TUICHAT_LLAMA_SERVER or "
                                        f"put one on PATH): runs on {RUNS_ON['llama-server']}")


def record_servers(monkeypatch, kind=bench.LlamaServerPeer) -> list:
    servers = []
    init = kind.__init__

    def recording(self, *args, **kwargs):
        servers.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(kind, "__init__", recording)
    return servers


@needs_llama_server
def test_llama_server_peer_on_loopback(embedded, session_cache, monkeypatch):
    """A real run against llama-server: its numbers are there, its streamed greedy reply equals the server's own
    non-streamed /completion for the same ids (an independent reference), and the server is gone afterwards."""
    import torch

    monkeypatch.setenv("TUICHAT_CACHE_DIR", str(session_cache))
    servers = record_servers(monkeypatch)
    settings = bench.BenchSettings.make(True, scenarios=("single", "prefill", "tabs", "multiturn"), peers=("llama_cpp",),
                                        llama_server=LLAMA_SERVER, **TINY)
    result = bench.run_bench(settings, io.StringIO(), show_progress=False)
    assert len(servers) == 1 and servers[0].process.poll() is not None  # started once, stopped
    assert servers[0].command[servers[0].command.index("-np") + 1] == str(TINY["tabs"])
    sc = result["scenarios"]
    single, prefill, tabs, multi = (sc[name]["peers"]["llama_cpp"] for name in ("single", "prefill", "tabs", "multiturn"))
    assert positive(single["ttft_ms"]) and positive(single["decode_tokens_per_s"])
    assert positive(prefill["prompt_tokens_per_s"]) and len(prefill["ttft_ms_each"]) == TINY["prefill_repeats"]
    assert tabs["requests"] == TINY["tabs"] and positive(tabs["tokens_per_s"]) and positive(tabs["ttft_ms_p50"])
    assert len(multi["ttft_ms"]) == TINY["turns"] and all(positive(t) for t in multi["ttft_ms"])
    assert multi["cached_fraction"][1] > 0.5  # the slot kept the history
    assert all(t["value"] is not None for t in result["targets"] if "llama_cpp" in t["name"])
    assert result["versions"]["llama_server"] and "llama_cpp" in bench.render(result)

    resolved, _, _, tokenizer = embedded
    prompt = chat_ids(tokenizer, [Message("user", bench.SINGLE_QUESTIONS[0])])
    reference = bench.LlamaServerPeer(LLAMA_SERVER, resolved.source, torch.get_num_threads(), settings.tabs,
                                      settings.llama_slot_ctx, prompt[:8])
    try:
        body = {"prompt": prompt, "n_predict": settings.single_tokens, "temperature": 0, "cache_prompt": False}
        request = urllib.request.Request(f"http://127.0.0.1:{reference.port}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            expected = json.loads(response.read())["content"]
    finally:
        reference.close()
    assert single["replies"][0] == expected and expected
    assert reference.process.poll() is not None


def test_the_tabs_through_tuichat_serve(embedded, session_cache, monkeypatch):
    """The same engine behind a real `tuichat serve`: the tabs' figures and the HTTP-against-in-process targets
    are there, the streamed reply parsed is the server's own non-streamed one, and the server is gone after."""
    from tuichat.bench.peers.serve import ServePeer

    monkeypatch.setenv("TUICHAT_CACHE_DIR", str(session_cache))
    servers = record_servers(monkeypatch, ServePeer)
    settings = bench.BenchSettings.make(True, scenarios=("tabs",), peers=("tuichat_serve",), **TINY)
    result = bench.run_bench(settings, io.StringIO(), show_progress=False)
    assert len(servers) == 1 and servers[0].process.poll() is not None  # started once, stopped
    assert servers[0].command[-2:] == ["--kv-cache-mb", str(settings.default_kv_cache_mb)]  # the bench's options
    served = result["scenarios"]["tabs"]["peers"]["tuichat_serve"]
    assert served["requests"] == TINY["tabs"] and positive(served["tokens_per_s"]) and positive(served["ttft_ms_p50"])
    assert all(t["value"] is not None for t in result["targets"] if "tuichat serve" in t["name"])
    assert "tuichat_serve" in bench.render(result)

    question = [Message("user", bench.QUESTIONS[0])]
    peer = ServePeer(settings.model, settings.engine_options(), question)
    try:
        streamed = peer.generate(question, 12)
        body = {"model": settings.model, "messages": [{"role": "user", "content": bench.QUESTIONS[0]}],
                "temperature": 0, "max_tokens": 12}
        request = urllib.request.Request(f"http://127.0.0.1:{peer.port}/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            whole = json.loads(response.read())
    finally:
        peer.close()
    assert streamed.text == whole["choices"][0]["message"]["content"] and streamed.text
    assert streamed.tokens == whole["usage"]["completion_tokens"] and streamed.cached_tokens > 0  # the warm-up's prefix
    assert peer.process.poll() is not None


@needs_llama_server
def test_the_llama_server_stops_when_the_bench_is_interrupted(embedded, session_cache, monkeypatch):
    monkeypatch.setenv("TUICHAT_CACHE_DIR", str(session_cache))
    servers = record_servers(monkeypatch)
    generate = bench.LlamaServerPeer.generate
    calls = []

    def interrupted(self, *args, **kwargs):
        calls.append(args)
        if len(calls) > 1:  # after the warm-up: Ctrl-C in the middle of the scenario
            raise KeyboardInterrupt
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(bench.LlamaServerPeer, "generate", interrupted)
    settings = bench.BenchSettings.make(True, scenarios=("single",), peers=("llama_cpp",), llama_server=LLAMA_SERVER,
                                        **TINY)
    with pytest.raises(KeyboardInterrupt):
        bench.run_bench(settings, io.StringIO(), show_progress=False)
    assert len(servers) == 1 and servers[0].process.poll() is not None


def test_a_llama_server_that_cannot_start_says_why_and_is_gone(tmp_path):
    server = tmp_path / "llama-server"
    server.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 3\n")
    server.chmod(0o755)
    with pytest.raises(TuichatError, match="exited with status 3: error: failed to load model"):
        bench.LlamaServerPeer(str(server), "/no/model.gguf", threads=1, slots=1, slot_ctx=512, warmup=[1])


def test_bench_torch_work_runs_on_threads_that_end_with_it(run):
    """libgomp keeps an OpenMP pool per live thread that ran torch; a second live pool doubles tuichat's step.
    So no peer load, forward or bandwidth sum runs on the main thread, none of their threads is alive while
    tuichat is measured, and none of them runs while an engine thread (with its pool) lives."""
    threads = run[2]
    assert threads["torch"] and threading.main_thread() not in threads["torch"]
    assert threads["alive_while_tuichat_runs"] == []
    assert not any(threads["engine_alive"])


def test_targets_are_the_scenarios_ratios_and_say_whether_each_holds(run):
    """Each target's value from the samples the result keeps (tokens over walls, each probe's, turn's and
    forward's time, the bandwidth samples), not from the rates, medians and ratios the bench worked out; and
    `ok` on the side the target's meaning says is better: more tokens a second, less time, a cache that helps."""
    result = run[0]
    sc = result["scenarios"]
    tabs, multi, single, inter, spec = (sc[name] for name in ("tabs", "multiturn", "single", "interference", "speculative"))
    ours, off, auto = single["tuichat"], spec["modes"]["off"], spec["modes"]["auto"]

    def rate(entry) -> float:
        return entry["output_tokens"] / entry["wall_s"]

    on_ttft, off_ttft = multi["cache_on"]["ttft_ms"], multi["cache_off"]["ttft_ms"]
    floor_ms = result["floor"]["tuichat"]["weight_bytes"] / (median(single["floor_during"]["samples_gb_s"]) * 1e9) * 1000
    assert TINY["single_prompts"] == 1  # one prompt: a ratio of decode rates is the inverse ratio of its TPOTs
    expected = [  # (value, the better side)
        (rate(tabs["tuichat"]) / rate(tabs["peers"]["hf_static_batch"]), "higher"),
        (rate(tabs["tuichat"]) / rate(tabs["peers"]["hf_generate_batch"]), "higher"),
        (on_ttft[-1] / on_ttft[0], "lower"),
        (off_ttft[-1] / on_ttft[-1], "higher"),
        (median(inter["loaded_ttft_ms_each"]) / median(inter["idle_ttft_ms_each"]), "lower"),
        (median(ours["ttft_ms_each"]) / median(single["bare_forward_ms_each"]), "lower"),
        (single["peers"]["hf_generate"]["tpot_ms"] / ours["tpot_ms"], "higher"),
        (auto["grounded"]["single"]["decode_tokens_per_s"] / off["grounded"]["single"]["decode_tokens_per_s"], "higher"),
        (rate(auto["grounded"]["tabs"]) / rate(off["grounded"]["tabs"]), "higher"),
        (off["grounded"]["tabs"]["tpot_ms_p50"] / auto["grounded"]["tabs"]["tpot_ms_p50"], "higher"),
        (auto["open"]["single"]["decode_tokens_per_s"] / off["open"]["single"]["decode_tokens_per_s"], "higher"),
        (rate(auto["open"]["tabs"]) / rate(off["open"]["tabs"]), "higher"),
        (ours["tpot_ms"] / floor_ms, "lower"),
    ]
    targets = result["targets"]
    measured = [t for t in targets if "llama_cpp" not in t["name"] and "tuichat serve" not in t["name"]]
    assert [t["value"] for t in measured] == pytest.approx([value for value, _ in expected])
    for t, (value, better) in zip(measured, expected):  # reported, not asserted: whichever way it went, `ok` says so
        op, bound = t["target"].split()
        assert op == {"higher": ">=", "lower": "<="}[better], t["name"]
        assert t["ok"] is (value >= float(bound) if better == "higher" else value <= float(bound)), t["name"]
    llama = [t for t in targets if "llama_cpp" in t["name"]]  # no llama-server in this run: nothing to say
    assert len(llama) == 4 and all(t["value"] is None and t["ok"] is None for t in llama)
    served = [t for t in targets if "tuichat serve" in t["name"]]  # nor tuichat serve (its own test runs it)
    assert len(served) == 2 and all(t["value"] is None and t["ok"] is None for t in served)


def test_table_renders_every_scenario_and_the_progress_went_to_stderr(run):
    result, progress, _ = run
    table = bench.render(result)
    for title in ("single", "prefill", "tabs", "multiturn", "shared_prefix", "interference", "floor at", "targets"):
        assert title in table
    weights = result["floor"]["tuichat"]["weights"]
    assert weights == result["weights"] and f"weights {weights}" in table.splitlines()[0]
    assert result["quant"] == "auto" and f"quant auto · weights {weights}" in table.splitlines()[0]
    assert f"tuichat reads {result['floor']['tuichat']['weight_bytes'] / 1e6:,.0f} MB ({weights})" in table
    assert f"transformers reads {result['floor']['transformers']['weight_bytes'] / 1e6:,.0f} MB" in table
    for name in ("tuichat continuous", "tuichat static", "tuichat off", "hf_static_batch", "hf_generate_batch",
                 "bare forward"):
        assert name in table
    assert "tabs · tuichat static" in progress and "interference" in progress


def test_settings_and_lists_are_validated():
    assert bench.parse_list("all", bench.SCENARIOS, "scenario") == bench.SCENARIOS
    assert bench.parse_list("none", bench.PEERS, "peer") == ()
    assert bench.parse_list("tabs, single,tabs", bench.SCENARIOS, "scenario") == ("tabs", "single")
    assert bench.parse_list("shared-prefix", bench.SCENARIOS, "scenario") == ("shared_prefix",)
    with pytest.raises(TuichatError, match="Unknown scenario"):
        bench.parse_list("single,bogus", bench.SCENARIOS, "scenario")
    quick, full = bench.BenchSettings.make(True), bench.BenchSettings.make(False)
    assert quick.turns < full.turns == 8 and quick.tabs == full.tabs == 8
    assert quick.tab_tokens == full.tab_tokens  # short replies would make tabs measure the arrival schedule
    assert bench.BenchSettings.make(True, turns=3).turns == 3
    assert full.engine_options().kv_cache_mb == full.default_kv_cache_mb


def test_percentile_and_summary():
    assert bench.percentile([], 0.5) is None
    assert bench.percentile([3.0, 1.0, 2.0, None], 0.5) == 2.0
    assert bench.percentile([0.0, 10.0], 0.9) == pytest.approx(9.0)
    r = bench.RequestResult(submitted=0.0, ttft_ms=100.0, e2e_ms=400.0, tokens=4, itl_ms=[100.0, 100.0, 100.0])
    assert r.tpot_ms == 100.0 and r.decode_tokens_per_s == 10.0
    summary = bench.summarize([r, r], wall_s=2.0)
    assert summary["tokens_per_s"] == 4.0 and summary["itl_ms_p50"] == 100.0
    assert summary["in_flight_mean"] is None  # no end times, no concurrency
    # Replies live [0, 1] and [0.5, 1.5]: over the 1.5 s they overlap, 2 s of replies were in flight.
    a = bench.RequestResult(submitted=10.0, finished=11.0, tokens=4)
    b = bench.RequestResult(submitted=10.5, finished=11.5, tokens=4)
    assert bench.summarize([a, b], wall_s=1.5)["in_flight_mean"] == pytest.approx(2.0 / 1.5)


def test_progress_bar_lines_without_a_terminal():
    out = io.StringIO()
    progress = bench.Progress(2, out)
    with progress.step("first"):
        pass
    with progress.step("second"):
        pass
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[bench 0/2") and "first" in lines[0] and "50%" in lines[1]


def test_cli_bench_json(embedded):
    args = ["bench", "--json", "--quick", "--scenarios", "single,multiturn", "--peers", "none",
            "--tabs", "2", "--turns", "2", "--max-tokens", "4", "--stagger-ms", "0"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output + result.stderr
    data = json.loads(result.stdout)
    assert set(data["scenarios"]) == {"single", "multiturn"}
    assert len(data["scenarios"]["multiturn"]["cache_on"]["ttft_ms"]) == 2
    assert data["scenarios"]["single"]["peers"] == {} and positive(data["scenarios"]["single"]["bare_forward_ms"])
    assert data["settings"]["peers"] == [] and data["settings"]["turn_tokens"] == 4
    assert data["settings"]["stagger_ms"] == 0
    assert positive(data["floor"]["tuichat"]["decode_step_ms"]) and positive(data["floor"]["transformers"]["weight_bytes"])
    assert "[bench" in result.stderr  # the progress bar, never on stdout


def test_cli_bench_rejects_bad_input_in_one_line(embedded, monkeypatch):
    runner = CliRunner()
    bad = runner.invoke(main, ["bench", "--scenarios", "single,warp"])
    assert bad.exit_code == 2 and "Unknown scenario" in bad.stderr and "Traceback" not in bad.output
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the plot extra were not installed
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else object())
    no_plot = runner.invoke(main, ["bench", "--plot", "out.png", "--scenarios", "single"])
    assert no_plot.exit_code == 2 and "pip install 'tuichat[plot]'" in no_plot.stderr


def test_plot_writes_a_png_when_matplotlib_is_there(run, tmp_path):
    pytest.importorskip("matplotlib", reason="no plot extra (pip install 'tuichat[plot]'): CI installs none on any "
                        "machine kind; runs on any kind that has it")
    path = tmp_path / "bench.png"
    bench.plot(run[0], str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_batching_peers_get_the_tabs_arrivals(embedded, session_cache, monkeypatch):
    """A static batch cannot start before its last prompt arrives; generate_batch gets each prompt on arrival.
    TTFTs count from each request's own arrival."""
    import torch

    monkeypatch.setenv("TUICHAT_CACHE_DIR", str(session_cache))
    resolved, _, _, tokenizer = embedded
    peer = bench.HFPeer(resolved, torch.device("cpu"), torch.float32)
    prompts = [chat_ids(tokenizer, [Message("user", q)]) for q in bench.QUESTIONS[:3]]
    stagger = 0.3
    try:
        # (No bound on how fast: a sleep may overrun on a busy machine, never end early.)
        results, wall = peer.static_batch(prompts, 2, stagger_s=stagger)
        assert wall >= 2 * stagger
        arrivals = [r.submitted for r in results]
        assert all(b - a >= stagger - 0.005 for a, b in zip(arrivals, arrivals[1:]))
        # All rows get their first token in the same step: the first arrival waited for the last.
        assert results[0].ttft_ms - results[2].ttft_ms == pytest.approx((arrivals[2] - arrivals[0]) * 1000, abs=1)
        waited = results[0].ttft_ms
        results, wall = peer.generate_batch(prompts, 2, stagger_s=stagger)
        arrivals = sorted(r.submitted for r in results)
        assert all(b - a >= stagger - 0.005 for a, b in zip(arrivals, arrivals[1:]))
        first = min(results, key=lambda r: r.submitted)
        assert wall >= 2 * stagger and first.ttft_ms < waited  # it did not wait for the last arrival
    finally:
        peer.close()
