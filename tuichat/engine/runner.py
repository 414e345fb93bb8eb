"""Turns a scheduled step into tensors, runs the model once over all its tokens, returns the logits of
the positions that are sampled (never the whole [T, vocab] matrix: on a CPU that alone costs milliseconds)."""

from __future__ import annotations

import torch

from tuichat.engine.attention import PrefillSpan, StepContext, set_context
from tuichat.engine.kv_cache import KVCache
from tuichat.engine.scheduler import ScheduledChunk


class ModelRunner:
    def __init__(self, model, kv: KVCache, block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = device

    def _slots(self, block_table: list[int], start: int, stop: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, stop)]

    def _tensor(self, values, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def build_context(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, StepContext, list[int]]:
        """Decodes must come first in `chunks` (the scheduler orders them so)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        decodes = [c for c in chunks if c.length == 1 and c.start > 0]
        prefills = [c for c in chunks if not (c.length == 1 and c.start > 0)]
        for chunk in decodes + prefills:
            seq, stop = chunk.seq, chunk.start + chunk.length
            input_ids += seq.token_ids[chunk.start : stop]
            positions += range(chunk.start, stop)
            slots += self._slots(seq.block_table, chunk.start, stop)
            if chunk.samples:
                sample_rows.append(len(input_ids) - 1)
        ctx = StepContext(self.kv.k, self.kv.v, self._tensor(slots))
        if decodes:
            lengths = [c.start + 1 for c in decodes]
            longest = max(lengths)
            padded = [self._slots(c.seq.block_table, 0, n) + [0] * (longest - n) for c, n in zip(decodes, lengths)]
            ctx.num_decode = len(decodes)
            ctx.decode_slots = self._tensor(padded)
            ctx.decode_mask = (
                torch.arange(longest, device=self.device)[None, :] < self._tensor(lengths)[:, None]
            )[:, None, None, :]
        offset = len(decodes)
        for chunk in prefills:
            span = PrefillSpan(offset, chunk.length, chunk.start)
            if chunk.start > 0:
                total = chunk.start + chunk.length
                span.context_slots = self._tensor(self._slots(chunk.seq.block_table, 0, total))
                query_pos = torch.arange(chunk.start, total, device=self.device)
                span.mask = torch.arange(total, device=self.device)[None, :] <= query_pos[:, None]
            ctx.prefills.append(span)
            offset += chunk.length
        return self._tensor([input_ids]), self._tensor([positions]), ctx, sample_rows

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], torch.Tensor | None]:
        """Runs one step. Returns the chunks that sample, in row order, and their float32 logits."""
        input_ids, positions, ctx, sample_rows = self.build_context(chunks)
        ordered = [c for c in chunks if c.length == 1 and c.start > 0] + [
            c for c in chunks if not (c.length == 1 and c.start > 0)
        ]
        sampling = [c for c in ordered if c.samples]
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
        if not sampling:
            return [], None
        return sampling, out.logits[0].float()
