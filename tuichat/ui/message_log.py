"""A conversation's scrolling log of messages, of which only a window at the bottom is mounted."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from textual import events
from textual.containers import VerticalScroll
from textual.content import Content
from textual.css.query import NoMatches
from textual.message import Message as UIMessage
from textual.widgets import Static

from tuichat.ui.messages import AssistantMessage, Past, UserMessage

# Every layout (a streamed token, a keypress that wraps) walks every widget mounted in the visible tab, so a
# log mounts only its last WINDOW messages (several screens of text); earlier ones are mounted PAGE at a time
# on demand. tests/test_ui_long.py measures what the number mounted costs.
WINDOW = 20
PAGE = 20


class EarlierMessages(Static):
    """The top line of a log whose earlier messages are not mounted: a click (or PageUp, or scrolling to
    the top) mounts the previous page."""

    def on_click(self, event: events.Click) -> None:
        event.stop()
        self.post_message(MessageLog.ShowEarlier())


class MessageLog(VerticalScroll):
    """The messages of a conversation: the last WINDOW mounted (more once earlier pages are asked for), the
    ones above them kept as Past. It follows new text until the user scrolls up, and again at the bottom."""

    class ShowEarlier(UIMessage):
        """Mount the previous page of messages."""

    def __init__(self, past: Sequence[Past], **kwargs) -> None:
        super().__init__(**kwargs)
        self._past = list(past)  # only needed to compose
        self._earlier: list[Past] = []  # messages above the mounted window, oldest first

    def compose(self):
        self._earlier = self._past[:-WINDOW]  # oldest first; the window is mounted below them
        yield EarlierMessages(classes="earlier")
        for message in self._past[-WINDOW:]:
            yield message.widget()
        self._past = []

    def on_mount(self) -> None:
        self._show_earlier_count()
        self.anchor()

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        if new_value <= 0 < old_value and self.max_scroll_y > 0:  # scrolled to the top (not shrunk to fit)
            self.post_message(self.ShowEarlier())

    async def on_message_log_show_earlier(self, event: ShowEarlier) -> None:
        event.stop()
        await self.show_earlier()

    # --- the messages -------------------------------------------------------------------------------

    def messages(self) -> list[UserMessage | AssistantMessage]:
        """The mounted messages, oldest first."""
        return [w for w in self.children if isinstance(w, (UserMessage, AssistantMessage))]

    def history(self) -> list[Past]:
        """Every message of the conversation, mounted or not, oldest first."""
        return [*self._earlier, *map(Past.from_widget, self.messages())]

    def last_reply(self) -> AssistantMessage | None:
        replies = [w for w in self.messages() if isinstance(w, AssistantMessage)]
        return replies[-1] if replies else None

    async def add(self, message: UserMessage | AssistantMessage, *, room: int = 1) -> None:
        """Mount a new message at the bottom, making room for `room` new ones in the window first."""
        await self._trim(room)
        await self.mount(message)

    async def drop(self, messages: Sequence[UserMessage | AssistantMessage]) -> None:
        """Unmount messages taken out of the conversation; earlier ones fill the window back."""
        await self.remove_children(messages)
        await self.refill()

    # --- the mounted window -------------------------------------------------------------------------

    @property
    def earlier_count(self) -> int:
        """Messages of the conversation above the mounted window."""
        return len(self._earlier)

    def _show_earlier_count(self) -> None:
        bar = self.query_one(EarlierMessages)
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
        page, self._earlier[-count:] = self._earlier[-count:], []
        mounted = self.messages()
        first = mounted[0] if mounted else None
        top_before = first.virtual_region.y if first is not None else 0
        await self.mount_all([message.widget() for message in page], after=self.query_one(EarlierMessages))
        self._show_earlier_count()
        if first is not None and self.scroll_y < self.max_scroll_y:  # not following: stay on the same text
            # The page pushes `first` down by its height: scroll by as much.
            self._after_layout(
                lambda: first.virtual_region.y != top_before,
                lambda: self.scroll_to(
                    y=self.scroll_y + first.virtual_region.y - top_before, animate=False, immediate=True
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
        mounted = self.messages()
        excess = mounted[: max(len(mounted) + room - WINDOW, 0)]
        if excess:
            self._earlier.extend(map(Past.from_widget, excess))
            await self.remove_children(excess)
            self._show_earlier_count()

    async def refill(self) -> None:
        """After messages at the bottom went away: mount earlier ones back up to WINDOW."""
        missing = WINDOW - len(self.messages())
        if missing > 0 and self._earlier:
            await self.show_earlier(missing)

    async def reveal(self, message_id: int) -> None:
        """Scroll to a message (a search hit) and highlight it for a moment, mounting it if it is earlier."""
        index = next((i for i, m in enumerate(self._earlier) if m.message_id == message_id), None)
        if index is not None:  # mount down to it, with some context above it to center it in
            await self.show_earlier(len(self._earlier) - max(index - PAGE // 2, 0))
        try:
            widget = self.query_one(f"#msg-{message_id}")
        except NoMatches:
            return
        widget.add_class("-found")
        self.set_timer(3, lambda: widget.remove_class("-found"))
        self.release_anchor()  # or the next layout scrolls back to the bottom
        self._after_layout(
            lambda: bool(widget.virtual_region.size),
            lambda: self.scroll_to_center(widget, animate=False, immediate=True),
        )

    async def scroll_pages(self, pages: int) -> None:
        """A user scroll: scrolling up stops following new text, reaching the bottom resumes it."""
        if pages < 0:
            if self.scroll_y <= 0:  # already at the top: show earlier messages
                await self.show_earlier()
            self.scroll_page_up()
        else:
            self.scroll_page_down()
