"""Modal dialogs: model picker, search, rename, sampling, help. Each dismisses with its answer (None when
the user backs out with Esc)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from textual.binding import Binding
from textual.containers import Grid, Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.timer import Timer
from textual.widgets import DataTable, Input, Label, OptionList, Static
from textual.widgets.option_list import Option

from tuichat.backends.protocol import SamplingParams, TuichatError

if TYPE_CHECKING:
    from tuichat.store import SearchHit


class Dialog(ModalScreen):
    BINDINGS = [Binding("escape", "dismiss_none", "Close", tooltip="Close a dialog", id="dialog.close")]

    def action_dismiss_none(self) -> None:
        self.dismiss(None)


class FilteredList(Dialog):
    """An Input that filters an OptionList below it; ↑/↓ move through the list while typing."""

    BINDINGS = [
        Binding("down", "move(1)", "Next", tooltip="Next item of a dialog's list", show=False, id="dialog.next"),
        Binding(
            "up", "move(-1)", "Previous", tooltip="Previous item of a dialog's list", show=False,
            id="dialog.previous",
        ),
    ]

    def action_move(self, step: int) -> None:
        options = self.query_one(OptionList)
        if options.option_count:
            current = options.highlighted
            options.highlighted = 0 if current is None else (current + step) % options.option_count

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.choose(event.option)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        options = self.query_one(OptionList)
        if options.highlighted is not None:
            self.choose(options.get_option_at_index(options.highlighted))

    def choose(self, option: Option) -> None:
        raise NotImplementedError


class ModelPicker(FilteredList):
    """Pick the current tab's model: what the backend finds plus config.models; typing a spec that is not
    listed (a hub id, a path) offers it as is."""

    def __init__(self, models: dict[str, str], current: str) -> None:
        super().__init__()
        self.models = dict(models)  # spec -> description
        self.current = current

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label(Content.assemble("Model for this tab — now ", (self.current, "bold")))
            yield Input(placeholder="filter, or type any model spec", id="model-filter")
            yield OptionList(id="model-list")
            yield Static("Enter picks · Esc cancels · applies to this tab's next reply", classes="hint")

    def on_mount(self) -> None:
        self._refilter("")

    def add_models(self, models: dict[str, str]) -> None:
        for spec, description in models.items():
            self.models.setdefault(spec, description)
        self._refilter(self.query_one(Input).value)

    def on_input_changed(self, event: Input.Changed) -> None:
        self._refilter(event.value)

    def _refilter(self, typed: str) -> None:
        needle = typed.strip().lower()
        options = [
            Option(
                Content.assemble(
                    ("● " if spec == self.current else "  ", "$accent"),
                    (spec, "bold"),
                    (f"  {description}", "dim"),
                ),
                id=spec,
            )
            for spec, description in self.models.items()
            if needle in spec.lower() or needle in description.lower()
        ]
        if typed.strip() and not options:  # not listed: a hub id or a path the backend may still open
            options.append(Option(Content.assemble("  use ", (typed.strip(), "bold")), id=typed.strip()))
        option_list = self.query_one(OptionList)
        option_list.set_options(options)
        if options:
            option_list.highlighted = 0

    def choose(self, option: Option) -> None:
        self.dismiss(option.id)


class ForkPicker(FilteredList):
    """Pick the message to fork the conversation at: the latest first; typing filters by text."""

    def __init__(self, messages: list[tuple[int, str, str]]) -> None:
        super().__init__()
        self.messages = messages  # (message id, role, text), oldest first

    def compose(self):
        with Vertical(classes="dialog wide"):
            yield Label("Fork this conversation at a message")
            yield Input(placeholder="words of the message", id="fork-filter")
            yield OptionList(id="fork-messages")
            yield Static("Enter forks: a new tab with the conversation up to that reply (a message of yours goes "
                         "back into its prompt) · Esc cancels", classes="hint")

    def on_mount(self) -> None:
        self._refilter("")

    def on_input_changed(self, event: Input.Changed) -> None:
        self._refilter(event.value)

    def _refilter(self, typed: str) -> None:
        option_list = self.query_one(OptionList)
        words = typed.lower().split()
        option_list.set_options(
            Option(Content.assemble((f"{role}  ", "bold"), " ".join(text.split())[:200]), id=str(message_id))
            for message_id, role, text in reversed(self.messages)
            if all(word in text.lower() for word in words)
        )
        if option_list.option_count:
            option_list.highlighted = 0

    def choose(self, option: Option) -> None:
        if option.id is not None:
            self.dismiss(int(option.id))


class SearchScreen(FilteredList):
    """Full-text search over every conversation, open or closed; Enter opens the hit."""

    DEBOUNCE_S = 0.15

    def __init__(self) -> None:
        super().__init__()
        self._hits: list[SearchHit] = []
        self._pending: Timer | None = None

    def compose(self):
        with Vertical(classes="dialog wide"):
            yield Label("Search all conversations")
            yield Input(placeholder="words to find", id="search-input")
            yield OptionList(id="search-results")
            yield Static("Enter opens · Esc closes", classes="hint")

    def on_input_changed(self, event: Input.Changed) -> None:
        if self._pending is not None:
            self._pending.stop()
        self._pending = self.set_timer(self.DEBOUNCE_S, lambda: self.run_search(event.value))

    def run_search(self, query: str) -> None:
        option_list = self.query_one(OptionList)
        try:
            self._hits = self.app.store.search(query) if query.strip() else []
        except Exception as error:  # a query the full-text engine rejects: say so, keep the dialog
            self._hits = []
            option_list.set_options([Option(f"Cannot search for that: {error}", disabled=True)])
            return
        option_list.set_options(
            Option(
                Content.assemble((hit.title, "bold"), (f"  {hit.role}\n", "dim"), " ".join(hit.snippet.split())),
                id=str(index),
            )
            for index, hit in enumerate(self._hits)
        )
        if self._hits:
            option_list.highlighted = 0

    def choose(self, option: Option) -> None:
        if option.id is not None:
            self.dismiss(self._hits[int(option.id)])


class RenameScreen(Dialog):
    def __init__(self, title: str) -> None:
        super().__init__()
        self.current = title

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label("Rename this conversation")
            yield Input(self.current, id="rename-input")
            yield Static("Enter saves · Esc cancels", classes="hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)


class SamplingScreen(Dialog):
    """This tab's sampling settings. Enter in any field applies them all, if SamplingParams accepts them
    (the fields check only that they hold a number); otherwise the dialog stays open and says why.
    Temperature set to 0 is exact greedy: a penalty left as it was shown (the defaults') is turned off."""

    def __init__(self, sampling: SamplingParams) -> None:
        super().__init__()
        self.sampling = sampling

    def compose(self):
        s = self.sampling
        seed = "" if s.seed is None else str(s.seed)
        # The ranges are SamplingParams' to judge, in one place for every front end; an Input of type
        # number/integer only rejects what is not a (finite) number.
        fields = [
            ("temperature", "temperature (0 = greedy)", str(s.temperature), "number"),
            ("top_p", "top-p (1 = off)", str(s.top_p), "number"),
            ("top_k", "top-k (0 = off)", str(s.top_k), "integer"),
            ("max_tokens", "max tokens", str(s.max_tokens), "integer"),
            ("seed", "seed (empty = random)", seed, "integer"),
            ("frequency_penalty", "frequency pen. (0 = off)", str(s.frequency_penalty), "number"),
            ("presence_penalty", "presence pen. (0 = off)", str(s.presence_penalty), "number"),
        ]
        with Vertical(classes="dialog"):
            yield Label("Sampling for this tab")
            with Grid(classes="form"):
                for name, label, value, kind in fields:
                    yield Label(label)
                    yield Input(value, id=name, type=kind, valid_empty=name == "seed")
            yield Static(id="sampling-error", classes="error", markup=False)
            yield Static("Enter applies · Esc cancels", classes="hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        inputs = list(self.query(Input))
        for field in inputs:
            field.validate(field.value)  # None for the empty seed (valid_empty): read is_valid instead
        invalid = [field.id for field in inputs if not field.is_valid]
        values = {field.id: field.value.strip() for field in inputs}
        if invalid:
            self._refuse(f"{', '.join(invalid)}: not a number.")
            return
        temperature = float(values["temperature"])
        penalties = {}
        for name in ("frequency_penalty", "presence_penalty"):
            value = float(values[name])
            untouched = value == getattr(self.sampling, name)
            penalties[name] = 0.0 if temperature == 0 != self.sampling.temperature and untouched else value
        try:
            sampling = replace(
                self.sampling,
                temperature=temperature,
                top_p=float(values["top_p"]),
                top_k=int(values["top_k"]),
                max_tokens=int(values["max_tokens"]),
                seed=int(values["seed"]) if values["seed"] else None,
                **penalties,
            )
        except TuichatError as error:
            self._refuse(str(error))
            return
        self.dismiss(sampling)

    def _refuse(self, why: str) -> None:
        error = self.query_one("#sampling-error", Static)
        error.update(why)
        error.display = True


class HelpScreen(Dialog):
    """Every key binding, with the id that config.toml's [keymap] rebinds it by."""

    BINDINGS = [
        Binding("f1", "dismiss_none", "Close", tooltip="Close this list of keys", show=False, id="help.close")
    ]

    def __init__(self, rows: list[tuple[str, str, str]]) -> None:
        super().__init__()
        self.rows = rows  # (keys, what it does, binding id)

    def compose(self):
        with Vertical(classes="dialog wide"):
            yield Label("Keys")
            table = DataTable(cursor_type="row", zebra_stripes=True)
            table.add_columns("keys", "does", "keymap id")
            table.add_rows(self.rows)
            yield table
            yield Static(
                "Ctrl+J is a newline in every terminal; Shift+Enter only with the kitty keyboard protocol. "
                "Ctrl+P opens the command palette. Esc closes.",
                classes="hint",
            )
