"""One conversation tab: its messages, the turn in flight, its meter and its prompt."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Callable, Sequence

from textual import events
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.css.query import NoMatches
from textual.message import Message as UIMessage
from textual.timer import Timer
from textual.widgets import Markdown, Static, TabbedContent, TabPane
from textual.widgets.markdown import MarkdownFence, MarkdownStream
from textual.worker import Worker, WorkerState

from tuichat.backend import BackendError, Message, SamplingParams, Usage
from tuichat.ui.widgets import ModelBar, Prompt, TtftMeter

if TYPE_CHECKING:
    from tuichat.store import MessageRow
    from tuichat.ui.app import TuichatApp

FLUSH_S = 1.0  # how often a streaming reply is written to the store, so a crash loses at most this much
NEW_TITLE = "New chat"
TITLE_CHARS = 40
# Every layout (a streamed token, a keypress that wraps) walks every widget mounted in the visible tab, so a
# tab mounts only its last WINDOW messages (several screens of text); earlier ones are mounted PAGE at a time
# on demand. Measured (tests/test_ui_long.py): 20 mounted cost about what 2 do, 40 about half as much again.
WINDOW = 20
PAGE = 20


def sampling_key(conversation_id: str) -> str:
    return f"sampling.{conversation_id}"


class UserMessage(Static):
    def __init__(self, text: str, message_id: int) -> None:
        super().__init__(text, markup=False, classes="message user", id=f"msg-{message_id}")
        self.text = text
        self.message_id = message_id


@dataclass
class Past:
    """A message of the conversation that is not mounted (above the tab's window)."""

    role: str  # "user" or "assistant"
    text: str
    message_id: int
    status: str = "done"
    model: str = ""
    error: str | None = None
    detail: str | None = None  # why the reply was cut short

    @classmethod
    def from_row(cls, row: MessageRow) -> Past:
        meta = row.meta
        return cls(row.role, row.content, row.id, row.status, meta.get("model", ""), meta.get("error"),
                   meta.get("finish_detail"))

    @classmethod
    def from_widget(cls, widget: UserMessage | AssistantMessage) -> Past:
        if isinstance(widget, UserMessage):
            return cls("user", widget.text, widget.message_id)
        return cls("assistant", widget.text, widget.message_id, widget.status, widget.model, widget.error,
                   widget.detail)

    def widget(self) -> UserMessage | AssistantMessage:
        if self.role == "user":
            return UserMessage(self.text, self.message_id)
        return AssistantMessage(
            self.text, status=self.status, message_id=self.message_id, model=self.model, error=self.error,
            detail=self.detail,
        )


class EarlierMessages(Static):
    """The top line of a log whose earlier messages are not mounted: a click (or PageUp, or scrolling to
    the top) mounts the previous page."""

    def on_click(self, event: events.Click) -> None:
        event.stop()
        self.post_message(MessageLog.ShowEarlier())


class MessageLog(VerticalScroll):
    class ShowEarlier(UIMessage):
        """Mount the previous page of messages."""

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        if new_value <= 0 < old_value and self.max_scroll_y > 0:  # scrolled to the top (not shrunk to fit)
            self.post_message(self.ShowEarlier())


class AssistantMessage(Vertical):
    """A reply: Markdown (code highlighted by Textual's fences) that grows chunk by chunk while streaming,
    then renders once in full; a status line when it stopped, failed or was cut short (a full KV cache,
    the context length)."""

    STATUS_LABELS = {"stopped": "⏹ stopped"}

    def __init__(
        self, text: str, *, status: str, message_id: int, model: str, error: str | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(classes="message assistant", id=f"msg-{message_id}")
        self._chunks = [text] if text else []
        self.status = status
        self.message_id = message_id
        self.model = model
        self.error = error
        self.detail = detail
        self._stream: MarkdownStream | None = None
        self._unpainted: list[str] = []  # streamed chunks not yet given to the Markdown widget
        self._paint_timer: Timer | None = None

    def compose(self):
        yield Static(self.model, classes="role", markup=False)
        yield Markdown(self.text)
        yield Static(classes="status", markup=False)

    def on_mount(self) -> None:
        self._show_status()

    @property
    def text(self) -> str:
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def has_text(self) -> bool:
        return bool(self._chunks)

    def set_model(self, model: str) -> None:
        self.model = model
        self.query_one(".role", Static).update(model)

    async def append(self, text: str, *, paint: bool = True) -> None:
        """Add a chunk. It is painted at once if the app's paint pacer says a paint is due, else by a
        timer, with whatever else arrives meanwhile; `paint=False` (a hidden tab) keeps it until `paint()`.
        Each paint re-parses only the last block (MarkdownStream), so a token costs the same at the end of
        a long reply as at the start."""
        self._chunks.append(text)
        self._unpainted.append(text)
        if not paint or self._paint_timer is not None:
            return
        wait = self.app.paint_pacer.wait()
        if wait <= 0:
            await self.paint()
        else:
            self._paint_timer = self.set_timer(wait, self.paint)

    def hold(self) -> None:
        """Paint nothing more until `paint()` (its tab is being hidden)."""
        if self._paint_timer is not None:
            self._paint_timer.stop()
            self._paint_timer = None

    async def paint(self) -> None:
        """Give the chunks not yet painted to the Markdown widget."""
        if self._paint_timer is not None:
            self._paint_timer.stop()
            self._paint_timer = None
        if not self._unpainted:
            return
        text = "".join(self._unpainted)
        self._unpainted.clear()
        self.app.paint_pacer.painted()
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        await self._stream.write(text)

    async def finish(self, status: str, error: str | None = None, detail: str | None = None) -> None:
        self.status, self.error, self.detail = status, error, detail
        if self._paint_timer is not None:
            self._paint_timer.stop()
            self._paint_timer = None
        streamed = self._stream is not None or bool(self._unpainted)
        self._unpainted.clear()
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        if streamed:
            # One full render of the whole text: chunks not painted yet, and the incremental parse can
            # leave a block split differently than a fresh one.
            await self.query_one(Markdown).update(self.text)
        self._show_status()

    def _show_status(self) -> None:
        status = self.query_one(".status", Static)
        cut = self.status != "error" and self.detail is not None
        if self.status == "error":
            status.update(f"⚠ {self.error or 'failed'}")
        elif cut:
            status.update(f"✂ cut short: {self.detail}")
        else:
            status.update(self.STATUS_LABELS.get(self.status, ""))
        for name in ("stopped", "error"):
            self.set_class(self.status == name, f"-{name}")
        self.set_class(cut, "-cut")

    def code_blocks(self) -> list[MarkdownFence]:
        return list(self.query(MarkdownFence))


class ChatTab(TabPane):
    """A conversation. Its turns run in a worker of their own, so tabs stream at the same time and the
    engine batches them."""

    def __init__(
        self,
        conversation_id: str,
        title: str,
        model: str,
        sampling: SamplingParams,
        rows: Sequence[MessageRow] = (),
    ) -> None:
        super().__init__(title, id=f"conv-{conversation_id}")
        self.conversation_id = conversation_id
        self.title = title
        self.model = model
        self.sampling = sampling
        self._rows = list(rows)
        self._earlier: list[Past] = []  # messages above the mounted window, oldest first
        self._turn: Worker | None = None
        self._stop_requested = False
        self.last_usage: Usage | None = None
        ttft = [row.meta["ttft_ms"] for row in self._rows if row.meta.get("ttft_ms") is not None]
        self.meter = TtftMeter(ttft, classes="meter")
        self.model_bar = ModelBar(classes="model-bar")
        self.prompt = Prompt([row.content for row in self._rows if row.role == "user"], classes="prompt")
        for row in reversed(self._rows):
            if row.role == "assistant" and row.meta.get("prompt_tokens"):
                self.last_usage = Usage(
                    prompt_tokens=row.meta["prompt_tokens"], cached_tokens=row.meta.get("cached_tokens", 0)
                )
                break

    @property
    def app(self) -> TuichatApp:  # type: ignore[override]
        return super().app  # type: ignore[return-value]

    def compose(self):
        yield self.model_bar
        past = [Past.from_row(row) for row in self._rows if row.role in ("user", "assistant")]
        self._earlier = past[:-WINDOW]  # oldest first; the window is mounted below them
        with MessageLog(classes="log"):
            yield EarlierMessages(classes="earlier")
            for message in past[-WINDOW:]:
                yield message.widget()
        yield self.meter
        yield self.prompt

    def on_mount(self) -> None:
        self._rows.clear()  # only needed to compose
        self._show_earlier_count()
        self.log_view.anchor()  # follow new text until the user scrolls up; resumes at the bottom
        self.refresh_model_bar()

    @property
    def log_view(self) -> MessageLog:
        return self.query_one(".log", MessageLog)

    @property
    def busy(self) -> bool:
        return self._turn is not None and self._turn.is_running

    # --- labels -------------------------------------------------------------------------------------

    def refresh_model_bar(self) -> None:
        sampling = self.sampling
        knobs = [f"temp {sampling.temperature:g}"]
        if sampling.top_p < 1:
            knobs.append(f"top-p {sampling.top_p:g}")
        if sampling.top_k:
            knobs.append(f"top-k {sampling.top_k}")
        knobs.append(f"max {sampling.max_tokens}")
        if sampling.seed is not None:
            knobs.append(f"seed {sampling.seed}")
        state = self.app.model_state(self.model)
        self.model_bar.update(
            Content.assemble(
                ("◆ ", "$accent"),
                (self.app.model_name(self.model), "bold"),
                (f"  {state}" if state else "", "$warning" if state else ""),
                ("   " + " · ".join(knobs), "dim"),
            ),
            layout=False,  # one line of fixed size: no need to reflow the screen
        )

    def _refresh_label(self) -> None:
        try:
            tab = self.app.query_one(TabbedContent).get_tab(self)
        except NoMatches:
            return
        tab.label = Content.assemble(("● ", "$success") if self.busy else "", self.title)

    def rename(self, title: str) -> None:
        self.title = title
        self.app.store.rename(self.conversation_id, title)
        self._refresh_label()

    def set_model(self, model: str) -> None:
        self.model = model
        self.app.store.set_model(self.conversation_id, model)
        self.refresh_model_bar()

    def set_sampling(self, sampling: SamplingParams) -> None:
        self.sampling = sampling
        data = asdict(sampling)
        data["stop"] = list(sampling.stop)
        self.app.store.set_setting(sampling_key(self.conversation_id), json.dumps(data))
        self.refresh_model_bar()

    # --- messages -----------------------------------------------------------------------------------

    def _messages(self) -> list[UserMessage | AssistantMessage]:
        return [w for w in self.log_view.children if isinstance(w, (UserMessage, AssistantMessage))]

    def last_reply(self) -> AssistantMessage | None:
        replies = [w for w in self._messages() if isinstance(w, AssistantMessage)]
        return replies[-1] if replies else None

    def _conversation_so_far(self) -> list[Message]:
        """What the model sees: the system prompt and every turn, except failed ones (a failed reply and
        the user message it answered, which usually comes back edited or resent)."""
        system = self.app.config.system_prompt
        context = [Message("system", system)] if system else []
        messages = [*self._earlier, *map(Past.from_widget, self._messages())]
        for index, message in enumerate(messages):
            following = messages[index + 1] if index + 1 < len(messages) else None
            if message.role == "user":
                if not (following is not None and following.role == "assistant" and following.status == "error"):
                    context.append(Message("user", message.text))
            elif message.status != "error" and message.text:
                context.append(Message("assistant", message.text))
        return context

    # --- the mounted window -------------------------------------------------------------------------

    @property
    def earlier_count(self) -> int:
        """Messages of the conversation above the mounted window."""
        return len(self._earlier)

    def _show_earlier_count(self) -> None:
        bar = self.log_view.query_one(EarlierMessages)
        count = len(self._earlier)
        bar.display = count > 0
        if count:
            bar.update(
                Content.assemble(
                    ("▲ ", "$accent"),
                    f"{count} earlier message{'s' if count != 1 else ''}",
                    (" · click, or PageUp at the top, to show more", "dim"),
                )
            )

    async def show_earlier(self, count: int = PAGE) -> int:
        """Mount the `count` messages just above the window, keeping the view on what it showed. Returns
        how many were mounted."""
        count = min(count, len(self._earlier))
        if count <= 0:
            return 0
        log = self.log_view
        page, self._earlier[-count:] = self._earlier[-count:], []
        mounted = self._messages()
        first = mounted[0] if mounted else None
        top_before = first.virtual_region.y if first is not None else 0
        await log.mount_all([message.widget() for message in page], after=log.query_one(EarlierMessages))
        self._show_earlier_count()
        if first is not None and log.scroll_y < log.max_scroll_y:  # not following: stay on the same text
            # The page pushes `first` down by its height: scroll by as much.
            self._after_layout(
                lambda: first.virtual_region.y != top_before,
                lambda: log.scroll_to(
                    y=log.scroll_y + first.virtual_region.y - top_before, animate=False, immediate=True
                ),
            )
        return count

    def _after_layout(self, laid_out: Callable[[], bool], then: Callable[[], object], refreshes: int = 10) -> None:
        # Widgets just mounted have no place until a layout, which can take a refresh or two (more under
        # load): `then` runs once `laid_out` says so, or after `refreshes` refreshes at most.
        if laid_out() or not refreshes:
            then()
        else:
            self.call_after_refresh(self._after_layout, laid_out, then, refreshes - 1)

    async def _trim(self, room: int) -> None:
        """Before `room` messages are mounted: unmount the oldest ones that would be beyond WINDOW (a new
        turn follows the bottom, so they are out of sight); they stay in the conversation, mountable again."""
        mounted = self._messages()
        excess = mounted[: max(len(mounted) + room - WINDOW, 0)]
        if excess:
            self._earlier.extend(map(Past.from_widget, excess))
            await self.log_view.remove_children(excess)
            self._show_earlier_count()

    async def _refill(self) -> None:
        """After messages at the bottom went away: mount earlier ones back up to WINDOW."""
        missing = WINDOW - len(self._messages())
        if missing > 0 and self._earlier:
            await self.show_earlier(missing)

    async def on_show(self) -> None:
        reply = self.last_reply()
        if reply is not None and self.busy:
            await reply.paint()  # what streamed while the tab was hidden

    def on_hide(self) -> None:
        reply = self.last_reply()
        if reply is not None and self.busy:
            reply.hold()

    async def on_message_log_show_earlier(self, event: MessageLog.ShowEarlier) -> None:
        event.stop()
        await self.show_earlier()

    async def reveal(self, message_id: int) -> None:
        """Scroll to a message (a search hit) and highlight it for a moment, mounting it if it is earlier."""
        index = next((i for i, m in enumerate(self._earlier) if m.message_id == message_id), None)
        if index is not None:  # mount down to it, with some context above it to center it in
            await self.show_earlier(len(self._earlier) - max(index - PAGE // 2, 0))
        try:
            widget = self.log_view.query_one(f"#msg-{message_id}")
        except NoMatches:
            return
        widget.add_class("-found")
        self.set_timer(3, lambda: widget.remove_class("-found"))
        self.log_view.release_anchor()  # or the next layout scrolls back to the bottom
        self._after_layout(
            lambda: bool(widget.virtual_region.size),
            lambda: self.log_view.scroll_to_center(widget, animate=False, immediate=True),
        )

    async def on_prompt_scroll_log(self, event: Prompt.ScrollLog) -> None:
        # A user scroll: scrolling up stops following new text, reaching the bottom resumes it.
        log = self.log_view
        if event.pages < 0:
            if log.scroll_y <= 0:  # already at the top: show earlier messages
                await self.show_earlier()
            log.scroll_page_up()
        else:
            log.scroll_page_down()

    # --- turns --------------------------------------------------------------------------------------

    async def on_prompt_submitted(self, event: Prompt.Submitted) -> None:
        event.stop()
        if self.busy:
            self.prompt.restore(event.text)
            self.app.notify("A reply is still coming: Esc stops it.", severity="warning")
            return
        await self.send(event.text, event.t_enter)

    async def send(self, text: str, t_enter: float) -> None:
        store = self.app.store
        message_id = store.add_message(self.conversation_id, "user", text)
        if self.title == NEW_TITLE:
            first_line = text.strip().splitlines()[0]
            self.rename(first_line[:TITLE_CHARS] + ("…" if len(first_line) > TITLE_CHARS else ""))
        sent = UserMessage(text, message_id)
        await self._trim(room=2)
        await self.log_view.mount(sent)
        await self._reply(t_enter, sent)

    async def _reply(self, t_enter: float, sent: UserMessage | None = None) -> None:
        context = self._conversation_so_far()
        message_id = self.app.store.add_message(
            self.conversation_id, "assistant", "", status="streaming", meta={"model": self.model}
        )
        model = self.app.model_name(self.model)
        reply = AssistantMessage("", status="streaming", message_id=message_id, model=model)
        await self._trim(room=1)
        await self.log_view.mount(reply)
        self.log_view.anchor()  # a new turn always follows, even if the user had scrolled up
        self.meter.start(t_enter)
        self._stop_requested = False
        self._turn = self.run_worker(self._stream_reply(reply, context, sent), group="turn", exit_on_error=False)
        self._refresh_label()

    async def _stream_reply(
        self, reply: AssistantMessage, context: list[Message], sent: UserMessage | None
    ) -> None:
        app, store = self.app, self.app.store
        clock = app.clock
        usage: Usage | None = None
        error: str | None = None
        try:
            model = await app.ensure_model(self.model)
            reply.set_model(model)
            stream = app.backend.stream(self.conversation_id, context, self.sampling, model=model)
            last_flush = clock()
            try:
                async for event in stream:
                    if event.text:
                        first = not reply.has_text
                        # A hidden tab keeps its text until shown: its layouts would be the shown tab's.
                        await reply.append(event.text, paint=self.display)
                        self.meter.chunk(event.usage.completion_tokens)
                        if first:
                            self.call_after_refresh(self.meter.first_token_painted)
                        if clock() - last_flush >= FLUSH_S:
                            store.update_message(reply.message_id, content=reply.text)
                            last_flush = clock()
                    if event.error:
                        error = event.error
                    if event.finished:
                        usage = event.usage
                        break
            finally:
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    await aclose()
        except asyncio.CancelledError:
            if not self._stop_requested:  # the app is quitting or the tab closing: save, skip the UI
                meta = self._meta(None, None)
                store.update_message(reply.message_id, content=reply.text, status="stopped", meta=meta)
                raise
        except BackendError as failure:
            error = str(failure)
        except Exception as failure:  # a backend bug must not take the app (and the typed text) down
            error = f"{type(failure).__name__}: {failure}"
        if error:
            status = "error"
        elif self._stop_requested or (usage is not None and usage.finish_reason == "cancelled"):
            status = "stopped"
        else:
            status = "done"
        self.meter.finish(usage)
        store.update_message(reply.message_id, content=reply.text, status=status, meta=self._meta(usage, error))
        if usage is not None:
            self.last_usage = usage
        if status == "stopped" and not reply.text:
            await self._take_back(reply, sent)
        else:
            await reply.finish(status, error, usage.finish_detail if usage is not None else None)
        if error and self is not app.active_tab:  # out of sight: say which tab
            app.notify(error, title=f'Reply failed in "{self.title}"', severity="error")
        self._turn = None
        self._refresh_label()

    async def _take_back(self, reply: AssistantMessage, sent: UserMessage | None) -> None:
        """Stopped before the first token: nothing to keep but the question, which goes back into the
        prompt for another try (a regenerated reply just disappears)."""
        removed: list[UserMessage | AssistantMessage] = [reply]
        if sent is not None:
            removed.append(sent)
            self.prompt.restore(sent.text)
            self.app.notify("Stopped before the first token; your message is back in the prompt.")
        for widget in removed:
            self.app.store.delete_message(widget.message_id)
        await self.log_view.remove_children(removed)
        await self._refill()

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        # Backend failures are caught in _stream_reply; what gets here is a bug of ours. Say so, and free
        # the tab for the next message rather than leave it "busy" forever.
        if event.worker is self._turn and event.state == WorkerState.ERROR:
            self._turn = None
            self._refresh_label()
            self.app.notify(f"{event.worker.error!r}", title="tuichat bug: the reply failed", severity="error")

    def _meta(self, usage: Usage | None, error: str | None) -> dict:
        meta: dict = {"model": self.model}
        turn = self.meter.turn
        if turn is not None:
            for name in ("ttft_ms", "itl_ms", "tokens_per_s"):
                if getattr(turn, name) is not None:
                    meta[name] = round(getattr(turn, name), 1)
        if usage is not None:
            meta |= {
                "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.cached_tokens,
                "completion_tokens": usage.completion_tokens,
                "finish_reason": usage.finish_reason,
            }
            if usage.finish_detail:
                meta["finish_detail"] = usage.finish_detail
        if error:
            meta["error"] = error
        return meta

    def stop(self) -> bool:
        """Stop the reply in flight; its text so far stays, marked stopped. False if there was none."""
        if not self.busy:
            return False
        self._stop_requested = True
        if self.app.backend is not None:
            self.app.backend.cancel(self.conversation_id)
        self._turn.cancel()
        return True

    async def regenerate(self) -> None:
        if self.busy:
            self.app.notify("A reply is still coming: Esc stops it first.", severity="warning")
            return
        await self._refill()
        messages = self._messages()
        if not messages or not isinstance(messages[-1], AssistantMessage):
            self.app.notify("No reply to regenerate.", severity="warning")
            return
        last = messages[-1]
        self.app.store.delete_message(last.message_id)
        await last.remove()
        await self._reply(self.app.clock())

    async def edit_last(self) -> None:
        """Take the last user message (and the reply to it) back into the prompt, to change and resend."""
        if self.busy:
            self.app.notify("A reply is still coming: Esc stops it first.", severity="warning")
            return
        if self.prompt.text.strip():
            self.app.notify("The prompt holds a draft: send or clear it first.", severity="warning")
            return
        messages = self._messages()
        while self._earlier and not any(isinstance(w, UserMessage) for w in messages):
            await self.show_earlier()
            messages = self._messages()
        users = [index for index, w in enumerate(messages) if isinstance(w, UserMessage)]
        if not users:
            self.app.notify("No message to edit.", severity="warning")
            return
        tail = messages[users[-1] :]
        for widget in tail:
            self.app.store.delete_message(widget.message_id)
        self.prompt.text = tail[0].text
        self.prompt.move_cursor(self.prompt.document.end)
        self.prompt.focus()
        await self.log_view.remove_children(tail)
        await self._refill()


def stored_sampling(raw: str | None, default: SamplingParams) -> SamplingParams:
    """A tab's sampling from the store; anything unreadable or invalid (top_p 0 was once accepted) gives
    the configured default."""
    if not raw:
        return default
    try:
        data = json.loads(raw)
        data["stop"] = tuple(data.get("stop", ()))
        return replace(default, **data)
    except (ValueError, TypeError, BackendError):
        return default
