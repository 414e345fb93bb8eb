"""Continuous batching under a token budget.

Each step: running sequences that decode (one token each) go first, so a new prompt never stalls the tabs
that are already talking; then sequences part-way through a chunked prefill; then waiting sequences are
admitted while blocks and budget last. When the pool runs out, the newest running sequence is preempted:
its blocks are freed (their hashes stay, so its recompute mostly hits the prefix cache) and it waits at
the front of the queue. The "static" and "off" modes exist to measure what continuous batching buys.

A background sequence (a prompt prefilled while its user types, LocalBackend.prefill) only runs in steps that
have nothing else to do: it is admitted, and its chunks scheduled, only while no other sequence runs or waits,
and it is the first preempted. A streaming tab's step never carries its tokens, so it never waits on them.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from tuichat.engine.kv_cache import BlockManager, CacheFull
from tuichat.engine.request import Sequence, Status
from tuichat.engine.runner import StepChunk, is_decode

MAX_OVERTAKES = 8  # how many later requests may be admitted ahead of one that does not fit yet


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed in this step
    length: int  # tokens computed in this step, the draft's included
    draft: list[int] = field(default_factory=list)  # proposed tokens after the sequence's last, verified here

    @property
    def samples(self) -> bool:
        """Does this chunk reach the sequence's last token (so its logits give the next token)?"""
        return self.start + self.length - len(self.draft) == len(self.seq)

    def plan(self) -> StepChunk:
        tokens = self.seq.token_ids[self.start : self.start + self.length - len(self.draft)] + self.draft
        return StepChunk(tokens, self.start, list(self.seq.block_table), self.samples, 1 + len(self.draft))


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batched_tokens: int, max_num_seqs: int, batching: str) -> None:
        if batching not in ("continuous", "static", "off"):
            raise ValueError(f"unknown batching mode {batching!r}")
        if max_batched_tokens < 1:
            raise ValueError("the per-step token budget must be at least 1")
        self.blocks = blocks
        self.max_batched_tokens = max_batched_tokens
        # No more sequences than the budget can step at once: each decode takes one token of it, and a decode
        # left out of a step for want of budget would wait behind the older ones for ever.
        self.max_num_seqs = 1 if batching == "off" else min(max_num_seqs, max_batched_tokens)
        self.batching = batching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0
        # Counted when a request is first admitted, so the hit rate is live while replies still stream.
        self.admitted_prompt_tokens = 0
        self.admitted_cached_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or cancelled sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.free_sequence(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free_sequence(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_batched_tokens
        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        busy = any(not s.background for s in itertools.chain(self.running, self.waiting))  # background waits

        def grow(seq: Sequence, length: int) -> bool:
            """Reserve blocks for seq's next `length` tokens, preempting newer sequences if needed."""
            while True:
                try:
                    self.blocks.ensure_slots(seq, seq.num_computed + length)
                    return True
                except CacheFull:
                    victim = next((s for s in reversed(self.running) if s.id not in scheduled and s.background),
                                  None) or next((s for s in reversed(self.running) if s.id not in scheduled), None)
                    self._preempt(victim)
                    if victim is seq:
                        return False

        # 1. Decodes first, oldest first. 2. Chunked prefills already under way.
        for decoding in (True, False):
            for seq in list(self.running):
                if seq.status is not Status.RUNNING or seq.id in scheduled or (seq.background and busy):
                    continue  # preempted during this pass, done in the first pass, or waiting for a quiet step
                if (seq.num_uncomputed == 1) != decoding or budget == 0:
                    continue
                # A decode's draft (the engine's proposal) rides in its chunk, as far as the budget and the free
                # blocks allow: a guess never preempts another sequence.
                draft = seq.draft[: budget - 1] if decoding else []
                if draft:
                    try:
                        self.blocks.ensure_slots(seq, seq.num_computed + 1 + len(draft))
                    except CacheFull:
                        draft = []
                length = min(seq.num_uncomputed, budget) + len(draft)
                if grow(seq, length):
                    chunks.append(ScheduledChunk(seq, seq.num_computed, length, draft))
                    scheduled.add(seq.id)
                    budget -= length

        # 3. Admit waiting sequences while budget, seats and blocks last. One that does not fit now lets smaller
        # ones behind it go first, but only MAX_OVERTAKES times: then nothing passes it until it fits, so a
        # long prompt waits for the pool to drain rather than for ever.
        may_admit = self.batching != "static" or not self.running
        index = 0
        while may_admit and index < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[index]
            if seq.background and busy:
                index += 1
                continue
            try:
                self.blocks.allocate(seq)
            except CacheFull:
                idle = next((s for s in reversed(self.running) if s.background and s.id not in scheduled), None)
                if idle is not None and not seq.background:  # its blocks (their hashes stay) before any wait
                    self._preempt(idle)
                    index += 1  # the preempted one went to the front
                    continue
                if seq.overtaken >= MAX_OVERTAKES:
                    break
                index += 1
                continue
            del self.waiting[index]
            for passed in itertools.islice(self.waiting, index):
                passed.overtaken += 1
            seq.status = Status.RUNNING
            if seq.num_cached_tokens is None:  # the first admission is what the user's cache hit is
                seq.num_cached_tokens = seq.num_computed
                seq.first_scheduled = time.monotonic()
                self.admitted_prompt_tokens += seq.num_prompt_tokens
                self.admitted_cached_tokens += seq.num_cached_tokens
            self.running.append(seq)
            length = min(seq.num_uncomputed, budget)
            chunks.append(ScheduledChunk(seq, seq.num_computed, length))
            scheduled.add(seq.id)
            budget -= length
        # The runner batches single-token steps together and wants them first (a decode with a draft is a short
        # chunk like a prefill's).
        chunks.sort(key=lambda c: not is_decode(c.start, c.length))
        return chunks
