"""What a run's result says: the issue's targets, the tables, the notes on skipped peers, the plot."""

from __future__ import annotations

import importlib.util
import math
import statistics
from typing import Any

from tuichat.backend import BackendError
from tuichat.bench.stats import median, ratio


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
         ratio(_get(single, "tuichat.decode_tokens_per_s"), _get(single, "peers.hf_generate.decode_tokens_per_s")), ">=", 1.5),
        ("single: decode tok/s ÷ llama_cpp",
         ratio(_get(single, "tuichat.decode_tokens_per_s"), _get(single, "peers.llama_cpp.decode_tokens_per_s")), ">=", 1.0),
        ("single: TTFT ÷ llama_cpp", ratio(_get(single, "tuichat.ttft_ms"), _get(single, "peers.llama_cpp.ttft_ms")), "<=", 0.5),
        ("tabs: continuous tok/s ÷ llama_cpp (parallel slots)", _get(tabs, "peers.llama_cpp.tuichat_over"), ">=", 3.0),
        ("single: decode step (TPOT, batch 1) ÷ its bytes-read floor",
         ratio(_get(single, "tuichat.tpot_ms"), _get(result, "floor.tuichat.decode_step_ms")), "<=", 1.5),
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
        lines.append(f"single · one conversation, {s['prompts']} prompts of ~{median(s['prompt_tokens']) or 0:.0f} tokens, "
                     f"≤{s['max_tokens']} tokens, medians (prefix cache off)")
        rows = [["tuichat", _fmt(t["ttft_ms"]), _fmt(t["itl_ms_p50"]), _fmt(t["itl_ms_p90"]), _fmt(t["decode_tokens_per_s"]), "", ""]]
        rows.append(["bare forward (transformers)", _fmt(s["bare_forward_ms"]), "", "", "", _x(s["ttft_over_bare_forward"]), ""])
        for name, p in s["peers"].items():
            if "skipped" in p:
                rows.append([name, f"skipped: {p['skipped']}", "", "", "", "", ""])
            else:
                rows.append([name, _fmt(p["ttft_ms"]), _fmt(p["itl_ms_p50"]), _fmt(p["itl_ms_p90"]), _fmt(p["decode_tokens_per_s"]),
                             _x(ratio(t["ttft_ms"], p["ttft_ms"])), _x(ratio(t["decode_tokens_per_s"], p["decode_tokens_per_s"]))])
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
                         _fmt(off["ttft_ms"][k], 0), _x(ratio(off["ttft_ms"][k], on["ttft_ms"][k])),
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
