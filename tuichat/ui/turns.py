"""A conversation's side of its turns that is not on screen: its model and sampling, what the model is sent,
the reply streamed from the backend, and every write to the store. The tab shows what happens; a
TurnRunner keeps the record."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Protocol

from tuichat.backends.protocol import Message, PromptTooLong, SamplingParams, TuichatError, Usage

if TYPE_CHECKING:
    from tuichat.ui.messages import Past
    from tuichat.ui.services import TabServices
    from tuichat.ui.widgets import TurnTiming

FLUSH_S = 1.0  # how often a streaming reply is written to the store, so a crash loses at most this much


def sampling_key(conversation_id: str) -> str:
    return f"sampling.{conversation_id}"


def stored_sampling(raw: str | None) -> SamplingParams | None:
    """The sampling a tab was given in its dialog, from the store; None when it was given none (it follows
    the defaults), or when what is stored is unreadable or invalid (top_p 0 was once accepted)."""
    if not raw:
        return None
    try:
        data = json.loads(raw)
        data["stop"] = tuple(data.get("stop", ()))
        return SamplingParams(**data)
    except (ValueError, TypeError, TuichatError):
        return None


class ReplyView(Protocol):
    """A reply in flight as its turn sees it: what is on screen (the tab provides it)."""

    @property
    def text(self) -> str:
        """The reply so far."""

    @property
    def timing(self) -> TurnTiming | None:
        """The meter's timings of this turn, for the store."""

    def model_ready(self, model: str) -> None:
        """The model is loaded; `model` is its canonical name."""

    async def chunk(self, text: str, completion_tokens: int) -> None:
        """A chunk of text arrived; `completion_tokens` is the engine's running count (0 if it does not say)."""

    def ended(self, usage: Usage | None) -> None:
        """The stream is over (`usage` is None if it did not finish); called before the final store write."""


@dataclass
class Outcome:
    status: str  # "done", "stopped" or "error"
    usage: Usage | None  # None if the stream did not finish
    error: str | None
    refused: bool = False  # the prompt can never run as it is (PromptTooLong): nothing reached the model


