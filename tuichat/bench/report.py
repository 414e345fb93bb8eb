"""What a run's result says: the issue's targets, the tables, the notes on skipped peers, the plot."""

from __future__ import annotations

import importlib.util
import io
import math
import statistics
from typing import Any, TextIO

from rich.console import Console, RenderableType
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from tuichat.backends.protocol import TuichatError
from tuichat.bench.stats import median, ratio


def _get(data: dict, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def _minus(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, reported (never asserted): value, bound, and whether it holds."""
    sc = result.get("scenarios", {})
    single, tabs, multi, inter = sc.get("single", {}), sc.get("tabs", {}), sc.get("multiturn", {}), sc.get("interference", {})
    prefill = sc.get("prefill", {})
    spec = sc.get("speculative", {})
    rows = [
        ("tabs: continuous tok/s ÷ hf_static_batch", _get(tabs, "peers.hf_static_batch.tuichat_over"), ">=", 1.5),
        ("tabs: continuous tok/s ÷ hf_generate_batch", _get(tabs, "peers.hf_generate_batch.tuichat_over"), ">=", 3.0),
        ("multiturn: last-turn ÷ first-turn TTFT, cache on", multi.get("last_over_first_cache_on"), "<=", 1.5),
        ("multiturn: last-turn TTFT cache off ÷ on", multi.get("off_over_on_last_turn"), ">=", 5.0),
        ("interference: loaded ÷ idle TTFT", inter.get("loaded_over_idle"), "<=", 3.0),
        ("single: TTFT ÷ bare forward", single.get("ttft_over_bare_forward"), "<=", 1.15),
        ("single: decode tok/s ÷ hf_generate",
         ratio(_get(single, "tuichat.decode_tokens_per_s"), _get(single, "peers.hf_generate.decode_tokens_per_s")), ">=", 1.5),
        ("single: decode tok/s ÷ llama_cpp",
         ratio(_get(single, "tuichat.decode_tokens_per_s"), _get(single, "peers.llama_cpp.decode_tokens_per_s")), ">=", 1.0),
        ("single: TTFT ÷ llama_cpp", ratio(_get(single, "tuichat.ttft_ms"), _get(single, "peers.llama_cpp.ttft_ms")), "<=", 0.5),
        ("prefill: ~1k-token prompt, tokens/s ÷ llama_cpp", ratio(_get(prefill, "tuichat.prompt_tokens_per_s"),
                                                                 _get(prefill, "peers.llama_cpp.prompt_tokens_per_s")), ">=", 2.0),
        ("tabs: continuous tok/s ÷ llama_cpp (parallel slots)", _get(tabs, "peers.llama_cpp.tuichat_over"), ">=", 3.0),
        ("tabs: over HTTP (tuichat serve) ÷ in process, tok/s",
         ratio(_get(tabs, "peers.tuichat_serve.tokens_per_s"), _get(tabs, "tuichat.tokens_per_s")), ">=", 0.9),
        ("tabs: over HTTP (tuichat serve) - in process, TTFT p50 (ms)",
         _minus(_get(tabs, "peers.tuichat_serve.ttft_ms_p50"), _get(tabs, "tuichat.ttft_ms_p50")), "<=", 15.0),
        ("speculative: grounded, one stream, auto ÷ off decode tok/s", _get(spec, "grounded_single_auto_over_off"), ">=", 1.8),
        ("speculative: grounded, tabs, auto ÷ off tok/s", _get(spec, "grounded_tabs_auto_over_off"), ">=", 1.3),
        ("speculative: grounded, tabs, auto ÷ off a tab's decode tok/s (p50)", _get(spec, "grounded_tab_decode_auto_over_off"), ">=", 1.3),
        ("speculative: open-ended, one stream, auto ÷ off decode tok/s", _get(spec, "open_single_auto_over_off"), ">=", 0.95),
        ("speculative: open-ended, tabs, auto ÷ off tok/s", _get(spec, "open_tabs_auto_over_off"), ">=", 0.95),
        ("single: decode step (TPOT, batch 1) ÷ its bytes-read floor at the bandwidth around its requests",
         ratio(_get(single, "tuichat.tpot_ms"), _get(single, "floor_during.decode_step_ms")), "<=", 1.5),
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


def _table(headers: list[str], rows: list[list[str | Text]]) -> Padding:
    """Labels left, numbers right, two spaces between columns and no rules: it reads the same as plain text."""
    table = Table(box=None, pad_edge=False)
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    return Padding(table, (0, 0, 0, 2), expand=False)


def _skipped(name: str, columns: int) -> list[str | Text]:
    """The reason would widen its column for every row: the notes under the report give it."""
    return [name, Text("skipped", style="dim")] + [""] * (columns - 2)


def _header(result: dict[str, Any]) -> list[RenderableType]:
    floor = result.get("floor", {})
    llama = result["versions"].get("llama_server")
    lines: list[RenderableType] = [
        Text(f"tuichat bench · {result['model']} · {result['device']} {result['dtype']} · "
             f"quant {result.get('quant') or '?'} · weights {result.get('weights') or '?'} · "
             f"torch {result['versions']['torch']} · {result['machine']['torch_threads']} threads · "
             f"matmul {result['machine'].get('decode_matmul', '?')} · layers {result['machine'].get('decode_layers', '?')}"
             f"{f' · llama-server {llama}' if llama else ''}{' · quick' if result.get('quick') else ''} · "
             f"{result.get('wall_s', 0):.0f} s", style="bold"),
        Text(f"floor at {_fmt(floor.get('bandwidth_gb_s'))} GB/s, one read of the weights per decode step (batch 1):"),
    ]
    for who, f in (("tuichat reads", floor.get("tuichat")), ("transformers reads", floor.get("transformers"))):
        if f:
            lines.append(Text(f"  {who} {f['weight_bytes'] / 1e6:,.0f} MB ({f['weights']}) = "
                              f"{_fmt(f['decode_step_ms'], 2)} ms a step ({_fmt(f['decode_tokens_per_s'], 0)} tok/s)"))
    if (m := result.get("memory", {}).get("tuichat")) is not None:
        in_place = (f" · {m['mapped_mb']:,.0f} MB read in place from the file, {m.get('huge_page_mb') or 0:,.0f} MB of the "
                    f"file mapped in 2 MB pages") if m.get("mapped_mb") else ""
        lines.append(Text(f"  tuichat: loaded in {m['load_s']:.1f} s{in_place} (in the bench's process; "
                          "its RSS alone: --peers tuichat_serve)"))
    for who, m in (("tuichat serve", result.get("memory", {}).get("tuichat_serve")),
                   ("llama-server", result.get("memory", {}).get("llama_server"))):
        if m:  # each a server process of its own on the same file: its start to ready, its memory at the end
            rss = f" · RSS {m['rss_mb']:,.0f} MB, peak {m['peak_rss_mb']:,.0f} MB" if "rss_mb" in m else ""
            lines.append(Text(f"  {who}: ready {m['ready_s']:.1f} s after start{rss}"))
    lines.append(Text("ratios are tuichat ÷ the row: above 1 is better for tok/s, below 1 is better for TTFT; times in ms"))
    return lines


def _single(s: dict[str, Any]) -> list[RenderableType]:
    t = s["tuichat"]
    headers = ["", "TTFT ms", "ITL p50", "ITL p90", "decode tok/s", "TTFT ÷", "tok/s ÷"]
    rows = [["tuichat", _fmt(t["ttft_ms"]), _fmt(t["itl_ms_p50"]), _fmt(t["itl_ms_p90"]), _fmt(t["decode_tokens_per_s"]), "", ""]]
    if (c := s.get("tuichat_sampled")) is not None:
        rows.append(["tuichat, a chat's sampling", _fmt(c["ttft_ms"]), _fmt(c["itl_ms_p50"]), _fmt(c["itl_ms_p90"]),
                     _fmt(c["decode_tokens_per_s"]), "", ""])
    rows.append(["bare forward (transformers)", _fmt(s["bare_forward_ms"]), "", "", "", _x(s["ttft_over_bare_forward"]), ""])
    for name, p in s["peers"].items():
        if "skipped" in p:
            rows.append(_skipped(name, len(headers)))
        else:
            rows.append([name, _fmt(p["ttft_ms"]), _fmt(p["itl_ms_p50"]), _fmt(p["itl_ms_p90"]), _fmt(p["decode_tokens_per_s"]),
                         _x(ratio(t["ttft_ms"], p["ttft_ms"])), _x(ratio(t["decode_tokens_per_s"], p["decode_tokens_per_s"]))])
    lines = [Text(f"single · one conversation, {s['prompts']} prompts of ~{median(s['prompt_tokens']) or 0:.0f} tokens, "
                  f"≤{s['max_tokens']} tokens, medians (prefix cache and speculation off; greedy but one row)", style="bold"),
             _table(headers, rows)]
    if (c := s.get("tuichat_sampled")) is not None:
        chosen = ", ".join(f"{k} {v:g}" for k, v in c["sampling"].items() if v)
        lines.append(Text(f"  a chat's sampling: {chosen}, seed 0"))
    if (f := s.get("floor_during")) is not None:
        lines.append(Text(f"  floor at the bandwidth around these requests ({_fmt(f['bandwidth_gb_s'])} GB/s, median of "
                          f"{f['samples']}, each the best of 3 reads): {_fmt(f['decode_step_ms'], 2)} ms a step; TPOT {_fmt(t['tpot_ms'], 2)} ms "
                          f"is {_x(ratio(t['tpot_ms'], f['decode_step_ms']))} that, "
                          f"{_x(ratio(t['tpot_ms'], f['at_best_bandwidth_ms']))} the floor at the run's best bandwidth"))
    return lines


def _prefill(s: dict[str, Any]) -> list[RenderableType]:
    t = s["tuichat"]
    rows = [["tuichat", _fmt(t["ttft_ms"], 0), _fmt(t["prompt_tokens_per_s"], 0), ""]]
    for name, p in s["peers"].items():
        rows.append(_skipped(name, 4) if "skipped" in p else
                    [name, _fmt(p["ttft_ms"], 0), _fmt(p["prompt_tokens_per_s"], 0),
                     _x(ratio(t["prompt_tokens_per_s"], p["prompt_tokens_per_s"]))])
    return [Text(f"prefill · one prompt of {s['prompt_tokens']} tokens, its first token only, median of {s['repeats']} "
                 "(prefix cache off)", style="bold"),
            _table(["", "TTFT ms", "prompt tok/s", "tok/s ÷"], rows)]


def _tabs(s: dict[str, Any]) -> list[RenderableType]:
    headers = ["", "tok/s", "TTFT p50", "TTFT p90", "ITL p50", "ITL p90", "TPOT p50", "tokens", "in flight", "tuichat ÷"]
    rows = []
    for name, v in [(f"tuichat {m}", v) for m, v in s["modes"].items()] + list(s["peers"].items()):
        if "skipped" in v:
            rows.append(_skipped(name, len(headers)))
            continue
        rows.append([name, _fmt(v["tokens_per_s"]), _fmt(v["ttft_ms_p50"], 0), _fmt(v["ttft_ms_p90"], 0), _fmt(v["itl_ms_p50"], 0),
                     _fmt(v["itl_ms_p90"], 0), _fmt(v["tpot_ms_p50"], 0), str(v["output_tokens"]),
                     _fmt(v.get("in_flight_mean"), 1), "" if name == "tuichat continuous" else _x(v.get("tuichat_over"))])
    return [Text(f"tabs · {s['tabs']} conversations, {s['stagger_ms']:.0f} ms apart, ≤{s['max_tokens']} tokens, EOS on "
                 "(the batching peers get the same arrivals)", style="bold"),
            _table(headers, rows)]


def _multiturn(s: dict[str, Any]) -> list[RenderableType]:
    on, off = s["cache_on"], s["cache_off"]
    hf = s["peers"].get("hf_generate", {}).get("ttft_ms")
    llama = s["peers"].get("llama_cpp", {})
    rows = []
    for k in range(len(on["ttft_ms"])):
        rows.append([str(k + 1), str(on["prompt_tokens"][k]), f"{on['cached_fraction'][k]:.0%}", _fmt(on["ttft_ms"][k], 0),
                     _fmt(off["ttft_ms"][k], 0), _x(ratio(off["ttft_ms"][k], on["ttft_ms"][k])),
                     _fmt(hf[k], 0) if hf else "-",
                     f"{_fmt(llama['ttft_ms'][k], 0)} ({llama['cached_fraction'][k]:.0%})" if "ttft_ms" in llama else "-"])
    return [Text(f"multiturn · {s['turns']} turns, replies ≤{s['max_tokens']} tokens, history {s['history_tokens']} tokens "
                 "(cache off replays the same history)", style="bold"),
            _table(["turn", "prompt tok", "cached", "TTFT on", "TTFT off", "off ÷ on", "hf_generate", "llama_cpp (cached)"], rows),
            Text(f"  cache on: last ÷ first turn {_x(s['last_over_first_cache_on'])}, "
                 f"last ÷ second turn {_x(s.get('last_over_second_cache_on'))}")]


def _shared_prefix(s: dict[str, Any]) -> list[RenderableType]:
    rows = [[label.replace("_", " "), _fmt(v["ttft_ms_p50"], 0), _fmt(v["ttft_ms_p90"], 0),
             f"{statistics.fmean(v['cached_fraction']):.0%}"] for label, v in (("cache_on", s["cache_on"]), ("cache_off", s["cache_off"]))]
    return [Text(f"shared_prefix · {s['tabs']} tabs, one system prompt of ~{s['cache_on']['prompt_tokens'][0]} prompt tokens, "
                 f"{s['stagger_ms']:.0f} ms apart", style="bold"),
            _table(["first turn", "TTFT p50", "TTFT p90", "cached"], rows),
            Text(f"  cache off ÷ on (p50): {_x(s['off_over_on_p50'])}")]


def _interference(s: dict[str, Any]) -> list[RenderableType]:
    return [Text(f"interference · a new conversation while {s['tabs'] - 1} others decode "
                 f"(decoding at submit: {s['decoding_at_submit']})", style="bold"),
            _table(["", "TTFT ms"], [["idle", _fmt(s["idle_ttft_ms"], 0)], ["loaded", _fmt(s["loaded_ttft_ms"], 0)]]),
            Text(f"  loaded ÷ idle: {_x(s['loaded_over_idle'])}")]


def _speculative(s: dict[str, Any]) -> list[RenderableType]:
    rows = []
    for kind in ("grounded", "open"):
        for mode in ("off", "auto"):
            v = s["modes"][mode][kind]
            tab_tpot = v["tabs"]["tpot_ms_p50"]
            rows.append([f"{kind} · {mode}", _fmt(v["single"]["decode_tokens_per_s"]), _fmt(v["single"]["ttft_ms"], 0),
                         _fmt(v["tabs"]["tokens_per_s"]), _fmt(1000 / tab_tpot if tab_tpot else None),
                         _fmt(v["tabs"]["in_flight_mean"]), _fmt(v["tabs"]["ttft_ms_p50"], 0)])
        rows.append([f"{kind} · auto ÷ off", _x(s[f"{kind}_single_auto_over_off"]), "", _x(s[f"{kind}_tabs_auto_over_off"]),
                     _x(s[f"{kind}_tab_decode_auto_over_off"]), "", ""])
    auto = s["modes"]["auto"]
    kept = "-" if auto["acceptance"] is None else f"{auto['acceptance']:.0%}"
    return [Text(f"speculative · prompts that quote themselves (grounded) and open-ended ones, one at a time and as "
                 f"{s['tabs']} tabs, ≤{s['max_tokens']} tokens", style="bold"),
            _table(["", "decode tok/s", "TTFT ms", "tabs tok/s", "a tab's decode tok/s", "in flight", "tabs TTFT p50"], rows),
            Text(f"  auto: {_fmt(auto['tokens_per_step'], 2)} tokens a step, "
                 f"{kept} of drafts kept; "
                 f"replies the same with it off: {'yes' if s['same_replies'] else 'NO'}")]


UNWRAPPED = 1000  # the width of a file or a pipe: wider than any table, so none is wrapped
SECTIONS = {"single": _single, "prefill": _prefill, "tabs": _tabs, "multiturn": _multiturn, "shared_prefix": _shared_prefix,
            "interference": _interference, "speculative": _speculative}
MARKS = {True: ("ok  ", "green"), False: ("MISS", "bold red"), None: ("n/a ", "dim")}


def _report(result: dict[str, Any]) -> list[RenderableType]:
    """One small table per scenario, ratios as tuichat ÷ peer, then the targets."""
    parts = _header(result) + [Text("")]
    sc = result.get("scenarios", {})
    for name, section in SECTIONS.items():
        if name in sc:
            parts += section(sc[name]) + [Text("")]
    parts.append(Text("targets (reported, not asserted)", style="bold"))
    for t in result.get("targets", []):
        shown = _x(t["value"]) if not t["name"].endswith("(ms)") or t["value"] is None else f"{t['value']:+.1f} ms"
        parts.append(Text.assemble("  ", MARKS[t["ok"]], f" {t['name']}: {shown} (target {t['target']})"))
    return parts


def _console(file: TextIO, **options: Any) -> Console:
    """Text exactly as given (no markup, highlighting or emoji codes); wider than any table unless a terminal's
    own width is taken, so a file or a pipe gets unwrapped lines."""
    console = Console(file=file, markup=False, highlight=False, emoji=False, **options)
    if not console.is_terminal:
        console.width = UNWRAPPED
    return console


def _print(console: Console, parts: list[RenderableType]) -> None:
    for part in parts:
        console.print(part, soft_wrap=isinstance(part, Text))  # a long line is the terminal's to wrap


def render(result: dict[str, Any]) -> str:
    """The human-readable report as plain text."""
    console = _console(io.StringIO(), force_terminal=False)
    _print(console, _report(result))
    return console.file.getvalue().removesuffix("\n")


def write(result: dict[str, Any], out: TextIO, plot_path: str | None = None) -> None:
    """The report, the skipped peers' reasons and where the plot went: coloured on a terminal, plain elsewhere."""
    notes = [Text(f"note: {note}") for note in skipped_notes(result)]
    _print(_console(out), _report(result) + notes + ([Text(f"plot: {plot_path}")] if plot_path else []))


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
        raise TuichatError("--plot needs matplotlib, an optional extra: pip install 'tuichat[plot]' (or pip install matplotlib).")
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise TuichatError(f"--plot needs matplotlib, which failed to import: {exc}") from exc


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
