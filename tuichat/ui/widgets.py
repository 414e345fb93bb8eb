"""Small widgets of a chat tab and the app: prompt, TTFT meter, model bar, engine panel."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.message import Message
from textual.timer import Timer
from textual.widgets import Sparkline, Static, TextArea

from tuichat.backends.protocol import EngineStats, RemoteStats, Usage

if TYPE_CHECKING:
    from tuichat.ui.pacing import PaintPacer

SPARK_TURNS = 24
REDRAW_S = 0.05  # the meter redraws at most this often while tokens stream
KV_WARNING = 0.8  # KV cache use above this shows in the warning colour: new prompts may soon wait
CONTEXT_WARNING = 0.8  # a conversation past this share of the context shows in the warning colour


class Prompt(TextArea):
    """Multi-line message input. Enter sends. Ctrl+J inserts a newline in every terminal (it arrives as a key
    of its own). Shift+Enter does too in terminals that speak the kitty keyboard protocol, which Textual
    turns on (kitty, WezTerm, foot, Ghostty...); elsewhere it arrives as a plain Enter and sends."""

    BINDINGS = [
        # priority: TextArea handles Enter itself before non-priority bindings are looked at.
        Binding("enter", "send", "Send", priority=True, id="prompt.send"),
        Binding("ctrl+j,shift+enter", "newline", "Newline", priority=True, id="prompt.newline"),
        # A prompt is a few lines tall: paging it is useless, paging the conversation above is not.
        Binding(
            "pageup", "scroll_log(-1)", "Page up", tooltip="Scroll the conversation up a page", show=False,
            id="prompt.page_up",
        ),
        Binding(
            "pagedown", "scroll_log(1)", "Page down", tooltip="Scroll the conversation down a page", show=False,
            id="prompt.page_down",
        ),
    ]

    class ScrollLog(Message):
        def __init__(self, pages: int) -> None:
            super().__init__()
            self.pages = pages

    class Submitted(Message):
        def __init__(self, text: str, t_enter: float) -> None:
            super().__init__()
            self.text = text
            self.t_enter = t_enter  # app clock at the Enter key: where TTFT starts

    def __init__(self, history: list[str], *, clock: Callable[[], float], **kwargs) -> None:
        super().__init__(
            soft_wrap=True,
            compact=True,
            placeholder="Message · Enter sends · Ctrl+J new line · ↑ earlier prompts",
            **kwargs,
        )
        self.prompt_history = history  # earlier prompts, oldest first
        self._clock = clock  # the app clock, which TTFT is measured on
        self._recalled: int | None = None  # index into history of the text shown, while browsing it

    def on_mount(self) -> None:
        # TEXTUAL_ANIMATIONS=none also stops the blink, which keeps screenshots deterministic.
        self.cursor_blink = self.app.animation_level != "none"

    # Priority bindings run as soon as the app reads the key, possibly before this widget has inserted the
    # keys typed just before it (fast typing, a paste without bracketed paste). call_later queues the work
    # behind them, so Enter sends everything typed before it and nothing typed after it.

    def action_send(self) -> None:
        self.call_later(self._send, self._clock())

    def action_newline(self) -> None:
        self.call_later(self.insert, "\n")

    def action_scroll_log(self, pages: int) -> None:
        self.post_message(self.ScrollLog(pages))

    def _send(self, t_enter: float) -> None:
        text = self.text
        if text.strip():
            self.remember(text)
            self.clear()
            self.post_message(self.Submitted(text, t_enter))

    def restore(self, text: str) -> None:
        """Put back a message that could not be sent, before whatever was typed since."""
        self.text = text + self.text
        self.move_cursor(self.document.end)

    def remember(self, text: str) -> None:
        if not self.prompt_history or self.prompt_history[-1] != text:
            self.prompt_history.append(text)
        self._recalled = None

    def _browsing(self) -> bool:
        """True while the prompt shows an unedited history entry (or is empty): ↑/↓ then walk history."""
        if self._recalled is None:
            return self.text == ""
        return self.text == self.prompt_history[self._recalled]

    def _show(self, index: int | None) -> None:
        self._recalled = index
        self.text = "" if index is None else self.prompt_history[index]
        self.move_cursor(self.document.end)

    def action_cursor_up(self, select: bool = False) -> None:
        if not select and self.prompt_history and self.cursor_location[0] == 0 and self._browsing():
            current = len(self.prompt_history) if self._recalled is None else self._recalled
            self._show(max(current - 1, 0))
        else:
            super().action_cursor_up(select)

    def action_cursor_down(self, select: bool = False) -> None:
        last_row = self.document.line_count - 1
        if not select and self._recalled is not None and self.cursor_location[0] == last_row and self._browsing():
            following = self._recalled + 1
            self._show(following if following < len(self.prompt_history) else None)
        else:
            super().action_cursor_down(select)


@dataclass
class TurnTiming:
    """What the meter knows about one reply, all on the app clock (seconds)."""

    t_enter: float
    t_first: float | None = None
    t_last: float | None = None
    tokens: int = 0
    itl_total: float = 0.0  # sum of gaps between text chunks
    chunks: int = 0

    @property
    def ttft_ms(self) -> float | None:
        return None if self.t_first is None else (self.t_first - self.t_enter) * 1000

    @property
    def itl_ms(self) -> float | None:
        return self.itl_total / (self.chunks - 1) * 1000 if self.chunks > 1 else None

    @property
    def tokens_per_s(self) -> float | None:
        if self.t_first is None or self.t_last is None or self.tokens < 2 or self.t_last <= self.t_first:
            return None
        return (self.tokens - 1) / (self.t_last - self.t_first)


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f} ms"


class TtftMeter(Horizontal):
    """Live latency of this tab's replies: waiting time counting up, then TTFT (Enter → first painted
    token), inter-token latency and decode speed, and a sparkline of TTFT over the tab's turns."""

    def __init__(
        self, ttft_history: list[float], *, clock: Callable[[], float], pacer: PaintPacer, **kwargs
    ) -> None:
        super().__init__(**kwargs)
        self._history = ttft_history
        self._clock = clock  # the app clock: the prompt's Enter time is on it
        self._pacer = pacer  # the replies' paint pacer
        self._turn: TurnTiming | None = None
        self._usage: Usage | None = None
        self._ticker: Timer | None = None
        self._drawn_at = 0.0  # time.monotonic() of the last redraw (real time even on a virtual clock)

    def compose(self):
        yield Static(self._text(), id="meter-text")
        yield Static(id="meter-context")
        yield Sparkline(id="ttft-sparkline")

    def on_mount(self) -> None:
        self._show_sparkline()

    def _show_sparkline(self) -> None:
        # One bar per turn (the latest SPARK_TURNS): stretched over a fixed width, few turns would blur.
        sparkline = self.query_one(Sparkline)
        recent = self._history[-SPARK_TURNS:]
        sparkline.display = len(recent) > 1
        sparkline.styles.width = len(recent)
        sparkline.data = recent

    @property
    def turn(self) -> TurnTiming | None:
        return self._turn

    def start(self, t_enter: float) -> None:
        self._turn = TurnTiming(t_enter)
        self._usage = None
        # Only the waiting time needs a timer; once tokens flow each chunk redraws the meter.
        self._ticker = self.set_interval(0.1, self._redraw)
        self._redraw()

    def first_token_painted(self) -> None:
        turn = self._turn
        if turn is None or turn.t_first is not None:
            return
        turn.t_first = self._clock()
        self._stop_ticker()
        self._history.append(turn.ttft_ms)
        self._show_sparkline()
        self._redraw()

    def chunk(self, completion_tokens: int) -> None:
        """A text chunk arrived; `completion_tokens` is the engine's running count (0 if it does not say)."""
        turn = self._turn
        if turn is None:
            return
        now = self._clock()
        if turn.t_last is not None:
            turn.itl_total += now - turn.t_last
        turn.t_last = now
        turn.chunks += 1
        turn.tokens = max(completion_tokens, turn.chunks)
        # At hundreds of tokens/s, redrawing per token would cost more than the frames can show; and no
        # more often than the reply itself is painted (each redraw costs the UI thread: docs/design/painting.md).
        every = max(REDRAW_S, self._pacer.pause)
        if turn.t_first is not None and time.monotonic() - self._drawn_at >= every:
            self._redraw()

    def finish(self, usage: Usage | None) -> None:
        if self._turn is not None and self._turn.chunks and self._turn.t_first is None:
            self.first_token_painted()  # the reply ended before the screen refreshed once
        self._stop_ticker()
        self._usage = usage
        if self._turn is not None and usage is not None and usage.completion_tokens:
            self._turn.tokens = usage.completion_tokens
        self._redraw()
        self.show_context(usage)

    def show_context(self, usage: Usage | None) -> None:
        """The conversation's tokens (its last prompt and reply) against the model's context, where the backend
        says (a local model), with the messages the context policy left out; the warning colour near the end."""
        if usage is None or not usage.context_tokens:
            return
        shown = self.query_one("#meter-context", Static)
        held = usage.prompt_tokens + usage.completion_tokens
        text = f"ctx {held:,}/{usage.context_tokens:,}"
        if usage.dropped_messages:
            text += f" · {usage.dropped_messages} left out"
        shown.update(text, layout=True)
        shown.set_class(held >= CONTEXT_WARNING * usage.context_tokens, "-warning")
        shown.tooltip = (
            f"This conversation holds {held:,} of the {usage.context_tokens:,} tokens the model's context takes"
            + (f"; its {usage.dropped_messages} oldest messages ({usage.dropped_tokens:,} tokens) are left out of "
               "what the model sees" if usage.dropped_messages else "")
            + ". Past the limit, the context policy drops or summarises the oldest turns (palette: Context policy)."
        )
    def _stop_ticker(self) -> None:
        if self._ticker is not None:
            self._ticker.stop()
            self._ticker = None

    def _redraw(self) -> None:
        self._drawn_at = time.monotonic()
        # layout=False: one line of fixed size; a layout pass here would reflow the whole screen.
        self.query_one("#meter-text", Static).update(self._text(), layout=False)

    def _text(self) -> Content:
        turn = self._turn
        if turn is None:
            last = f"last TTFT {_ms(self._history[-1])}" if self._history else "no replies yet"
            return Content.assemble(("TTFT ", "dim"), (last, "dim"))
        if turn.t_first is None:
            if self._ticker is None:  # finished without a token (error, stopped while waiting)
                return Content("TTFT –  no tokens").stylize("dim")
            waited = (self._clock() - turn.t_enter) * 1000
            return Content.assemble(("waiting ", "bold"), _ms(waited))
        tok_s = turn.tokens_per_s
        text = Content.assemble(
            ("TTFT ", "bold"),
            _ms(turn.ttft_ms),
            (" · ITL ", "dim"),
            _ms(turn.itl_ms),
            f" · {tok_s:.1f} tok/s" if tok_s else " · – tok/s",
            f" · {turn.tokens} tok",
        )
        if self._usage is not None and self._usage.prompt_tokens:
            text += f" · cached {self._usage.cached_tokens}/{self._usage.prompt_tokens}"
            if self._usage.restored_tokens:
                text += f" ({self._usage.restored_tokens} from disk)"
        return text


