"""`tuichat bench`: the machinery on the embedded model with tiny settings. Behaviour only (keys, types, list
lengths, cache accounting, ordering of percentiles, rendering, CLI wiring): never timing thresholds."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import sys
import types

import pytest
from click.testing import CliRunner

from tuichat import bench
from tuichat.backend import BackendError
from tuichat.cli import main

TINY = dict(tabs=2, turns=2, single_tokens=4, tab_tokens=4, turn_tokens=6, probe_tokens=3, single_prompts=1,
            probes=1, stagger_ms=5, bandwidth_mb=16)
FAST_PEERS = ("hf_generate", "hf_static_batch", "hf_generate_batch")

REQUIRED = [
    "model", "device", "dtype", "floor.decode_step_ms",
    "scenarios.single.tuichat.ttft_ms", "scenarios.single.tuichat.decode_tokens_per_s",
    "scenarios.single.bare_forward_ms",
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


@pytest.fixture(scope="module")
def run(embedded, session_cache):
    """One tiny run of every scenario (the `embedded` fixture has converted the model into the session cache)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TUICHAT_CACHE_DIR", str(session_cache))
    try:
        settings = bench.BenchSettings.make(True, peers=FAST_PEERS + ("llama_cpp",), **TINY)
        err = io.StringIO()
        result = bench.run_bench(settings, err)
    finally:
        mp.undo()
    return result, err.getvalue()


def test_json_has_every_required_key_with_sane_types(run):
    result, _ = run
    assert result["model"] == "smollm2-135m" and result["device"] == "cpu"
    assert result["dtype"] in ("bfloat16", "float32")
    for path in REQUIRED[3:]:
        value = lookup(result, path)
        if path.endswith(("ttft_ms", "cached_fraction")) and "multiturn" in path:
            assert len(value) == TINY["turns"]  # per turn: the next test checks the values
        else:
            assert positive(value), f"{path} = {value!r}"
    json.dumps(result, allow_nan=False)  # one plain JSON object, no NaN


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


def test_interference_probes_while_others_decode(run):
    inter = run[0]["scenarios"]["interference"]
    assert inter["decoding_at_submit"] and all(n >= 1 for n in inter["decoding_at_submit"])
    assert positive(inter["loaded_over_idle"])


def test_llama_cpp_runs_when_installed_and_is_a_note_when_not(run):
    result, _ = run
    peer = result["scenarios"]["tabs"]["peers"]["llama_cpp"]
    if importlib.util.find_spec("llama_cpp") is None:  # the embedded model is a .gguf: only the package can lack
        assert "llama-cpp-python" in peer["skipped"] and peer["tokens_per_s"] is None
        assert any("llama_cpp skipped" in note for note in bench.skipped_notes(result))
    else:
        assert "skipped" not in peer and positive(peer["tokens_per_s"])


def test_targets_are_the_scenarios_ratios_and_say_whether_each_holds(run):
    sc = run[0]["scenarios"]
    tabs, multi, single, inter = sc["tabs"], sc["multiturn"], sc["single"], sc["interference"]
    ours = tabs["tuichat"]["tokens_per_s"]
    expected = [
        ours / tabs["peers"]["hf_static_batch"]["tokens_per_s"],
        ours / tabs["peers"]["hf_generate_batch"]["tokens_per_s"],
        multi["cache_on"]["ttft_ms"][-1] / multi["cache_on"]["ttft_ms"][0],
        multi["cache_off"]["ttft_ms"][-1] / multi["cache_on"]["ttft_ms"][-1],
        inter["loaded_ttft_ms"] / inter["idle_ttft_ms"],
        single["tuichat"]["ttft_ms"] / single["bare_forward_ms"],
        single["tuichat"]["decode_tokens_per_s"] / single["peers"]["hf_generate"]["decode_tokens_per_s"],
    ]
    targets = run[0]["targets"]
    assert [t["value"] for t in targets] == pytest.approx(expected)
    for t in targets:  # reported, not asserted: whichever way it went, `ok` says so
        op, bound = t["target"].split()
        assert t["ok"] is (t["value"] >= float(bound) if op == ">=" else t["value"] <= float(bound)), t["name"]


