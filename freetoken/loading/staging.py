"""Moving shards to the GPU: straight from the page cache where the driver can pin it, else
through pinned host buffers.

Where a chunk of a shard lies contiguously in the file, in the parameter's dtype (every shard
of a row split, every replicated tensor), the copy engine reads it from the file's pages
directly: the loader maps each checkpoint file read-only and registers it with CUDA window by
window (`freetoken.loading.mapped`), so the bytes cross host memory once, by DMA, instead of being
copied into a staging buffer first (measured on an H200: the registered mapping moves 55 GB/s,
staging through pinned buffers tops out near 17 GB/s however many threads fill them).

Otherwise (a column split, a cast, or a system that refuses the registration), a copy from
pageable memory (the memory-mapped checkpoint) to the GPU is synchronous and goes
through the driver's own bounce buffer. Instead each loader thread owns a `PinnedStager`: a
small ring of pinned buffers and a CUDA stream. The host fills the next chunk of a shard into
a free buffer while the copy engine moves the previous chunk to the GPU, so reading and the
transfer overlap and the host never holds more than the ring. A chunk whose rows lie
contiguously in the file, in the parameter's dtype, is read from the file straight into the
buffer (one `preadv` instead of faulting in the mapped pages one by one); the rest (a column
split, a cast) is copied from the mapped view, casting on the way."""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from freetoken.formats.shard import Piece, ShardPieces
from freetoken.loading.mapped import MappedCheckpoint

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


class FileReader:
    """Reads byte ranges of checkpoint files into tensors (one open descriptor per file)."""

    def __init__(self, reader):
        self._reader = reader
        self._fds: dict[str, int] = {}

    def origin(self, name: str, full: torch.Tensor) -> tuple[int, int]:
        """(descriptor, file offset minus address) of tensor `name`, held as `full`: a view
        `v` of `full` starts at file offset `v.data_ptr()` + the second number."""
        file = self._reader.file_of(name)
        if file not in self._fds:
            self._fds[file] = os.open(Path(self._reader.folder) / file, os.O_RDONLY)
        return self._fds[file], self._reader.offset(name) - full.data_ptr()

    @staticmethod
    def read_into(out: torch.Tensor, fd: int, offset: int) -> None:
        """Fill contiguous `out` with the file's bytes from `offset`."""
        view = memoryview((ctypes.c_char * (out.numel() * out.element_size())).from_address(
            out.data_ptr())).cast("B")
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"checkpoint file ended {len(view) - done} bytes early")
            done += got

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def fill(stage: torch.Tensor, pieces: ShardPieces, first: int, stop: int, files: FileReader,
         origin: tuple[int, int]) -> None:
    """Write rows [first, stop) of the shard into `stage`: read from the file where the rows
    lie contiguously in the stage's dtype, else copied (and cast) from the mapped view."""
    fd, shift = origin
    for region, source in _row_pieces(pieces, first, stop, stage):
        if source is None:
            region.zero_()
        elif (source.dtype == region.dtype and source.is_contiguous()
              and region.is_contiguous()):
            files.read_into(region, fd, source.data_ptr() + shift)
        else:
            region.copy_(source)


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


def _copy_segments(dest: torch.Tensor, segments: list[torch.Tensor]) -> None:
    """Fill contiguous GPU `dest` with `segments` (uint8 runs of registered file pages, in
    order): one asynchronous transfer each, on the current stream."""
    out, at = dest.view(-1).view(torch.uint8), 0
    for part in segments:
        size = part.numel()
        out[at : at + size].copy_(part, non_blocking=True)
        at += size


