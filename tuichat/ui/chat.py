"""One conversation tab: its model bar, its message log, its meter and its prompt, and the turn in flight
on screen. What the app provides comes in a TabServices; the store and the backend are the TurnRunner's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from textual.content import Content
from textual.css.query import NoMatches
from textual.timer import Timer
from textual.widget import MountError
from textual.widgets import TabbedContent, TabPane, TextArea
from textual.worker import Worker, WorkerState

from tuichat.backends.protocol import Message, SamplingParams, Usage
from tuichat.ui.message_log import PAGE, MessageLog
from tuichat.ui.messages import AssistantMessage, Past, UserMessage
from tuichat.ui.turns import TurnRunner
from tuichat.ui.widgets import ModelBar, Prompt, TtftMeter, TurnTiming

if TYPE_CHECKING:
    from tuichat.store import MessageRow
    from tuichat.ui.services import TabServices

NEW_TITLE = "New chat"
TITLE_CHARS = 40
TYPING_PAUSE_S = 0.4  # a pause in typing this long prefills what is typed so far


class _OnScreen:
    """The reply in flight as its TurnRunner sees it (a turns.ReplyView): the widget its text goes to and
    the tab's meter."""

    def __init__(self, tab: ChatTab, reply: AssistantMessage) -> None:
        self._tab = tab
        self._reply = reply

    @property
    def text(self) -> str:
        return self._reply.text

    @property
    def timing(self) -> TurnTiming | None:
        return self._tab.meter.turn

    def model_ready(self, model: str) -> None:
        self._reply.set_model(model)

    async def chunk(self, text: str, completion_tokens: int) -> None:
        first = not self._reply.has_text
        # A hidden tab keeps its text until shown: its layouts would be the shown tab's.
        await self._reply.append(text, paint=self._tab.display)
        meter = self._tab.meter
        meter.chunk(completion_tokens)
        if first:
            self._tab.call_after_refresh(meter.first_token_painted)

    def ended(self, usage: Usage | None) -> None:
        self._tab.meter.finish(usage)


