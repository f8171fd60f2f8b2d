"""CUDA graphs of the decode step: the forward and the LM head of a batch of one new token
per sequence, captured once per batch-size bucket (1, 2, 4, 8, ...) on first use and
replayed with the step's inputs copied into static buffers.

A batch smaller than its bucket is padded with rows that write their key and value into a
scratch cache block and their linear state into a scratch slot, both reserved by the engine
and never given to a sequence, so padding cannot touch a real sequence's cache or state."""

from __future__ import annotations

import time

import torch

from freetoken.context import DeviceBatch, ForwardContext, set_forward_context
from freetoken.kernels import step_io


def buckets(max_batch: int) -> list[int]:
    """Powers of two up to the first one >= max_batch."""
    sizes = [1]
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] * 2)
    return sizes


class DecodeGraphs:
    """One graph per bucket over shared static buffers; `run` returns float32 logits
    [batch, vocab] and their greedy tokens [batch] (views into the bucket's outputs, valid
    until the next replay).

    A step costs the host one copy and one replay: its rows are written into a pinned host
    buffer and copied to a device staging buffer in one asynchronous transfer, and the graph
    itself unpacks them into the layers' static inputs (one launch) and takes the greedy
    argmax of the logits with their float32 cast (two launches, the argmax spread over the
    vocab: `freetoken.kernels.step_io`).

    Every graph writes its greedy tokens into one shared buffer, `tokens`, and a step's id
    may be given as -1 - j: row j of that buffer, the previous step's token, which the host
    need not have seen yet (`EngineCore`'s overlapped steps launch step n + 1 before step
    n's tokens reach the host)."""

    def __init__(self, model: torch.nn.Module, max_batch: int, max_blocks: int,
                 block_size: int, scratch_block: int, scratch_state: int, device):
        self.model = model
        self.buckets = buckets(max_batch)
        self.block_size = block_size
        self.scratch_block, self.scratch_state = scratch_block, scratch_state
        n, self.width = self.buckets[-1], max_blocks
        device = torch.device(device)
        as_long = dict(dtype=torch.long, device=device)
        # One int64 row per sequence (its fields, then its block table): written on the host,
        # copied whole rows at a time, unpacked on the device inside the graph.
        self.host = torch.zeros(n, 5 + max_blocks, dtype=torch.long,
                                pin_memory=device.type == "cuda")
        self.host_rows = self.host.numpy()
        self.uploaded = torch.cuda.Event() if device.type == "cuda" else None
        self.staging = torch.zeros(n, 5 + max_blocks, **as_long)
        self.ids, self.positions, self.slot_mapping = (torch.zeros(n, **as_long)
                                                       for _ in range(3))
        self.seq_slots = torch.zeros(n, **as_long)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.query_starts = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.tokens = torch.zeros(n, **as_long)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.greedy: dict[int, torch.Tensor] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    def fits(self, batch: int) -> bool:
        return batch <= self.buckets[-1]

    def drop(self) -> None:
        """Forget every captured graph and its memory pool; the next step of each bucket
        captures again (with whatever tiles the kernels choose then)."""
        self.graphs.clear()
        self.logits.clear()
        self.greedy.clear()
        self.pool = None   # a pool whose graphs are all gone cannot take a new capture

    def run(self, ids: list[int], positions: list[int], slots: list[int],
            context_lens: list[int], block_tables: list[list[int]], seq_slots: list[int]
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and greedy tokens of one decode step of len(ids) sequences (one token
        each; an id -1 - j is `tokens[j]`, the previous step's j-th greedy token)."""
        n = len(ids)
        bucket = next(b for b in self.buckets if b >= n)
        if bucket not in self.graphs:
            # The warm-up and the capture write their own greedy tokens: keep the fed-back
            # ones this step's ids may point at.
            fed = self.tokens.clone()
            self._fill(bucket, [], [], [], [], [], [])
            self._capture(bucket)
            self.tokens.copy_(fed)
        self._fill(bucket, ids, positions, slots, context_lens, block_tables, seq_slots)
        self.graphs[bucket].replay()
        return self.logits[bucket][:n], self.greedy[bucket][:n]

    def _fill(self, bucket, ids, positions, slots, context_lens, block_tables, seq_slots):
        """Real rows first, padding rows (scratch block and state slot) after, written into
        the pinned host rows and sent to the device staging rows in one asynchronous copy.
        Only the table columns this batch uses are written: the kernel reads no entry past a
        sequence's context."""
        width = max([len(t) for t in block_tables] + [1])
        rows = [[i, p, s, c, st, *t, *[0] * (width - len(t))] for i, p, s, c, st, t in
                zip(ids, positions, slots, context_lens, seq_slots, block_tables)]
        pad = [0, 0, self.scratch_block * self.block_size, 1, self.scratch_state,
               self.scratch_block, *[0] * (width - 1)]
        rows += [pad] * (bucket - len(ids))
        if self.uploaded is not None:
            self.uploaded.synchronize()   # the previous step's copy has read the host rows
        self.host_rows[:bucket, : 5 + width] = rows
        self.staging[:bucket].copy_(self.host[:bucket], non_blocking=True)
        if self.uploaded is not None:
            self.uploaded.record()

    def _unpack(self, bucket: int) -> None:
        """The staging rows into the layers' static inputs (captured into each graph): one
        launch on CUDA (`step_io.unpack`), its torch steps elsewhere."""
        staging = self.staging[:bucket]
        inputs = (self.ids[:bucket], self.positions[:bucket], self.slot_mapping[:bucket],
                  self.context_lens[:bucket], self.seq_slots[:bucket],
                  self.block_tables[:bucket])
        if staging.is_cuda:
            step_io.unpack(staging, self.tokens, *inputs)
            return
        for dst, src in zip(inputs, step_io.reference_unpack(staging, self.tokens)):
            dst.copy_(src)

    def _context(self, bucket: int) -> ForwardContext:
        # Host lists only tell layers that this is a decode step of continuing sequences;
        # everything that varies per step is read from the static device buffers.
        device = DeviceBatch(self.block_tables[:bucket], self.context_lens[:bucket],
                             self.query_starts[: bucket + 1], self.seq_slots[:bucket])
        return ForwardContext(False, [1] * bucket, [2] * bucket, self.slot_mapping[:bucket],
                              [[self.scratch_block]] * bucket, list(range(bucket)),
                              device=device)

    def _forward(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._unpack(bucket)
        hidden = self.model(self.ids[:bucket], self.positions[:bucket])
        logits = self.model.compute_logits(hidden)
        greedy = self.tokens[:bucket]
        if logits.is_cuda:
            return step_io.float_argmax(logits, greedy)
        logits, tokens = step_io.reference_float_argmax(logits)
        greedy.copy_(tokens)
        return logits, greedy

    def _capture(self, bucket: int) -> None:
        """Warm up (compiles the kernels) on padding rows, then capture."""
        set_forward_context(self._context(bucket))
        try:
            self._forward(bucket)
            torch.cuda.synchronize()
            free = torch.cuda.mem_get_info()[0]
            start = time.perf_counter()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[bucket], self.greedy[bucket] = self._forward(bucket)
            torch.cuda.synchronize()
        finally:
            set_forward_context(None)
        self.capture_seconds += time.perf_counter() - start
        self.capture_bytes += max(0, free - torch.cuda.mem_get_info()[0])
        self.pool = self.pool if self.pool is not None else graph.pool()
        self.graphs[bucket] = graph