class ModelBar(Static):
    """One line above the conversation: the tab's model (always visible), its load state, and sampling."""


def _bar(fraction: float, width: int = 16) -> str:
    filled = round(fraction * width)
    return "█" * filled + "░" * (width - filled)


class EnginePanel(Vertical):
    """What the engine is doing, from backend.stats(): toggled by a key, refreshed while shown."""

    def compose(self):
        yield Static("Engine", classes="panel-title")
        yield Static(id="engine-model")
        yield Static(id="engine-sched")
        yield Static(id="engine-kv")
        yield Static(id="engine-prefix")
        yield Static(id="engine-turn")

    def show(self, stats: EngineStats | None, last_usage: Usage | None, note: str = "") -> None:
        if stats is None:
            self.query_one("#engine-model", Static).update(note or "starting…")
            for id_ in ("sched", "kv", "prefix", "turn"):
                self.query_one(f"#engine-{id_}", Static).update("")
            return
        if isinstance(stats, RemoteStats):
            self._show_remote(stats)
        else:
            self._show_local(stats)
        if last_usage is not None and last_usage.prompt_tokens:
            turn = (
                f"last turn: {last_usage.cached_tokens} of {last_usage.prompt_tokens}\n"
                "prompt tokens from cache"
            )
            if last_usage.cache_miss:
                turn += f"\nmissed: {last_usage.cache_miss}"
            if last_usage.context_tokens:
                held = last_usage.prompt_tokens + last_usage.completion_tokens
                turn += f"\ncontext {held:,} of {last_usage.context_tokens:,} tokens"
            if last_usage.dropped_messages:
                kind = "summarised" if last_usage.summary else "left out"
                turn += f"\n{last_usage.dropped_messages} oldest messages {kind} ({last_usage.dropped_tokens:,} tokens)"
            if last_usage.draft_tokens:
                turn += (f"\ndrafts: {last_usage.accepted_tokens} of {last_usage.draft_tokens} kept\n"
                         f"{last_usage.tokens_per_step:.2f} tokens a step")
        else:
            turn = "last turn: –"
        self.query_one("#engine-turn", Static).update(turn)

    def _show_remote(self, stats: RemoteStats) -> None:
        """What the server's /metrics says; "not reported" for what it does not."""
        unknown = "not reported"
        self.query_one("#engine-model", Static).update(
            Content.assemble((stats.model, "bold"), f"\nremote · {stats.device}", (f"\n{stats.note}", "dim") if stats.note else "")
        )
        running = unknown if stats.running is None else stats.running
        waiting = unknown if stats.waiting is None else stats.waiting
        self.query_one("#engine-sched", Static).update(f"running {running} · waiting {waiting}")
        kv = self.query_one("#engine-kv", Static)
        fraction = stats.kv_fraction
        kv.update(f"KV cache {unknown}" if fraction is None else f"KV cache {fraction:.0%}\n{_bar(fraction)}")
        kv.set_class(fraction is not None and fraction > KV_WARNING, "-warning")
        rate = stats.prefix_hit_rate
        self.query_one("#engine-prefix", Static).update(f"prefix hits {unknown if rate is None else f'{rate:.0%}'}")

    def _show_local(self, stats: EngineStats) -> None:
        weights, _, why_not_quantized = stats.weights.partition(" (")
        why_not_quantized = why_not_quantized.removesuffix(")")
        self.query_one("#engine-model", Static).update(
            Content.assemble(
                (stats.model or "no model", "bold"),
                f"\n{stats.device or '?'} · {stats.dtype or '?'} · tp {stats.tp}",
                f"\n{stats.batching} batching",
                f"\n{stats.matmul.partition(' (')[0]} matmul" if stats.matmul else "",
                " · C layers" if stats.layers == "C" else "",
                f"\n{weights} weights · {stats.weight_bytes / 2**20:.0f} MB a step" if weights else "",
                f"\n{why_not_quantized}" if why_not_quantized else "",  # --quant int8 where the C layers don't run
                f"\n{stats.mapped_bytes / 2**20:.0f} MB read in place from the file" if stats.mapped_bytes else "",
                f", {stats.huge_page_bytes / 2**20:.0f} MB of it in 2 MB pages" if stats.mapped_bytes else "",
                f"\nRSS {stats.rss_bytes / 2**30:.2f} GB · peak {stats.peak_rss_bytes / 2**30:.2f} GB" if stats.rss_bytes else "",
            )
        )
        if stats.speculate == "off":
            speculation = "speculation off"
        elif not stats.draft_tokens:
            speculation = f"speculation {stats.speculate} · no drafts"
        else:
            speculation = (f"speculation {stats.speculate} · {stats.accepted_tokens / stats.draft_tokens:.0%} kept\n"
                           f"{stats.tokens_per_step:.2f} tokens a step")
        self.query_one("#engine-sched", Static).update(
            f"running {stats.running} · waiting {stats.waiting}\n"
            f"batch {stats.batch_size} · {stats.tokens_per_s:.1f} tok/s\n{speculation}"
        )
        kv = self.query_one("#engine-kv", Static)
        kv.update(
            f"KV cache {stats.kv_usage:.0%}\n{_bar(stats.kv_usage)}\n"
            f"{stats.kv_blocks_used}/{stats.kv_blocks_total} blocks"
            + (f"\non disk {stats.kv_disk_bytes / 2**20:,.0f} MB · {stats.kv_disk_reads} blocks read back"
               if stats.kv_disk_bytes or stats.kv_disk_reads else "")
        )
        kv.set_class(stats.kv_usage > KV_WARNING, "-warning")
        prefix = f"prefix hits {stats.prefix_hit_rate:.0%}" if stats.prefix_cache else "prefix cache off"
        self.query_one("#engine-prefix", Static).update(prefix)
