"""The widgets of a conversation's messages: the user's, and the assistant's reply, streamed chunk by chunk
and then rendered whole; and Past, a message kept as data while it is not mounted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from textual.containers import Vertical
from textual.timer import Timer
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownFence, MarkdownStream

if TYPE_CHECKING:
    from tuichat.store import MessageRow
    from tuichat.ui.pacing import PaintPacer


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


class AssistantMessage(Vertical):
    """A reply: Markdown (code highlighted by Textual's fences) that grows chunk by chunk while streaming,
    then renders once in full; a status line when it stopped, failed or was cut short (a full KV cache,
    the context length)."""

    STATUS_LABELS = {"stopped": "⏹ stopped"}

    def __init__(
        self, text: str, *, status: str, message_id: int, model: str, error: str | None = None,
        detail: str | None = None, pacer: PaintPacer | None = None,
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
        self._pacer = pacer  # a reply that streams has one; without, every chunk is painted at once
        # Held, not queried: a reply mounted as the app ends mounts without its children.
        self._role = Static(self.model, classes="role", markup=False)
        self._status = Static(classes="status", markup=False)

    def compose(self):
        yield self._role
        yield Markdown(self.text)
        yield self._status

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
        self._role.update(model)

    async def append(self, text: str, *, paint: bool = True) -> None:
        """Add a chunk. It is painted at once if the paint pacer says a paint is due, else by a
        timer, with whatever else arrives meanwhile; `paint=False` (a hidden tab) keeps it until `paint()`.
        Each paint re-parses only the last block (MarkdownStream), so a token costs the same at the end of
        a long reply as at the start."""
        self._chunks.append(text)
        self._unpainted.append(text)
        if not paint or self._paint_timer is not None:
            return
        wait = self._pacer.wait() if self._pacer is not None else 0
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
        if self._pacer is not None:
            self._pacer.painted()
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
        status = self._status
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
