"""Continuous batching: admit waiting prompts as a prefill batch when they fit, otherwise
decode every running sequence one token; preempt (and later recompute) the newest sequence
when the cache runs out. Every running sequence holds cache blocks and one linear-state
slot."""

from __future__ import annotations

from collections import deque

from freetoken.engine.kv_cache import BlockManager, StatePool
from freetoken.engine.sequence import Sequence


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 states: StatePool | None = None):
        self.blocks = blocks
        self.states = states if states is not None else StatePool(max_num_seqs)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        needed = -(-(len(seq.prompt) + seq.params.max_tokens) // self.blocks.block_size)
        if needed > self.blocks.num_blocks:
            raise ValueError(f"request {seq.seq_id}: {len(seq.prompt)} prompt + "
                             f"{seq.params.max_tokens} new tokens need {needed} cache blocks, "
                             f"the cache has {self.blocks.num_blocks}")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The sequences of the next step and whether it is a prefill."""
        batch, tokens = [], 0
        while self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            seq = self.waiting[0]
            if batch and tokens + len(seq) > self.max_num_batched_tokens:
                break
            if not self.blocks.can_grow(seq, len(seq)):
                break
            self.blocks.grow(seq, len(seq))
            self.states.acquire(seq)
            batch.append(self.waiting.popleft())
            tokens += len(seq)
        if batch:
            self.running.extend(batch)
            return batch, True
        for seq in list(self.running):
            while seq in self.running and not self.blocks.can_grow(seq, len(seq)):
                self._preempt(self.running[-1])
            if seq in self.running:
                self.blocks.grow(seq, len(seq))
        return list(self.running), False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        self.states.release(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        self.states.release(seq)
