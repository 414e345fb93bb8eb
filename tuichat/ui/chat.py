"""One conversation tab: its messages, the turn in flight, its meter and its prompt."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Sequence

from textual.content import Content
from textual.css.query import NoMatches
from textual.widgets import TabbedContent, TabPane
from textual.worker import Worker, WorkerState

from tuichat.backend import BackendError, Message, SamplingParams, Usage
from tuichat.ui.message_log import PAGE, MessageLog
from tuichat.ui.messages import AssistantMessage, Past, UserMessage
from tuichat.ui.widgets import ModelBar, Prompt, TtftMeter

if TYPE_CHECKING:
    from tuichat.store import MessageRow
    from tuichat.ui.app import TuichatApp

FLUSH_S = 1.0  # how often a streaming reply is written to the store, so a crash loses at most this much
NEW_TITLE = "New chat"
TITLE_CHARS = 40


def sampling_key(conversation_id: str) -> str:
    return f"sampling.{conversation_id}"


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
        yield MessageLog(past, classes="log")
        yield self.meter
        yield self.prompt

    def on_mount(self) -> None:
        self._rows.clear()  # only needed to compose
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
        return self.log_view.messages()

    def last_reply(self) -> AssistantMessage | None:
        return self.log_view.last_reply()

    @property
    def earlier_count(self) -> int:
        """Messages of the conversation above the mounted window."""
        return self.log_view.earlier_count

    async def show_earlier(self, count: int = PAGE) -> int:
        return await self.log_view.show_earlier(count)

    async def reveal(self, message_id: int) -> None:
        await self.log_view.reveal(message_id)

    def _conversation_so_far(self) -> list[Message]:
        """What the model sees: the system prompt and every turn, except failed ones (a failed reply and
        the user message it answered, which usually comes back edited or resent)."""
        system = self.app.config.system_prompt
        context = [Message("system", system)] if system else []
        messages = self.log_view.history()
        for index, message in enumerate(messages):
            following = messages[index + 1] if index + 1 < len(messages) else None
            if message.role == "user":
                if not (following is not None and following.role == "assistant" and following.status == "error"):
                    context.append(Message("user", message.text))
            elif message.status != "error" and message.text:
                context.append(Message("assistant", message.text))
        return context

    # --- showing ------------------------------------------------------------------------------------

    async def on_show(self) -> None:
        reply = self.last_reply()
        if reply is not None and self.busy:
            await reply.paint()  # what streamed while the tab was hidden

    def on_hide(self) -> None:
        reply = self.last_reply()
        if reply is not None and self.busy:
            reply.hold()

    async def on_prompt_scroll_log(self, event: Prompt.ScrollLog) -> None:
        await self.log_view.scroll_pages(event.pages)

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
        await self.log_view.add(sent, room=2)
        await self._reply(t_enter, sent)

    async def _reply(self, t_enter: float, sent: UserMessage | None = None) -> None:
        context = self._conversation_so_far()
        message_id = self.app.store.add_message(
            self.conversation_id, "assistant", "", status="streaming", meta={"model": self.model}
        )
        model = self.app.model_name(self.model)
        reply = AssistantMessage("", status="streaming", message_id=message_id, model=model)
        await self.log_view.add(reply)
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
        await self.log_view.drop(removed)

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
        await self.log_view.refill()
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
        while self.earlier_count and not any(isinstance(w, UserMessage) for w in messages):
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
        await self.log_view.drop(tail)


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