class PinnedStager:
    """One loader thread's pinned ring and copy stream on `device`, reading the files of
    `reader` (a CheckpointReader); chunks that can be are copied straight from `mapped`'s
    registered pages instead."""

    def __init__(self, device: torch.device, reader, buffer_bytes: int | None = None,
                 ring: int = RING, mapped: MappedCheckpoint | None = None):
        buffer_bytes = buffer_bytes or STAGE_BYTES
        self._files = FileReader(reader)
        self._mapped = mapped
        self.device = torch.device(device)
        # Per thread: a loader thread starts on GPU 0, and would create a context there.
        torch.cuda.set_device(self.device)
        self.stream = torch.cuda.Stream(self.device)
        # Parameters were allocated (and maybe initialised) on the current stream.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        # Pinned on first use: chunks copied from registered pages never need the ring.
        self.buffer_bytes = buffer_bytes
        self._buffers: list[torch.Tensor | None] = [None] * ring
        self._events: list[torch.cuda.Event | None] = [None] * ring
        self._next = 0

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """Make the copy stream this thread's current one while the block runs (set once per
        span: entering `torch.cuda.stream` per copy costs more than a small copy)."""
        previous = torch.cuda.current_stream(self.device)
        torch.cuda.set_stream(self.stream)
        try:
            yield
        finally:
            torch.cuda.set_stream(previous)

    @contextlib.contextmanager
    def assemble(self, dest: torch.Tensor) -> Iterator[torch.Tensor]:
        """A pinned uint8 buffer of dest's bytes for the block to fill; sent to `dest` (bytes
        of a GPU parameter) in one transfer when the block ends."""
        slot, buffer = self._take(dest.numel())
        yield buffer
        self._send(slot, buffer, dest)

    def write(self, name: str, full: torch.Tensor, pieces: ShardPieces,
              dest: torch.Tensor) -> None:
        """Copy the shard of checkpoint tensor `name` (held as `full`) described by `pieces`
        into `dest` (on the GPU), chunk by chunk, on the copy stream (`current`)."""
        if self._direct_whole(name, full, pieces, dest):
            return
        origin = self._files.origin(name, full)
        pieces = _as_rows(pieces)
        # view, never reshape: a copy of `dest` would take the transfer instead of it.
        dest = dest.view(pieces.shape)
        row_bytes = dest[0].numel() * dest.element_size() if len(dest) else 0
        rows = max(1, self.buffer_bytes // max(1, row_bytes))
        for first in range(0, pieces.shape[0], rows):
            stop = min(first + rows, pieces.shape[0])
            if self._direct(name, full, pieces, dest, first, stop):
                continue
            slot, buffer = self._take((stop - first) * row_bytes)
            stage = buffer.view(dest.dtype).view(stop - first, *pieces.shape[1:])
            fill(stage, pieces, first, stop, self._files, origin)
            self._send(slot, stage, dest[first:stop])

    def _direct_whole(self, name: str, full: torch.Tensor, pieces: ShardPieces,
                      dest: torch.Tensor) -> bool:
        """The common case in one step: a shard that is one view of the checkpoint tensor,
        contiguous in the file in dest's dtype (a replicated tensor, a row split), copied
        from the registered pages one window at a time; False (nothing copied) otherwise."""
        if self._mapped is None or not self._mapped.usable or len(pieces.pieces) != 1:
            return False
        piece = pieces.pieces[0]
        source = piece.source
        if (piece.dim is not None or source is None or source.dtype != dest.dtype
                or not (source.is_contiguous() and dest.is_contiguous())):
            return False
        segments = self._mapped.segments(name, full, source)
        if segments is None:
            return False
        _copy_segments(dest, segments)
        return True

    def _direct(self, name: str, full: torch.Tensor, pieces: ShardPieces, dest: torch.Tensor,
                first: int, stop: int) -> bool:
        """Copy rows [first, stop) from the registered file pages if every piece of them lies
        contiguously in the file in dest's dtype; False (nothing copied) otherwise."""
        if self._mapped is None or not self._mapped.usable:
            return False
        parts = list(_row_pieces(pieces, first, stop, dest[first:stop]))
        if not all(source is None or (source.dtype == region.dtype and source.is_contiguous()
                                      and region.is_contiguous()) for region, source in parts):
            return False
        segments = [None if source is None else self._mapped.segments(name, full, source)
                    for _, source in parts]
        if any(seg is None for seg, (_, source) in zip(segments, parts) if source is not None):
            return False
        for (region, source), seg in zip(parts, segments):
            if source is None:
                region.zero_()
            else:
                _copy_segments(region, seg)
        return True

    def _take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """(slot, first `nbytes` of its buffer) of the next ring buffer, once its previous
        transfer has finished."""
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        if self._events[slot] is not None:
            self._events[slot].synchronize()
        if self._buffers[slot] is None or nbytes > len(self._buffers[slot]):
            self._buffers[slot] = torch.empty(max(nbytes, self.buffer_bytes),
                                              dtype=torch.uint8, pin_memory=True)
        return slot, self._buffers[slot][:nbytes]

    def _send(self, slot: int, stage: torch.Tensor, dest: torch.Tensor) -> None:
        dest.copy_(stage, non_blocking=True)
        event = torch.cuda.Event()
        event.record(self.stream)
        self._events[slot] = event

    def finish(self) -> None:
        """Wait for every transfer: the parameters are complete when this returns."""
        self.stream.synchronize()
        self._files.close()
