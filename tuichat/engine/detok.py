"""Incremental detokenization. Decoding one token at a time breaks multi-byte characters and drops the
spaces that tokenizers attach to word starts, so each step decodes a short window and emits only text that
is complete (no trailing U+FFFD), the scheme vLLM uses."""

from __future__ import annotations


def _backend_decode(tokenizer):
    """The `tokenizers` library's own decode, where transformers' decode would only wrap it: a fast tokenizer
    whose class overrides neither decode nor _decode. Two decodes a token per sequence through transformers'
    wrapper cost ~3 us each where the backend's cost ~1 (more in a decode step, on caches the weights just
    evicted). None: go through transformers."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    kind = type(tokenizer)
    if (not isinstance(tokenizer, TokenizersBackend) or kind.decode is not PreTrainedTokenizerBase.decode
            or kind._decode is not TokenizersBackend._decode):
        return None
    backend = tokenizer._tokenizer
    return lambda ids: backend.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        # A few prompt tokens of left context make the first word's leading space come out right.
        self.ids = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._decode = _backend_decode(tokenizer) or self._decode_through_transformers

    def _decode_through_transformers(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full_text[len(prefix_text) :]
        return ""


class StopMatcher:
    """Holds back text that could be the start of a stop string, so a stop string is never shown."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.text = ""
        self.emitted = 0

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text that is safe to show now, whether a stop string was hit)."""
        self.text += delta
        if not self.stops:
            out, self.emitted = self.text[self.emitted :], len(self.text)
            return out, False
        search_from = max(0, self.emitted - max(map(len, self.stops)))
        hits = [i for i in (self.text.find(s, search_from) for s in self.stops) if i >= 0]
        if hits:
            end = min(hits)
            out, self.emitted = self.text[self.emitted : end], end
            self.text = self.text[:end]
            return out, True
        held = max((n for s in self.stops for n in range(len(s) - 1, 0, -1) if self.text.endswith(s[:n])), default=0)
        safe = max(self.emitted, len(self.text) - held)
        out, self.emitted = self.text[self.emitted : safe], safe
        return out, False

    def flush(self) -> str:
        """At the end of a reply, release what was held back."""
        out, self.emitted = self.text[self.emitted :], len(self.text)
        return out
