"""BenchBackend: LocalBackend with what the bench, scripts/loops.py and the tests look into or switch, and no front
end does: the ids a conversation's next turn builds on, how many of a turn's prompt ids the turn before gave, and
speculation's mode switched on a loaded model."""

from __future__ import annotations

from collections.abc import Sequence

from tuichat.backends.local import LocalBackend
from tuichat.backends.protocol import Message, TuichatError


class BenchBackend(LocalBackend):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._reused: dict[str, int] = {}  # conversation -> its last turn's history ids taken over unchanged

    async def _prompt(self, name: str, loaded, conversation_id: str, messages: Sequence[Message], params,
                      ahead: bool = False):
        turn = await super()._prompt(name, loaded, conversation_id, messages, params, ahead)
        self._reused[conversation_id] = turn.reused
        return turn

    def cached_token_ids(self, conversation_id: str) -> list[int]:
        """The ids the next turn of this conversation builds on."""
        conversation = self._conversations.get(conversation_id)
        return conversation.prompt_ids + conversation.completion_ids if conversation else []

    def reused_tokens(self, conversation_id: str) -> int:
        """How many ids of the last turn's prompt were the turn before's own."""
        return self._reused.get(conversation_id, 0)

    def set_speculate(self, model: str, mode: str) -> None:
        """Speculative decoding's mode for a loaded model, from its engine's next step; its other options stay."""
        loaded = self._loaded.get(self._names.get(model, model))
        if loaded is None:
            raise TuichatError(f"{model} is not loaded.")
        loaded.engine.set_speculate(mode)
