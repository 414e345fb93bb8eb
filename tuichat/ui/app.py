"""The Textual app: tabs of conversations over one Backend.

Start-up never waits for the engine: the backend factory (which imports torch) runs in a thread worker and
the model loads in an async worker, so the first frame paints at once and the user can type meanwhile; a
message sent early waits for the load, with the meter counting.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from urllib.parse import urlsplit

from textual import events, work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal
from textual.driver import Driver
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, TabbedContent, TabPane
from textual.worker import Worker, WorkerCancelled, WorkerFailed, WorkerState

from tuichat import paths
from tuichat.backends.protocol import Backend, SamplingParams, TuichatError, chat_sampling
from tuichat.config import Config
from tuichat.locks import ConversationLocks, Owner
from tuichat.store import ConversationRow, Store
from tuichat.themes import load_themes
from tuichat.ui.chat import NEW_TITLE, TITLE_CHARS, ChatTab
from tuichat.ui.pacing import PaintPacer
from tuichat.ui.screens import (
    Dialog,
    FilteredList,
    ForkPicker,
    HelpScreen,
    ModelPicker,
    RenameScreen,
    SamplingScreen,
    SearchScreen,
)
from tuichat.ui.services import TabServices
from tuichat.ui.turns import sampling_key, stored_sampling
from tuichat.ui.widgets import EnginePanel, Prompt

FALLBACK_THEME = "textual-dark"
ENGINE_POLL_S = 0.5
TAB_ACTIONS = {"new_tab", "close_tab", "next_tab", "previous_tab"}
CONTEXT_POLICIES = {  # EngineOptions.context_policy, as the palette offers them
    "drop": "leave out its oldest turns, keeping the system prompt and the latest turns",
    "summarise": "have the model summarise its oldest turns into a note kept at the top",
    "refuse": "refuse the next message until you start a new conversation",
}


class ChatTabs(TabbedContent):
    def on_tab_pane_focused(self, event: TabPane.Focused) -> None:
        # TabbedContent shows the pane a focused widget is in, but that news comes by message: after fast
        # tab keys focus may already be in another pane, and obeying would show one tab while keys go to
        # another. prevent_default skips TabbedContent's own handler.
        focused = self.screen.focused
        if focused is None or event.tab_pane not in focused.ancestors:
            event.prevent_default()


class TuichatApp(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "tuichat"

    # Keys chosen to survive terminals: no ctrl+m/ctrl+i (they are Enter/Tab), no ctrl+w/ctrl+y/ctrl+e
    # (the prompt's TextArea uses them for editing). Every binding has an id, so [keymap] can rebind it.
    BINDINGS = [
        Binding("ctrl+q", "quit", "Quit", priority=True, id="app.quit"),
        Binding("f1", "help", "Keys", tooltip="Every key and its keymap id", id="app.help"),
        Binding("escape", "stop", "Stop", tooltip="Stop the reply; its text so far stays", id="reply.stop"),
        # priority: the action runs before the keys typed after it are delivered, so those land in the
        # prompt of the tab switched to, not in the one left behind.
        Binding("ctrl+t", "new_tab", "New tab", priority=True, id="tab.new"),
        Binding(
            "alt+w", "close_tab", "Close tab", tooltip="Close the tab; search finds it again", priority=True,
            id="tab.close",
        ),
        Binding("ctrl+pagedown,alt+right", "next_tab", "Next tab", show=False, priority=True, id="tab.next"),
        Binding(
            "ctrl+pageup,alt+left", "previous_tab", "Previous tab", show=False, priority=True, id="tab.previous"
        ),
        Binding("f2", "rename", "Rename", tooltip="Rename this conversation", show=False, id="tab.rename"),
        Binding(
            "f3", "sampling", "Sampling", tooltip="Temperature, top-p, top-k, penalties, max tokens and seed of this tab",
            show=False, id="tab.sampling",
        ),
        Binding("ctrl+o", "pick_model", "Model", tooltip="Pick this tab's model", id="model.pick"),
        Binding("ctrl+b", "toggle_engine", "Engine", tooltip="Show or hide the engine panel", id="engine.toggle"),
        Binding(
            "ctrl+r", "regenerate", "Regenerate", tooltip="Answer the last message again", show=False,
            id="reply.regenerate",
        ),
        Binding(
            "ctrl+g", "edit_last", "Edit last", tooltip="Last message back into the prompt, to change and resend",
            show=False, id="reply.edit",
        ),
        Binding("alt+c", "copy_reply", "Copy reply", tooltip="Copy the last reply", show=False, id="copy.reply"),
        Binding("f5", "fork", "Fork", tooltip="Fork at a message into a new tab sharing its KV", show=False,
                id="tab.fork"),
        Binding("f9", "send_all", "Send to all tabs", tooltip="Send the message typed here to every tab", show=False,
                id="tab.send_all"),
        Binding(
            "alt+b", "copy_code", "Copy code", tooltip="Copy the last code block of the last reply", show=False,
            id="copy.code",
        ),
        Binding(
            "ctrl+f", "search", "Search", tooltip="Full-text search over every conversation", id="history.search"
        ),
        Binding(
            "ctrl+s", "export", "Export", tooltip="Write this conversation to a Markdown file", show=False,
            id="history.export",
        ),
        Binding("f8", "change_theme", "Theme", tooltip="Pick a theme (remembered)", show=False, id="app.theme"),
    ]

    def __init__(
        self,
        backend_factory: Callable[[], Backend],
        config: Config,
        store: Store,
        warnings: Sequence[str] = (),
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.config = config
        self.store = store
        # The conversations this instance has as tabs: another tuichat on the same history leaves them alone.
        self.locks = ConversationLocks(store.path.parent / "locks")
        self._locks_failed = False
        self._backend_factory = backend_factory
        # Input the app took from the terminal and handed on, kept until done with (weakly), so that ending on a
        # signal can void what is still queued; and whether it is ending so.
        self._input_in_flight: weakref.WeakSet[events.Event] = weakref.WeakSet()
        self._ending = False
        self._warnings = list(warnings)
        self.backend: Backend | None = None
        self._backend_ready = asyncio.Event()
        self._backend_error: str | None = None
        self._loads: dict[str, Worker[str]] = {}  # model spec -> its load (shared by the tabs that wait)
        self._model_states: dict[str, str] = {}  # model spec -> "loading 40% · ..." / "load failed: ..."
        self._canonical: dict[str, str] = {}  # model spec -> the name backend.load returned
        self.known_models: dict[str, str] = {spec: "from config" for spec in config.models}
        self._theme_ready = False
        # The [keymap] rebindings given to set_keymap, kept for showing keys: Textual has no public getter.
        self._rebound: dict[str, str] = {}
        self.tab_services = TabServices(
            store=store,
            backend=lambda: self.backend,
            ensure_model=self.ensure_model,
            model_name=self.model_name,
            model_state=self.model_state,
            default_sampling=self.default_sampling,
            system_prompt=config.system_prompt,
            pacer=PaintPacer(),  # one for every tab: they all paint on this thread
            clock=clock,  # tests pass a virtual clock so the meter's numbers are fixed
            prefill_while_typing=config.prefill_while_typing,
        )

    # --- start-up -----------------------------------------------------------------------------------

    def compose(self):
        rows, elsewhere = [], []
        for row in self.store.conversations(open_only=True):
            owner = self._claim(row.id)
            if owner is None:
                rows.append(row)
            else:
                elsewhere.append((row.title, owner))
        if elsewhere:
            owners = ", ".join(sorted({str(owner) for _, owner in elsewhere}))
            titles = ", ".join(f'"{title}"' for title, _ in elsewhere)
            self.notify(
                f"Open in {owners}, so not here: {titles}. Close them there to continue them here.",
                title="Another tuichat", severity="warning", timeout=20,
            )
        if not rows:
            rows = [self._new_conversation()]
        active = self.store.get_setting("active_conversation")
        initial = f"conv-{active}" if active in {row.id for row in rows} else f"conv-{rows[0].id}"
        with Horizontal(id="main"):
            with ChatTabs(initial=initial, id="tabs"):
                for row in rows:
                    yield self._make_tab(row)
            yield EnginePanel(id="engine-panel")
        yield Footer()

    def _claim(self, conversation_id: str) -> Owner | None:
        """Hold the conversation for this instance (tuichat.locks); returns the other owner if there is one."""
        try:
            return self.locks.claim(conversation_id)
        except OSError as error:  # no locks on this file system, say: go on unguarded, and say so once
            if not self._locks_failed:
                self._locks_failed = True
                self.notify(
                    f"Conversations cannot be locked ({error}); a second tuichat on this history could write "
                    "into the same conversation.", title="History", severity="warning", timeout=20,
                )
            return None

    def _new_conversation(self) -> ConversationRow:
        row = self.store.conversation(self.store.create_conversation(NEW_TITLE, self.config.model))
        self._claim(row.id)  # new, so nobody else holds it
        return row

    def _make_tab(self, row: ConversationRow) -> ChatTab:
        sampling = stored_sampling(self.store.get_setting(sampling_key(row.id)))
        return ChatTab(
            row.id, row.title, row.model, sampling, self.store.messages(row.id), services=self.tab_services
        )

    def on_mount(self) -> None:
        for warning in self._warnings:
            self.notify(warning, title="Settings", severity="warning", timeout=10)
        self._apply_keymap()
        self._apply_themes()
        self._engine_timer = self.set_interval(ENGINE_POLL_S, self._refresh_engine_panel, pause=True)
        self._create_backend()
        self.active_tab.prompt.focus()
        if not self.is_headless:  # a real terminal (tests keep the test runner's own signal handling)
            # Python's own handler, not the event loop's: it runs between two bytecodes of the main thread, so
            # also while the loop is held up (a widget handles its whole queue in one turn of the loop).
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGTERM, signal.SIGHUP):
                signal.signal(signum, lambda signum, _frame: self._quit_on_signal(loop, signum))

    def get_driver_class(self) -> type[Driver]:
        driver = super().get_driver_class()
        if os.name == "posix":
            from textual.drivers.linux_driver import LinuxDriver

            from tuichat.ui.terminal import TerminalDriver

            if driver is LinuxDriver:  # not one TEXTUAL_DRIVER names
                return TerminalDriver
        return driver

    def _quit_on_signal(self, loop: asyncio.AbstractEventLoop, signum: int) -> None:
        # As ctrl+q: the reply in flight is saved as stopped and the terminal restored (Python's default
        # would end the process with the terminal in the alternate screen and the reply "streaming").
        # But not after the input still queued: keys typed in by a paste can be thousands, each an edit of the
        # prompt, and Textual closes a widget only once it has handled its queue (after a hangup, for nobody).
        # This may interrupt the loop's own code: it only sets flags and hands the exit to the loop.
        # 128 + the signal, as a shell reports a process the signal ended.
        if self._ending or loop.is_closed():
            return
        self._ending = True
        if hasattr(self._driver, "end_input"):  # tuichat.ui.terminal's
            self._driver.end_input()
        for event in self._input_in_flight:
            event.prevent_default()  # no handler runs
            event.stop()  # nor does it bubble up to one
        loop.call_soon_threadsafe(partial(self.exit, return_code=128 + signum))

    async def on_event(self, event: events.Event) -> None:
        if isinstance(event, (events.InputEvent, events.Paste)) and not event.is_forwarded:  # from the terminal
            if self._ending:
                return
            self._input_in_flight.add(event)
        await super().on_event(event)

    def _apply_keymap(self) -> None:
        known = {binding.id for binding in self.all_bindings()}
        unknown = sorted(set(self.config.keymap) - known)
        if unknown:
            self.notify(
                f"Unknown binding ids in [keymap]: {', '.join(unknown)}. Known: {', '.join(sorted(known))}.",
                title="Settings",
                severity="warning",
                timeout=10,
            )
        self._rebound = {key: value for key, value in self.config.keymap.items() if key in known}
        self.set_keymap(self._rebound)

    def _apply_themes(self) -> None:
        themes, warnings = load_themes()
        for warning in warnings:
            self.notify(warning, title="Theme", severity="warning", timeout=10)
        for theme in themes:
            self.register_theme(theme)
        wanted = self.store.get_setting("theme") or self.config.theme
        if wanted not in self.available_themes:
            fallback = self.config.theme if self.config.theme in self.available_themes else FALLBACK_THEME
            self.notify(f'Theme "{wanted}" not found; using "{fallback}".', title="Theme", severity="warning")
            wanted = fallback
        self.theme = wanted
        self._theme_ready = True

    def watch_theme(self, theme: str) -> None:
        if self._theme_ready:
            self.store.set_setting("theme", theme)

    @work(thread=True, exit_on_error=False, group="startup")
    def _create_backend(self) -> None:
        try:
            backend = self._backend_factory()
        except Exception as error:
            self.call_from_thread(self._backend_failed, f"{type(error).__name__}: {error}")
        else:
            self.call_from_thread(self._backend_created, backend)

    def _backend_created(self, backend: Backend) -> None:
        self.backend = backend
        self._backend_ready.set()
        self._refresh_model_bars()
        self._preload(self.active_tab.model)
        self._list_models()

    def _backend_failed(self, error: str) -> None:
        self._backend_error = f"The engine did not start: {error}"
        self._backend_ready.set()
        self.notify(self._backend_error, title="Engine", severity="error", timeout=30)
        self._refresh_model_bars()

    async def on_unmount(self) -> None:
        # Replies still open have nothing left to end them: a turn sent as the app ended, its widget never
        # mounted or its worker never started, or one cut off by the end.
        for turn in list(self.tab_services.open_turns):
            turn.abandon()
        if self.backend is not None:
            await self.backend.close()
        self.locks.release_all()  # after the replies cut short by quitting are saved

    # --- models -------------------------------------------------------------------------------------

    async def wait_for_backend(self) -> Backend:
        await self._backend_ready.wait()
        if self.backend is None:
            raise TuichatError(self._backend_error or "The engine did not start.")
        return self.backend

    async def ensure_model(self, spec: str) -> str:
        """Load `spec` once (tabs asking at the same time share the load) and return its canonical name."""
        backend = await self.wait_for_backend()
        load = self._loads.get(spec)
        if load is None or load.state in (WorkerState.ERROR, WorkerState.CANCELLED):
            load = self.run_worker(self._load_model(backend, spec), group="load", exit_on_error=False)
            self._loads[spec] = load
        try:
            # shield: Esc in one tab cancels its wait, not the load another tab may be waiting for too.
            return await asyncio.shield(load.wait())
        except WorkerFailed as failed:
            error = failed.error
            raise error if isinstance(error, TuichatError) else TuichatError(f"{spec}: {error}") from error
        except WorkerCancelled:
            raise TuichatError(f"Loading {spec} was cancelled.") from None

    async def _load_model(self, backend: Backend, spec: str) -> str:
        loop = asyncio.get_running_loop()

        def progress(what: str, fraction: float | None) -> None:
            # Called from the loader's thread or from the loop: call_soon_threadsafe serves both.
            try:
                loop.call_soon_threadsafe(self._show_progress, spec, what, fraction)
            except RuntimeError:  # the app has quit while the model was loading
                pass

        self._set_model_state(spec, "loading…")
        try:
            name = await backend.load(spec, progress)
        except Exception as error:
            self._set_model_state(spec, f"load failed: {error}")
            raise
        self._canonical[spec] = name
        self._set_model_state(spec, "")
        return name

    def _show_progress(self, spec: str, what: str, fraction: float | None) -> None:
        if self._loads.get(spec) is not None and self._loads[spec].state == WorkerState.RUNNING:
            percent = "" if fraction is None else f" {fraction:.0%}"
            self._set_model_state(spec, f"loading{percent} · {what}")

    def _set_model_state(self, spec: str, state: str) -> None:
        self._model_states[spec] = state
        self._refresh_model_bars()

    def model_state(self, spec: str) -> str:
        if not self._backend_ready.is_set():
            return "starting the engine…"
        if self.backend is None:
            return "engine failed"
        return self._model_states.get(spec, "")

    def default_sampling(self, spec: str) -> SamplingParams:
        """The config's [sampling] over what the model recommends (known once it is loaded)."""
        recommended = self.backend.sampling_defaults(self.model_name(spec)) if self.backend else {}
        return chat_sampling(recommended, self.config.sampling)

    def model_name(self, spec: str) -> str:
        return self._canonical.get(spec, spec)

    def _refresh_model_bars(self) -> None:
        for tab in self.query(ChatTab):
            tab.refresh_model_bar()
        self.sub_title = self.model_name(self.active_tab.model) if self.is_mounted else ""

    @work(group="preload", exit_on_error=False)
    async def _preload(self, spec: str) -> None:
        try:
            await self.ensure_model(spec)
        except TuichatError as error:  # a reply waiting for it shows the error in place, too
            self.notify(str(error), title=f"{spec} did not load", severity="error", timeout=15)

    @work(thread=True, group="models", exit_on_error=False)
    def _list_models(self) -> None:
        # A thread: listing may scan the Hugging Face cache on disk.
        found = {info.spec: info.description or info.kind for info in self.backend.list_models()}
        self.call_from_thread(self._add_known_models, found)

    def _add_known_models(self, found: dict[str, str]) -> None:
        for spec, description in found.items():
            self.known_models.setdefault(spec, description)
        if isinstance(self.screen, ModelPicker):
            self.screen.add_models(found)

    def switch_model(self, tab: ChatTab, spec: str) -> None:
        if spec == tab.model:
            return
        tab.set_model(spec)
        self._refresh_model_bars()
        if self._backend_error is None:
            self._preload(spec)
        self.notify(f"{tab.title}: next reply from {spec}.", title="Model")

    # --- tabs ---------------------------------------------------------------------------------------

    @property
    def tabbed(self) -> TabbedContent:
        return self.query_one("#tabs", TabbedContent)

    @property
    def active_tab(self) -> ChatTab:
        return self.tabbed.active_pane  # type: ignore[return-value]

    def tabs(self) -> list[ChatTab]:
        return list(self.query(ChatTab))

    def _save_tab_order(self) -> None:
        for position, tab in enumerate(self.tabs()):
            self.store.set_open(tab.conversation_id, True, position=position)

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        tab = event.pane
        # The event may be stale (fast tab keys): focusing its prompt would switch back to it. It may also
        # arrive while the app shuts down, its widgets already gone.
        if isinstance(tab, ChatTab) and tab.is_attached and tab is event.tabbed_content.active_pane:
            self.screen.set_focus(tab.prompt)
            self.store.set_setting("active_conversation", tab.conversation_id)
            self.sub_title = self.model_name(tab.model)
            if self.query_one(EnginePanel).display:
                self._refresh_engine_panel()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # Tab keys are priority bindings, which would otherwise act under an open dialog.
        return not (action in TAB_ACTIONS and isinstance(self.screen, ModalScreen))

    def activate(self, tab: ChatTab) -> None:
        self.tabbed.active = tab.id
        # Not tab.prompt.focus(): that is queued behind keys the user may already have typed.
        self.screen.set_focus(tab.prompt)

    async def open_tab(self, row: ConversationRow) -> ChatTab:
        tab = self._make_tab(row)
        await self.tabbed.add_pane(tab)
        self.activate(tab)
        self._save_tab_order()
        return tab

    async def action_new_tab(self) -> None:
        tab = await self.open_tab(self._new_conversation())
        self._preload(tab.model)

    def action_fork(self) -> None:
        tab = self.active_tab
        rows = [(r.id, r.role, r.content) for r in self.store.messages(tab.conversation_id)
                if r.role in ("user", "assistant") and r.status != "streaming" and r.content]
        if not rows:
            self.notify("Nothing to fork yet: this conversation has no messages.", severity="warning")
            return

        def chosen(message_id: int | None) -> None:
            if message_id is not None:
                self.run_worker(self._fork(tab, message_id), group="fork", exit_on_error=False)

        self.push_screen(ForkPicker(rows), chosen)

    async def _fork(self, tab: ChatTab, message_id: int) -> None:
        """A new tab with the conversation up to the chosen reply (or, for a message of the user's, up to the
        reply before it, the message itself back in the prompt): the same token ids up to there, so its first
        turn finds them in the prefix cache."""
        rows = self.store.messages(tab.conversation_id)
        chosen = next(r for r in rows if r.id == message_id)
        through = message_id if chosen.role == "assistant" else max((r.id for r in rows if r.id < message_id), default=0)
        fork = self.store.fork(tab.conversation_id, through, f"{tab.title} · fork"[:TITLE_CHARS])
        self._claim(fork)
        if (sampling := self.store.get_setting(sampling_key(tab.conversation_id))) is not None:
            self.store.set_setting(sampling_key(fork), sampling)
        new = await self.open_tab(self.store.conversation(fork))
        if chosen.role == "user":
            new.prompt.restore(chosen.content)
        self.notify(f"Forked \"{tab.title}\" into a new tab: its first turn reuses the shared history's KV.",
                    title="Fork")

    async def action_send_all(self) -> None:
        """The message typed in this tab, sent in every tab at once: the engine batches their replies."""
        source = self.active_tab
        text = source.prompt.text
        if not text.strip():
            self.notify("Type the message to send to every tab first.", severity="warning")
            return
        targets = [tab for tab in self.tabs() if not tab.busy]
        source.prompt.remember(text)
        source.prompt.clear()
        t_enter = self.tab_services.clock()
        for tab in targets:
            await tab.send(text, t_enter)
        if len(targets) < len(self.tabs()):
            self.notify(f"Sent to {len(targets)} of {len(self.tabs())} tabs: the others are still replying.",
                        severity="warning")

    async def action_close_tab(self) -> None:
        tab = self.active_tab
        tab.stop()
        self.store.set_open(tab.conversation_id, False)
        self.locks.release(tab.conversation_id)
        await self.tabbed.remove_pane(tab.id)
        self.notify(f'Closed "{tab.title}"; search (ctrl+f) finds it again.')
        if not self.tabs():
            await self.action_new_tab()
        else:
            self.activate(self.active_tab)
            self._save_tab_order()

    def action_next_tab(self, step: int = 1) -> None:
        tabs = self.tabs()
        self.activate(tabs[(tabs.index(self.active_tab) + step) % len(tabs)])

    def action_previous_tab(self) -> None:
        self.action_next_tab(-1)

    def action_rename(self) -> None:
        tab = self.active_tab

        def renamed(title: str | None) -> None:
            if title:
                tab.rename(title)

        self.push_screen(RenameScreen(tab.title), renamed)

    def action_sampling(self) -> None:
        tab = self.active_tab

        def chosen(sampling) -> None:
            if sampling is not None:
                tab.set_sampling(sampling)

        self.push_screen(SamplingScreen(tab.sampling), chosen)

    # --- replies ------------------------------------------------------------------------------------

    def action_stop(self) -> None:
        self.active_tab.stop()

    async def action_regenerate(self) -> None:
        await self.active_tab.regenerate()

    async def action_edit_last(self) -> None:
        await self.active_tab.edit_last()

    def copy(self, text: str, what: str) -> None:
        self.copy_to_clipboard(text)
        # OSC 52 has no reply: the terminal may ignore it (or need it enabled), so do not claim success.
        self.notify(f"Sent {what} ({len(text):,} characters) via OSC 52; some terminals ignore it.", title="Copy")

    def action_copy_reply(self) -> None:
        reply = self.active_tab.last_reply()
        if reply is None or not reply.text:
            self.notify("No reply to copy yet.", severity="warning")
        else:
            self.copy(reply.text, "the last reply")

    def action_copy_code(self, index: int = -1) -> None:
        reply = self.active_tab.last_reply()
        blocks = reply.code_blocks() if reply is not None else []
        if not blocks:
            self.notify("The last reply has no code block.", severity="warning")
        else:
            self.copy(blocks[index].code, "the code block")

    # --- dialogs ------------------------------------------------------------------------------------

    def action_pick_model(self) -> None:
        tab = self.active_tab
        models = {tab.model: "this tab", self.config.model: "default for new tabs", **self.known_models}

        def chosen(spec: str | None) -> None:
            if spec:
                self.switch_model(tab, spec)

        self.push_screen(ModelPicker(models, tab.model), chosen)
        if self.backend is not None:
            self._list_models()

    def action_search(self) -> None:
        async def chosen(hit) -> None:
            if hit is not None:
                await self.open_conversation(hit.conversation_id, hit.message_id)

        self.push_screen(SearchScreen(), chosen)

    async def open_conversation(self, conversation_id: str, message_id: int | None = None) -> None:
        tab = next((t for t in self.tabs() if t.conversation_id == conversation_id), None)
        if tab is None:
            owner = self._claim(conversation_id)
            if owner is not None:
                title = self.store.conversation(conversation_id).title
                self.notify(
                    f'"{title}" is open in {owner}; close it there to continue it here.',
                    title="Another tuichat", severity="warning", timeout=15,
                )
                return
            self.store.set_open(conversation_id, True)
            tab = await self.open_tab(self.store.conversation(conversation_id))
        else:
            self.activate(tab)
        if message_id is not None:
            tab.call_after_refresh(tab.reveal, message_id)

    def action_export(self) -> None:
        tab = self.active_tab
        slug = re.sub(r"[^\w-]+", "-", tab.title).strip("-")[:40] or "conversation"
        try:
            # As private as the history it copies (the file names hold the titles, too).
            path = paths.private_dir(paths.data_dir() / "exports") / f"{slug}-{tab.conversation_id[:8]}.md"
            paths.write_private(path, self.store.export_markdown(tab.conversation_id))
        except OSError as error:
            self.notify(f"Export failed: {error}", severity="error")
        else:
            self.notify(str(path), title="Exported", timeout=10)

    def open_url(self, url: str, *, new_tab: bool = True) -> None:
        # Every link click ends here (Markdown.LinkClicked included). Links in replies are model output: a
        # file:, javascript: or custom-scheme link must reach neither the browser nor the desktop's handlers.
        if urlsplit(url).scheme.lower() in ("http", "https"):
            super().open_url(url, new_tab=new_tab)
        else:
            shown = url if len(url) <= 80 else url[:79] + "…"
            self.notify(
                f"Not opened: {shown}\nOnly http and https links open.", title="Link", severity="warning",
                markup=False,
            )

    @classmethod
    def all_bindings(cls) -> list[Binding]:
        """Every binding tuichat defines (Textual's widgets add their own, such as the prompt's editing keys)."""
        return [
            *Prompt.BINDINGS,
            *cls.BINDINGS,
            *Dialog.BINDINGS,
            *FilteredList.BINDINGS,
            *HelpScreen.BINDINGS,
        ]

    def action_help(self) -> None:
        def row(binding: Binding) -> tuple[str, str, str]:
            return self._keys_display(binding), binding.tooltip or binding.description, binding.id

        palette = self._keys_display(Binding(self.COMMAND_PALETTE_BINDING, ""))
        rows = [
            *map(row, Prompt.BINDINGS),
            ("↑ / ↓", "Earlier prompts (in an empty prompt)", ""),
            *map(row, self.BINDINGS),
            (palette, "Command palette: every action, model and code block", ""),
            *map(row, [*Dialog.BINDINGS, *FilteredList.BINDINGS, *HelpScreen.BINDINGS]),
        ]
        self.push_screen(HelpScreen(rows))

    def _keys_display(self, binding: Binding) -> str:
        keys = self._rebound.get(binding.id, binding.key) if binding.id else binding.key
        return ", ".join(self.get_key_display(Binding(key.strip(), "")) for key in keys.split(","))

    def action_toggle_engine(self) -> None:
        panel = self.query_one(EnginePanel)
        panel.display = not panel.display
        if panel.display:
            self._refresh_engine_panel()
            self._engine_timer.resume()
        else:
            self._engine_timer.pause()

    def _refresh_engine_panel(self) -> None:
        panel = self.query_one(EnginePanel)
        tab = self.active_tab
        if self.backend is None:
            panel.show(None, None, self._backend_error or "starting the engine…")
            return
        try:
            stats = self.backend.stats(self._canonical.get(tab.model, tab.model))
        except Exception as error:  # stats of a model that failed to load, for one
            panel.show(None, None, str(error))
            return
        panel.show(stats, tab.last_usage)

    # --- command palette ----------------------------------------------------------------------------

    def set_context_policy(self, policy: str) -> None:
        """For this session (config.toml's engine.context_policy sets it for every session)."""
        setter = getattr(self.backend, "set_context_policy", None)
        if setter is None:
            self.notify("The engine has not started yet.", severity="warning")
            return
        setter(policy)
        self.notify(f"Context policy: {policy}. {CONTEXT_POLICIES[policy].capitalize()}.", title="Context")

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        # Textual's own: Theme, Quit, Screenshot... ("Keys" is replaced by ours, which lists every binding).
        yield from (command for command in super().get_system_commands(screen) if command.title != "Keys")
        for binding in self.BINDINGS:
            if binding.id not in ("app.quit", "app.theme"):
                help_text = f"{binding.tooltip or binding.description} · {self._keys_display(binding)}"
                yield SystemCommand(binding.description, help_text, partial(self.run_action, binding.action))
        for spec in self.known_models:
            yield SystemCommand(
                f"Model: {spec}",
                "Use it for this tab's next reply",
                partial(self.switch_model, self.active_tab, spec),
                discover=False,
            )
        for policy, what in CONTEXT_POLICIES.items():
            yield SystemCommand(f"Context policy: {policy}", f"A conversation that outgrows the model's context: {what}",
                                partial(self.set_context_policy, policy))
        reply = self.active_tab.last_reply()
        for index, block in enumerate(reply.code_blocks() if reply else []):
            lines = block.code.count("\n") + 1
            yield SystemCommand(
                f"Copy code block {index + 1}",
                f"{block.lexer or 'text'}, {lines} lines, from the last reply",
                partial(self.action_copy_code, index),
            )


def run_tui(
    backend_factory: Callable[[], Backend], config: Config, store: Store, warnings: list[str]
) -> None:
    app = TuichatApp(backend_factory, config, store, warnings)
    try:
        app.run()
    finally:
        store.close()
    sys.exit(app.return_code or 0)  # 1 after a crash, 128 + N after signal N