class ChatTab(TabPane):
    """A conversation. Its turns run in a worker of their own, so tabs stream at the same time and the
    engine batches them."""

    def __init__(
        self,
        conversation_id: str,
        title: str,
        model: str,
        sampling: SamplingParams | None,
        rows: Sequence[MessageRow] = (),
        *,
        services: TabServices,
    ) -> None:
        super().__init__(title, id=f"conv-{conversation_id}")
        self.conversation_id = conversation_id
        self.title = title
        self.services = services
        self.runner = TurnRunner(conversation_id, model, sampling, services)
        self._rows = list(rows)
        self._turn: Worker | None = None
        self._typing: Timer | None = None  # the pause after which what is typed is prefilled
        self.prefilled = 0  # the prompt tokens the last prefill while typing prepared
        self.last_usage: Usage | None = None
        ttft = [row.meta["ttft_ms"] for row in self._rows if row.meta.get("ttft_ms") is not None]
        self.meter = TtftMeter(ttft, clock=services.clock, pacer=services.pacer, classes="meter")
        self.model_bar = ModelBar(classes="model-bar")
        history = [row.content for row in self._rows if row.role == "user"]
        self.prompt = Prompt(history, clock=services.clock, classes="prompt")
        for row in reversed(self._rows):
            if row.role == "assistant" and row.meta.get("prompt_tokens"):
                kept = ("prompt_tokens", "cached_tokens", "completion_tokens", "context_tokens", "dropped_messages",
                        "dropped_tokens", "cache_miss")
                self.last_usage = Usage(**{name: row.meta[name] for name in kept if name in row.meta})
                break

    def compose(self):
        yield self.model_bar
        past = [Past.from_row(row) for row in self._rows if row.role in ("user", "assistant")]
        yield MessageLog(past, classes="log")
        yield self.meter
        yield self.prompt

    def on_mount(self) -> None:
        self._rows.clear()  # only needed to compose
        self.refresh_model_bar()
        self.call_after_refresh(self.meter.show_context, self.last_usage)  # a reopened tab's, from its store

    # The model and sampling of the tab's turns live in its runner; set_model and set_sampling save them.

    @property
    def model(self) -> str:
        return self.runner.model

    @property
    def sampling(self) -> SamplingParams:
        return self.runner.sampling

    @sampling.setter
    def sampling(self, sampling: SamplingParams) -> None:
        self.runner.sampling = sampling

    @property
    def log_view(self) -> MessageLog:
        return self.query_one(".log", MessageLog)

    @property
    def busy(self) -> bool:
        """A turn is under way: from its reply stored until its worker ends (a worker not started yet counts:
        the next Enter of a paste may come before it starts)."""
        return self.runner.replying or (self._turn is not None and not self._turn.is_finished)

    def _tabbed(self) -> TabbedContent:
        return self.query_ancestor(TabbedContent)

    # --- labels -------------------------------------------------------------------------------------

    def refresh_model_bar(self) -> None:
        sampling = self.sampling
        knobs = [f"temp {sampling.temperature:g}"]
        if sampling.top_p < 1:
            knobs.append(f"top-p {sampling.top_p:g}")
        if sampling.top_k:
            knobs.append(f"top-k {sampling.top_k}")
        if sampling.frequency_penalty:
            knobs.append(f"freq {sampling.frequency_penalty:g}")
        if sampling.presence_penalty:
            knobs.append(f"pres {sampling.presence_penalty:g}")
        knobs.append(f"max {sampling.max_tokens}")
        if sampling.seed is not None:
            knobs.append(f"seed {sampling.seed}")
        state = self.services.model_state(self.model)
        self.model_bar.update(
            Content.assemble(
                ("◆ ", "$accent"),
                (self.services.model_name(self.model), "bold"),
                (f"  {state}" if state else "", "$warning" if state else ""),
                ("   " + " · ".join(knobs), "dim"),
            ),
            layout=False,  # one line of fixed size: no need to reflow the screen
        )

    def _refresh_label(self) -> None:
        try:
            tab = self._tabbed().get_tab(self)
        except NoMatches:
            return
        tab.label = Content.assemble(("● ", "$success") if self.busy else "", self.title)

    def rename(self, title: str) -> None:
        self.title = title
        self.runner.rename(title)
        self._refresh_label()

    def set_model(self, model: str) -> None:
        self.runner.set_model(model)
        self.refresh_model_bar()

    def set_sampling(self, sampling: SamplingParams) -> None:
        self.runner.set_sampling(sampling)
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

    def on_text_area_changed(self, event: TextArea.Changed) -> None:
        """Typing: once it pauses, the turn so far is prefilled (LocalBackend.prefill), below every reply's
        priority, so that Enter finds the history and what was typed in the prefix cache."""
        if event.text_area is not self.prompt or not self.services.prefill_while_typing:
            return
        if self._typing is not None:
            self._typing.stop()
        self._typing = self.set_timer(TYPING_PAUSE_S, self._prefill_typed)

    def _prefill_typed(self) -> None:
        text, backend = self.prompt.text, self.services.backend()
        if not text.strip() or self.busy or backend is None or self.services.model_state(self.model):
            return  # nothing typed, a reply streaming (it is the priority), or the model not ready
        history = self.log_view.history()
        context = self.runner.context([*history, Past("user", text, -1)])

        async def prefill() -> None:
            model = await self.services.ensure_model(self.model)
            self.prefilled = await backend.prefill(self.conversation_id, context, model)

        self.run_worker(prefill(), group="prefill", exclusive=True, exit_on_error=False)

    async def on_prompt_submitted(self, event: Prompt.Submitted) -> None:
        event.stop()
        if not self.is_attached:  # the app is ending: what was typed before goes nowhere, as its keys do
            return
        if self.busy:
            self.prompt.restore(event.text)
            self.notify("A reply is still coming: Esc stops it.", severity="warning")
            return
        await self.send(event.text, event.t_enter)

    async def send(self, text: str, t_enter: float) -> None:
        message_id = self.runner.add_user_message(text)
        if self.title == NEW_TITLE:
            first_line = text.strip().splitlines()[0]
            self.rename(first_line[:TITLE_CHARS] + ("…" if len(first_line) > TITLE_CHARS else ""))
        await self._reply(t_enter, UserMessage(text, message_id))

    async def _reply(self, t_enter: float, sent: UserMessage | None = None) -> None:
        """The reply to the conversation so far, and to `sent`, the user's message not yet on screen."""
        history = self.log_view.history()
        context = self.runner.context([*history, Past.from_widget(sent)] if sent is not None else history)
        # Stored in the same step as the message: the turn is on record before anything of it is on screen.
        message_id = self.runner.start_reply()
        model = self.services.model_name(self.model)
        reply = AssistantMessage(
            "", status="streaming", message_id=message_id, model=model, pacer=self.services.pacer
        )
        try:
            if sent is not None:
                await self.log_view.add(sent, room=2)
            await self.log_view.add(reply)
        except MountError:  # nothing mounts once the app is ending
            return
        if not self.is_attached:
            # The app began to end while the turn waited for the screen (behind a paste's keys, say): no stream
            # for widgets on their way out; the app, ending, stores the reply as stopped.
            return
        self.log_view.anchor()  # a new turn always follows, even if the user had scrolled up
        self.meter.start(t_enter)
        self._turn = self.run_worker(self._stream_reply(reply, context, sent), group="turn", exit_on_error=False)
        self._refresh_label()

    async def _stream_reply(self, reply: AssistantMessage, context: list[Message], sent: UserMessage | None) -> None:
        outcome = await self.runner.stream(reply.message_id, context, _OnScreen(self, reply))
        usage = outcome.usage
        if usage is not None:
            self._say_what_was_left_out(usage)
            self.last_usage = usage
        if outcome.refused and sent is not None:  # a message too long for the context: back to the prompt
            await self._take_back(reply, sent, f"{outcome.error} Your message is back in the prompt.")
        elif outcome.status == "stopped" and not reply.text:
            await self._take_back(reply, sent)
        else:
            await reply.finish(outcome.status, outcome.error, usage.finish_detail if usage is not None else None)
        if outcome.error and not self._shown():  # out of sight: say which tab
            self.notify(outcome.error, title=f'Reply failed in "{self.title}"', severity="error")
        self._turn = None
        self._refresh_label()

    def _shown(self) -> bool:
        try:
            return self._tabbed().active_pane is self
        except NoMatches:  # closed
            return False

    def _say_what_was_left_out(self, usage: Usage) -> None:
        """A turn that left out more of the conversation than the last one: what, and what the turn prefilled
        (the kept history again, where the trim changed the prompt's start)."""
        before = self.last_usage.dropped_messages if self.last_usage is not None else 0
        if usage.dropped_messages <= before:
            return
        done = "are summarised in a note at the top" if usage.summary else "are left out"
        self.notify(
            f"The conversation outgrew {usage.context_tokens:,} tokens: its {usage.dropped_messages} oldest messages "
            f"({usage.dropped_tokens:,} tokens) {done} of what the model sees; the system prompt stays. This turn "
            f"prefilled {usage.prompt_tokens - usage.cached_tokens:,} tokens.",
            title=f'Context full in "{self.title}"', severity="warning", timeout=12,
        )

    async def _take_back(self, reply: AssistantMessage, sent: UserMessage | None,
                         why: str = "Stopped before the first token; your message is back in the prompt.") -> None:
        """Stopped before the first token, or refused before it ran: nothing to keep but the question, which
        goes back into the prompt for another try (a regenerated reply just disappears)."""
        removed: list[UserMessage | AssistantMessage] = [reply]
        if sent is not None:
            removed.append(sent)
            self.prompt.restore(sent.text)
            self.notify(why, severity="information" if why.startswith("Stopped") else "error", timeout=12)
        self.runner.delete(widget.message_id for widget in removed)
        await self.log_view.drop(removed)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        # Backend failures are caught in TurnRunner.stream; what gets here is a bug of ours. Say so, and free
        # the tab for the next message rather than leave it "busy" forever.
        if event.worker is self._turn and event.state == WorkerState.ERROR:
            self.runner.abandon()
            self._turn = None
            self._refresh_label()
            self.notify(f"{event.worker.error!r}", title="tuichat bug: the reply failed", severity="error")

    def stop(self) -> bool:
        """Stop the reply in flight; its text so far stays, marked stopped. False if there was none (or it is
        not streaming yet: its widgets are still being mounted)."""
        if self._turn is None or self._turn.is_finished:
            return False
        self.runner.stop()
        self._turn.cancel()
        return True

    async def regenerate(self) -> None:
        if self.busy:
            self.notify("A reply is still coming: Esc stops it first.", severity="warning")
            return
        await self.log_view.refill()
        messages = self._messages()
        if not messages or not isinstance(messages[-1], AssistantMessage):
            self.notify("No reply to regenerate.", severity="warning")
            return
        last = messages[-1]
        self.runner.delete([last.message_id])
        await last.remove()
        await self._reply(self.services.clock())

    async def edit_last(self) -> None:
        """Take the last user message (and the reply to it) back into the prompt, to change and resend."""
        if self.busy:
            self.notify("A reply is still coming: Esc stops it first.", severity="warning")
            return
        if self.prompt.text.strip():
            self.notify("The prompt holds a draft: send or clear it first.", severity="warning")
            return
        messages = self._messages()
        while self.earlier_count and not any(isinstance(w, UserMessage) for w in messages):
            await self.show_earlier()
            messages = self._messages()
        users = [index for index, w in enumerate(messages) if isinstance(w, UserMessage)]
        if not users:
            self.notify("No message to edit.", severity="warning")
            return
        tail = messages[users[-1] :]
        self.runner.delete(widget.message_id for widget in tail)
        self.prompt.text = tail[0].text
        self.prompt.move_cursor(self.prompt.document.end)
        self.prompt.focus()
        await self.log_view.drop(tail)