class TurnRunner:
    """One conversation's dealings with the store and the backend. Its model and sampling are read when a
    turn needs them, so a change made while a model loads applies to the reply waiting for it."""

    def __init__(self, conversation_id: str, model: str, sampling: SamplingParams | None,
                 services: TabServices) -> None:
        """`sampling`: what the tab was given in its dialog; None follows the defaults for its model."""
        self.conversation_id = conversation_id
        self.model = model
        self.chosen = sampling
        self._services = services
        self.stop_requested = False
        # The reply stored as streaming and not ended yet, and what shows it once its stream has begun.
        self._open: int | None = None
        self._view: ReplyView | None = None

    @property
    def sampling(self) -> SamplingParams:
        return self.chosen or self._services.default_sampling(self.model)

    @sampling.setter
    def sampling(self, sampling: SamplingParams) -> None:
        self.chosen = sampling

    # --- the conversation's record ------------------------------------------------------------------

    def rename(self, title: str) -> None:
        self._services.store.rename(self.conversation_id, title)

    def set_model(self, model: str) -> None:
        self.model = model
        self._services.store.set_model(self.conversation_id, model)

    def set_sampling(self, sampling: SamplingParams) -> None:
        self.chosen = sampling
        data = asdict(sampling)
        data["stop"] = list(sampling.stop)
        self._services.store.set_setting(sampling_key(self.conversation_id), json.dumps(data))

    def add_user_message(self, text: str) -> int:
        return self._services.store.add_message(self.conversation_id, "user", text)

    def delete(self, message_ids: Iterable[int]) -> None:
        for message_id in message_ids:
            self._services.store.delete_message(message_id)

    def context(self, messages: Sequence[Past]) -> list[Message]:
        """What the model sees: the system prompt and every turn, except failed ones (a failed reply and
        the user message it answered, which usually comes back edited or resent)."""
        system = self._services.system_prompt
        context = [Message("system", system)] if system else []
        for index, message in enumerate(messages):
            following = messages[index + 1] if index + 1 < len(messages) else None
            if message.role == "user":
                if not (following is not None and following.role == "assistant" and following.status == "error"):
                    context.append(Message("user", message.text))
            elif message.status != "error" and message.text:
                context.append(Message("assistant", message.text))
        return context

    # --- a turn -------------------------------------------------------------------------------------

    def start_reply(self) -> int:
        """A new turn: its reply, empty and streaming, in the store, open until `stream` or `abandon` ends it.
        Returns the reply's message id."""
        self.stop_requested = False
        self._open = self._services.store.add_message(
            self.conversation_id, "assistant", "", status="streaming", meta={"model": self.model}
        )
        self._view = None
        self._services.open_turns.add(self)
        return self._open

    @property
    def replying(self) -> bool:
        """A reply is stored as streaming and not ended yet."""
        return self._open is not None

    def abandon(self) -> None:
        """Store the open reply, if any, as stopped with its text so far: nothing else will end it (the app is
        ending, whatever became of the turn's task and widgets). Its turn's later writes go nowhere."""
        if self._open is not None:
            self._end(self._open, "stopped", None, None)

    def _end(self, reply_id: int, status: str, usage: Usage | None, error: str | None) -> None:
        if reply_id != self._open:  # abandoned
            return
        text = self._view.text if self._view is not None else ""
        meta = self._meta(self._view, usage, error)
        self._services.store.update_message(reply_id, content=text, status=status, meta=meta)
        self._open = self._view = None
        self._services.open_turns.discard(self)

    async def stream(self, reply_id: int, context: list[Message], view: ReplyView) -> Outcome:
        """Stream the reply to `context` into `view` and the store. After `stop()` the text so far stays,
        as stopped. Cancelled otherwise (the app quitting, the tab closing): saved as stopped, and the
        cancellation goes on."""
        services = self._services
        store, clock = services.store, services.clock
        usage: Usage | None = None
        error: str | None = None
        refused = False
        if reply_id == self._open:
            self._view = view
        try:
            model = await services.ensure_model(self.model)
            view.model_ready(model)
            backend = services.backend()  # there once ensure_model has returned
            stream = backend.stream(self.conversation_id, context, self.sampling, model=model)
            last_flush = clock()
            try:
                async for event in stream:
                    if event.text:
                        await view.chunk(event.text, event.usage.completion_tokens)
                        if clock() - last_flush >= FLUSH_S and reply_id == self._open:
                            store.update_message(reply_id, content=view.text)
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
            if not self.stop_requested:  # the app is quitting or the tab closing: save, skip the UI
                self._end(reply_id, "stopped", None, None)
                raise
        except TuichatError as failure:
            error = str(failure)
            refused = isinstance(failure, PromptTooLong)
        except Exception as failure:  # a backend bug must not take the app (and the typed text) down
            error = f"{type(failure).__name__}: {failure}"
        if error:
            status = "error"
        elif self.stop_requested or (usage is not None and usage.finish_reason == "cancelled"):
            status = "stopped"
        else:
            status = "done"
        view.ended(usage)
        self._end(reply_id, status, usage, error)
        return Outcome(status, usage, error, refused)

    def stop(self) -> None:
        """Ask the backend to stop this conversation's reply; `stream` then ends it as stopped."""
        self.stop_requested = True
        backend = self._services.backend()
        if backend is not None:
            backend.cancel(self.conversation_id)

    def _meta(self, view: ReplyView | None, usage: Usage | None, error: str | None) -> dict:
        meta: dict = {"model": self.model}
        turn = view.timing if view is not None else None
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
            for name in ("context_tokens", "dropped_messages", "dropped_tokens", "cache_miss"):
                if getattr(usage, name):
                    meta[name] = getattr(usage, name)
        if error:
            meta["error"] = error
        return meta
