"""What the app gives each conversation tab when it makes one: the tab, its turns and its widgets use these
and never reach into the app object."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tuichat.backends.protocol import Backend, SamplingParams
    from tuichat.store import Store
    from tuichat.ui.pacing import PaintPacer
    from tuichat.ui.turns import TurnRunner


@dataclass(frozen=True)
class TabServices:
    store: Store
    backend: Callable[[], Backend | None]  # None until the engine has started, and for good if it failed
    ensure_model: Callable[[str], Awaitable[str]]  # loads a model spec once (shared by tabs); its canonical name
    model_name: Callable[[str], str]  # a spec's canonical name once loaded, else the spec
    model_state: Callable[[str], str]  # what the model bar says about a spec ("loading 40% · …"), "" if ready
    default_sampling: Callable[[str], SamplingParams]  # a model spec's sampling, for a tab given none of its own
    system_prompt: str | None
    pacer: PaintPacer  # one for the app: every tab paints on the same UI thread
    clock: Callable[[], float]  # what latencies are measured on (tests give a virtual one)
    prefill_while_typing: bool = True
    # The turns whose reply is stored as streaming: the app, as it ends, stops those left in the store.
    open_turns: set[TurnRunner] = field(default_factory=set)