def test_table_renders_every_scenario_and_the_progress_went_to_stderr(run):
    result, progress = run
    table = bench.render(result)
    for title in ("single", "tabs", "multiturn", "shared_prefix", "interference", "floor:", "targets"):
        assert title in table
    for name in ("tuichat continuous", "tuichat static", "tuichat off", "hf_static_batch", "hf_generate_batch",
                 "bare forward"):
        assert name in table
    assert "tabs · tuichat static" in progress and "interference" in progress


def test_llama_cpp_peer_through_a_stand_in_module(monkeypatch):
    """The llama.cpp path without compiling llama.cpp: a fake `llama_cpp` module with the same API."""
    calls = []

    class Llama:
        def __init__(self, model_path, **kwargs):
            calls.append(("init", model_path, kwargs["n_threads"]))

        def reset(self):
            calls.append(("reset",))

        def create_completion(self, prompt, max_tokens, temperature, stream):
            assert stream and temperature == 0.0 and isinstance(prompt, list)
            for piece in ["Hel", "lo", "!"][:max_tokens]:
                yield {"choices": [{"text": piece, "finish_reason": None}]}
            yield {"choices": [{"text": "", "finish_reason": "stop"}]}

    module = types.ModuleType("llama_cpp")
    module.Llama = Llama
    module.__spec__ = types.SimpleNamespace(name="llama_cpp")
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    resolved = types.SimpleNamespace(kind="gguf", source="/models/x.gguf")
    assert bench.llama_cpp_missing(resolved) is None
    assert "gguf" in bench.llama_cpp_missing(types.SimpleNamespace(kind="local", source="/m"))
    peer = bench.LlamaCppPeer("/models/x.gguf", threads=2, gpu=False)
    result = peer.generate(list(range(20)), 16)
    assert result.tokens == 4 and result.text == "Hello!" and result.finish_reason == "stop"  # 3 pieces + EOS
    assert result.ttft_ms > 0 and len(result.itl_ms) == 2
    assert calls[0] == ("init", "/models/x.gguf", 2) and ("reset",) in calls
    peer.close()


def test_settings_and_lists_are_validated():
    assert bench.parse_list("all", bench.SCENARIOS, "scenario") == bench.SCENARIOS
    assert bench.parse_list("none", bench.PEERS, "peer") == ()
    assert bench.parse_list("tabs, single,tabs", bench.SCENARIOS, "scenario") == ("tabs", "single")
    assert bench.parse_list("shared-prefix", bench.SCENARIOS, "scenario") == ("shared_prefix",)
    with pytest.raises(BackendError, match="Unknown scenario"):
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
    assert positive(data["floor"]["decode_step_ms"])
    assert "[bench" in result.stderr  # the progress bar, never on stdout


def test_cli_bench_rejects_bad_input_in_one_line(embedded, monkeypatch):
    runner = CliRunner()
    bad = runner.invoke(main, ["bench", "--scenarios", "single,warp"])
    assert bad.exit_code == 2 and "Unknown scenario" in bad.stderr and "Traceback" not in bad.output
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the plot extra were not installed
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else object())
    no_plot = runner.invoke(main, ["bench", "--plot", "out.png", "--scenarios", "single"])
    assert no_plot.exit_code == 2 and "pip install 'tuichat[plot]'" in no_plot.stderr


def test_plot_writes_a_png_when_matplotlib_is_there(run, tmp_path):
    pytest.importorskip("matplotlib")
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
    prompts = [bench.chat_ids(tokenizer, [bench.Message("user", q)]) for q in bench.QUESTIONS[:3]]
    stagger = 0.3
    try:
        results, wall = peer.static_batch(prompts, 2, stagger_s=stagger)
        assert wall >= 2 * stagger
        arrivals = [r.submitted for r in results]
        assert all(b - a == pytest.approx(stagger, abs=0.02) for a, b in zip(arrivals, arrivals[1:]))
        # All rows get their first token in the same step: the first arrival waited two staggers longer.
        assert results[0].ttft_ms - results[2].ttft_ms == pytest.approx(2 * stagger * 1000, abs=20)
        results, wall = peer.generate_batch(prompts, 2, stagger_s=stagger)
        arrivals = sorted(r.submitted for r in results)
        assert all(b - a >= stagger - 0.02 for a, b in zip(arrivals, arrivals[1:]))
        first = min(results, key=lambda r: r.submitted)
        assert wall >= 2 * stagger and first.ttft_ms < 2 * stagger * 1000  # it began before the last arrival
    finally:
        peer.close()
