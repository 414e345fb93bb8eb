"""Turns a scheduled step into tensors, runs the model once over all its tokens, returns the logits of
the positions that are sampled (never the whole [T, vocab] matrix: on a CPU that alone costs milliseconds).

It works on plain StepChunk plans, not on Sequences, so tensor-parallel workers can run the very same code
from a plan that rank 0 broadcasts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tuichat.engine.attention import PrefillSpan, StepContext, set_context
from tuichat.engine.kv_cache import KVCache


class RunnerBroken(RuntimeError):
    """The runner cannot run any more steps (a tensor-parallel rank failed): the message says what to do."""


def is_decode(start: int, length: int) -> bool:
    """A single token with context before it: it joins the batched decode path."""
    return length == 1 and start > 0


@dataclass(frozen=True)
class StepChunk:
    token_ids: list[int]  # the tokens computed in this step
    start: int  # position of the first of them
    block_table: list[int]
    samples: bool  # the chunk ends at the sequence's last token: its logits pick the next one
    # Rows whose logits are returned, the chunk's last ones: 1, or a verified draft's length + 1.
    logit_rows: int = 1

    @property
    def is_decode(self) -> bool:
        return is_decode(self.start, len(self.token_ids))


def flatten(chunks: list[StepChunk]) -> tuple[list[int], list[int], list[int]]:
    """The step as one row: every chunk's token ids and positions in order, and the rows whose logits are
    sampled (each sampling chunk's last `logit_rows`)."""
    token_ids: list[int] = []
    positions: list[int] = []
    sample_rows: list[int] = []
    for chunk in chunks:
        token_ids += chunk.token_ids
        positions += range(chunk.start, chunk.start + len(chunk.token_ids))
        if chunk.samples:
            sample_rows += range(len(token_ids) - chunk.logit_rows, len(token_ids))
    return token_ids, positions, sample_rows


class ModelRunner:
    def __init__(self, model, kv: KVCache, block_size: int, device: torch.device, native=None) -> None:
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = device
        self.native = native  # a native.NativeDecoder (prepare.prepare's): it runs the steps it accepts

    def _slots(self, block_table: list[int], start: int, stop: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, stop)]

    def _tensor(self, values, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def build_context(self, chunks: list[StepChunk]) -> tuple[torch.Tensor, torch.Tensor, StepContext, list[int]]:
        """`chunks` must list the decodes first (the engine orders them so)."""
        input_ids, positions, sample_rows = flatten(chunks)
        slots = [s for c in chunks for s in self._slots(c.block_table, c.start, c.start + len(c.token_ids))]
        ctx = StepContext(self.kv.k, self.kv.v, self._tensor(slots))
        decodes = [c for c in chunks if c.is_decode]
        if decodes:
            lengths = [c.start + 1 for c in decodes]
            longest = max(lengths)
            padded = [self._slots(c.block_table, 0, n) + [0] * (longest - n) for c, n in zip(decodes, lengths)]
            ctx.num_decode = len(decodes)
            ctx.decode_slots = self._tensor(padded)
            ctx.decode_lengths = lengths
        offset = len(decodes)
        for chunk in chunks[len(decodes) :]:
            length = len(chunk.token_ids)
            span = PrefillSpan(offset, length, chunk.start, self.device)
            if chunk.start > 0:
                span.block_slots = self._tensor(self._slots(chunk.block_table, 0, chunk.start + length))
            ctx.prefills.append(span)
            offset += length
        return self._tensor([input_ids]), self._tensor([positions]), ctx, sample_rows

    @torch.inference_mode()
    def execute(self, chunks: list[StepChunk]) -> torch.Tensor | None:
        """One forward. Returns float32 logits [N, vocab] for the sampling chunks, in order, or None."""
        if self.native is not None and self.native.accepts(sum(len(c.token_ids) for c in chunks)):
            return self.native.execute(chunks)
        input_ids, positions, ctx, sample_rows = self.build_context(chunks)
        set_context(ctx)
        try:
            out = self.model(
                input_ids=input_ids,
                position_ids=positions,
                use_cache=False,
                logits_to_keep=self._tensor(sample_rows) if sample_rows else 1,
            )
        finally:
            set_context(None)
        return out.logits[0].float() if sample_rows else None
