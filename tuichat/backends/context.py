"""A conversation against the model's context: which of its messages a prompt holds when it has outgrown the
context, and why a turn found less of its history in the KV cache than the conversation had run.

Pure Python (no torch): LocalBackend gives it a function that counts a message list's prompt tokens.

Trimming drops whole turns from the oldest, after the system messages, and never the message being answered.
When it must drop, it drops until a quarter of the context is free again, not just enough for this turn: the
prompt's start then stays the same for the next turns, whose prefix-cache hits cover the whole kept history,
instead of every turn dropping one more turn and prefilling all the rest again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tuichat.backends.protocol import Message, PromptTooLong

NOT_RUN = ("its earlier turns were not run by this engine since it started, nor kept on disk: the app or server "
           "restarted, the model was unloaded, or the conversation was not kept")
FREE_AFTER_TRIM = 4  # a trim leaves 1/FREE_AFTER_TRIM of the context free for the turns that follow
SUMMARY_TITLE = "Summary of the earlier conversation"


@dataclass(frozen=True)
class Fit:
    """How much of a conversation a prompt holds."""

    dropped: int  # messages left out after the system messages, oldest first
    tokens: int  # the prompt's tokens (a summary's counted as `extra`)


def split(messages: Sequence[Message]) -> tuple[list[Message], list[Message]]:
    """(the leading system messages, the rest)."""
    first = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
    return list(messages[:first]), list(messages[first:])


def with_summary(system: list[Message], summary: str | None) -> list[Message]:
    """The system messages, the summary of dropped turns added to the first (or as one of its own)."""
    if not summary:
        return system
    note = f"{SUMMARY_TITLE}: {summary}"
    if system:
        return [Message("system", f"{system[0].content}\n\n{note}"), *system[1:]]
    return [Message("system", note)]


def fit(messages: Sequence[Message], count: Callable[[list[Message]], int], limit: int, reserve: int,
        start: int = 0, extra: int = 0, name: str = "the model") -> Fit:
    """How many of the oldest messages (after the system messages) a prompt of at most `limit` tokens that
    leaves `reserve` for the reply must leave out. `start`: those the conversation's previous turn left out
    (kept out, so that its cached prompt stays a prefix); `extra`: tokens to allow for what stands in their
    place (a summary). Raises PromptTooLong when even the system messages and the last message do not fit."""
    system, rest = split(messages)
    turns = [i for i in range(len(rest)) if rest[i].role == "user"]  # a kept history starts at a user message
    last = turns[-1] if turns else max(len(rest) - 1, 0)
    start = max([0, *(i for i in turns if i <= min(start, last))])

    def size(dropped: int) -> int:
        return count(system + rest[dropped:]) + (extra if dropped else 0)

    tokens = size(start)
    if tokens + reserve <= limit:
        return Fit(start, tokens)
    candidates = [i for i in turns if start < i <= last] or [start]
    sizes: dict[int, int] = {}

    def first(fits: Callable[[int], bool]) -> int | None:
        """The fewest dropped that fit, by bisection (the more dropped, the fewer tokens)."""
        low, high = 0, len(candidates) - 1
        while low < high:
            middle = (low + high) // 2
            if fits(sizes.setdefault(middle, size(candidates[middle]))):
                high = middle
            else:
                low = middle + 1
        return candidates[low] if fits(sizes.setdefault(low, size(candidates[low]))) else None

    target = limit - limit // FREE_AFTER_TRIM
    for fits in (lambda n: n + reserve <= target, lambda n: n + reserve <= limit, lambda n: n + 1 <= limit):
        if (dropped := first(fits)) is not None:
            return Fit(dropped, size(dropped))
    alone = count(system + rest[last:])
    raise PromptTooLong(
        f"This message is {alone:,} tokens long with the system prompt and the chat template; {name} holds "
        f"{limit:,} tokens a conversation. Shorten it, or split it over several messages."
    )


def whole(messages: Sequence[Message], count: Callable[[list[Message]], int], *args, **kwargs) -> Fit:
    """The policy "refuse": every message, however long (the engine refuses what does not fit)."""
    return Fit(0, 0)


@dataclass(frozen=True)
class Previous:
    """What a conversation's previous turn ran: its model, the messages its prompt held and the messages of
    the whole conversation it left out."""

    model: str
    messages: tuple[Message, ...]
    dropped: int


def miss_reason(previous: Previous | None, model: str, messages: Sequence[Message], sent: Sequence[Message],
                dropped: int, spliced: bool, prefix_cache: bool) -> str | None:
    """Why this turn's prompt cannot start with the whole of what the conversation's previous turn ran (None
    where it can, or where there was no earlier turn). The KV blocks' eviction is the engine's to tell after
    the lookup (evicted_reason)."""
    earlier = len(split(messages)[1]) > 1  # turns before the message being answered
    if previous is None:
        if not earlier:
            return None
        return NOT_RUN
    if not prefix_cache:
        return "the prefix cache is off"
    if previous.model != model:
        return f"the model was switched (from {previous.model})"
    before_system, _ = split(previous.messages)
    if dropped > previous.dropped:
        return (f"the history was trimmed to fit the context: {dropped - previous.dropped} more of the oldest "
                "messages left out")
    if before_system != split(sent)[0]:
        return "the system prompt changed"
    if tuple(sent[:len(previous.messages)]) != previous.messages:
        return "an earlier message was edited, or a reply regenerated"
    if not spliced:
        return ("the last reply's text does not give back the tokens the model produced (a stop string cut it, or "
                "the chat template rewrites it)")
    return None


def evicted_reason(cached: int, history: int, block_size: int) -> str | None:
    """Why `cached` prompt tokens came from the cache where the `history` tokens the previous turn ran were
    expected. The cache holds full blocks of computed tokens only, and the reply's last token was never computed
    (its K/V comes with this turn) unless a draft brought it: where the history ends on a block's boundary, that
    block may be missing without anything having been evicted."""
    if cached >= (history - 1) // block_size * block_size:
        return None
    return (f"{history - cached:,} tokens of the history had been evicted from the KV cache to make room for other "
            "requests")
