"""Moving shards to the GPU through pinned host buffers.

A copy from pageable memory (the memory-mapped checkpoint) to the GPU is synchronous and goes
through the driver's own bounce buffer. Instead each loader thread owns a `PinnedStager`: a
small ring of pinned buffers and a CUDA stream. The host copies the next chunk of a shard
from the mapped file into a free buffer (reading the page cache, casting to the parameter's
dtype on the way) while the copy engine moves the previous chunk to the GPU, so reading and
the transfer overlap and the host never holds more than the ring."""

from __future__ import annotations

import torch

from freetoken.loading.specs import Piece, ShardPieces

STAGE_BYTES = 16 << 20
"""Bytes per pinned buffer: large enough that a transfer runs at the bus's speed."""
RING = 2
"""Buffers per stager: one being filled while the other is in flight."""


def staging_bytes(threads: int) -> int:
    """Pinned host memory the loader's stagers hold at most, for `threads` loader threads."""
    return threads * RING * STAGE_BYTES


def release_pinned() -> None:
    """Hand cached pinned host memory back to the OS: torch keeps freed pinned blocks for
    reuse, and the staging rings would otherwise stay pinned on every rank after the load."""
    release = getattr(torch.accelerator, "empty_host_cache", None) or getattr(
        torch._C, "_host_emptyCache", None)
    if release is not None:
        release()


def _row_pieces(pieces: ShardPieces, first: int, stop: int, stage: torch.Tensor):
    """(region of `stage`, source view or None) for rows [first, stop) of the shard, `stage`
    holding exactly those rows."""
    for piece in pieces.pieces:
        source = piece.source
        if piece.dim is None:
            yield stage, None if source is None else source.narrow(0, first, stop - first)
        elif piece.dim == 0:
            lo, hi = max(first, piece.start), min(stop, piece.start + piece.length)
            if lo < hi:
                part = None if source is None else source.narrow(0, lo - piece.start, hi - lo)
                yield stage.narrow(0, lo - first, hi - lo), part
        else:
            part = None if source is None else source.narrow(0, first, stop - first)
            yield stage.narrow(piece.dim, piece.start, piece.length), part


def _as_rows(pieces: ShardPieces) -> ShardPieces:
    """A 0-dim shard as a 1-row one, so every shard is copied in row chunks."""
    if pieces.shape:
        return pieces
    return ShardPieces((1,), tuple(Piece(None if p.source is None else p.source.reshape(1))
                                   for p in pieces.pieces))


class PinnedStager:
    """One loader thread's pinned ring and copy stream on `device`."""

    def __init__(self, device: torch.device, buffer_bytes: int | None = None, ring: int = RING):
        buffer_bytes = buffer_bytes or STAGE_BYTES
        self.device = torch.device(device)
        # Per thread: a loader thread starts on GPU 0, and would create a context there.
        torch.cuda.set_device(self.device)
        self.stream = torch.cuda.Stream(self.device)
        # Parameters were allocated (and maybe initialised) on the current stream.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._buffers = [torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=True)
                         for _ in range(ring)]
        self._events: list[torch.cuda.Event | None] = [None] * ring
        self._next = 0

    def write(self, pieces: ShardPieces, dest: torch.Tensor) -> None:
        """Copy the shard described by `pieces` into `dest` (on the GPU), chunk by chunk."""
        pieces = _as_rows(pieces)
        # view, never reshape: a copy of `dest` would take the transfer instead of it.
        dest = dest.view(pieces.shape)
        row_bytes = dest[0].numel() * dest.element_size() if len(dest) else 0
        rows = max(1, len(self._buffers[0]) // max(1, row_bytes))
        for first in range(0, pieces.shape[0], rows):
            stop = min(first + rows, pieces.shape[0])
            slot, buffer = self._take((stop - first) * row_bytes)
            stage = buffer.view(dest.dtype).view(stop - first, *pieces.shape[1:])
            for region, source in _row_pieces(pieces, first, stop, stage):
                if source is None:
                    region.zero_()
                else:
                    region.copy_(source)
            self._send(slot, stage, dest[first:stop])

    def _take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """(slot, first `nbytes` of its buffer) of the next ring buffer, once its previous
        transfer has finished."""
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        if self._events[slot] is not None:
            self._events[slot].synchronize()
        if nbytes > len(self._buffers[slot]):
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return slot, self._buffers[slot][:nbytes]

    def _send(self, slot: int, stage: torch.Tensor, dest: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dest.copy_(stage, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._events[slot] = event

    def finish(self) -> None:
        """Wait for every transfer: the parameters are complete when this returns."""
        self.stream.synchronize()
