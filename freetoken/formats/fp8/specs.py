"""Shard specs for block-FP8 scales, in the style of `freetoken.formats.specs`: pure
functions of (full scale, rank, size) returning a fresh tensor, with a bitwise inverse and
the `pieces` the loader copies straight into place.

The fp8 weight splits like any weight (`Split`, `Heads`). Its scale follows: a column split
(output rows, dim 0) takes the scale ROWS covering the rank's row slice, a row-parallel split
(input columns, dim 1) the scale COLUMNS covering its column slice. Where a rank's slice is
not a multiple of the block B (Qwen3.5-35B experts at TP 8: 512 / 8 = 64 < 128), two ranks
share a block: each takes the block(s) covering its slice, its first element `offset(rank)`
elements into the first one, and dequantizes exactly with that offset
(`freetoken.formats.fp8.block.dequantize`). Every rank holds the same number of scale
entries, the most any rank needs; a rank needing fewer gets zero entries past its last
block, which no weight element reads. Only a weight whose size the TP size does not divide
is refused, naming the tensor, dimension and TP size."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.formats.shard import Piece, ShardError, ShardPieces


@dataclass(frozen=True)
class BlockScaleSplit:
    """The scale of a weight whose dim `dim` (0: rows, column-parallel; 1: input columns,
    row-parallel) has `full_size` elements in blocks of `block`, split like the weight: in
    `size` equal chunks, or with `heads` set and fewer heads than ranks, rank r holding head
    `r * heads // size` (KV-head replication, as `Heads`)."""

    dim: int
    block: int
    full_size: int
    heads: int | None = None
    start: int = 0
    """Where the split part begins in the weight's dim: a segment of a packed tensor (GDN
    `in_proj_qkv`'s k segment starts at key_dim, maybe inside a block)."""
    total: int | None = None
    """The weight's whole dim (None: `full_size`, the part is the whole dim)."""

    def _chunk(self, rank: int, size: int, name: str) -> tuple[int, int]:
        """(first element, elements) of the weight's dim on `rank`."""
        parts = self.heads if self.heads is not None and self.heads < size else size
        if self.full_size % parts or (parts < size and size % parts):
            raise ShardError(f"{name}: weight dim {self.dim} of {self.full_size} cannot be "
                             f"split across tp_size={size}")
        step = self.full_size // parts
        return self.start + (rank * parts // size) * step, step

    def offset(self, rank: int, size: int, name: str = "") -> int:
        """How far into its first scale block `rank`'s first weight element lies."""
        return self._chunk(rank, size, name)[0] % self.block

    def blocks(self, size: int, name: str = "") -> int:
        """Scale entries along `dim` every rank holds: the most any rank's slice spans."""
        return max(self._span(r, size, name)[1] for r in range(size))

    def _span(self, rank: int, size: int, name: str) -> tuple[int, int]:
        start, step = self._chunk(rank, size, name)
        first = start // self.block
        return first, (start + step - 1) // self.block - first + 1

    def grid(self) -> int:
        """Scale entries along `dim` of the whole (unsplit) scale."""
        return -(-(self.total or self.full_size) // self.block)

    def _check(self, full: torch.Tensor, name: str) -> None:
        if full.dim() != 2 or full.shape[self.dim] != self.grid():
            raise ShardError(f"{name}: block scale of shape {tuple(full.shape)}; a weight dim "
                             f"{self.dim} of {self.total or self.full_size} in blocks of "
                             f"{self.block} needs {self.grid()} along dim {self.dim}")

    def pieces(self, full, rank, size, name=""):
        self._check(full, name)
        first, count = self._span(rank, size, name)
        have, shape = self.blocks(size, name), list(full.shape)
        shape[self.dim] = have
        pieces = [Piece(full.narrow(self.dim, first, count), self.dim, 0, count)]
        if count < have:
            pieces.append(Piece(None, self.dim, count, have - count))
        return ShardPieces(tuple(shape), tuple(pieces))

    def shard(self, full, rank, size, name=""):
        self._check(full, name)
        first, count = self._span(rank, size, name)
        shape = list(full.shape)
        shape[self.dim] = self.blocks(size, name)
        out = full.new_zeros(shape)
        out.narrow(self.dim, 0, count).copy_(full.narrow(self.dim, first, count))
        return out

    def unshard(self, parts, name=""):
        shape = list(parts[0].shape)
        shape[self.dim] = self.grid()
        full = parts[0].new_zeros(shape)
        self.unshard_into(full, parts, name)
        return full

    def unshard_into(self, full: torch.Tensor, parts, name: str = "") -> None:
        """Write every rank's blocks back into `full` (ranks sharing a block hold the same
        values, so the order of the writes does not matter)."""
        for rank, part in enumerate(parts):
            first, count = self._span(rank, len(parts), name)
            full.narrow(self.dim, first, count).copy_(part.narrow(self.dim, 0, count))


@dataclass(frozen=True)
class BlockScaleSegments:
    """The block scale of a packed weight `[seg_0 | seg_1 | ...]` split per segment
    (`Segments`): each segment's `BlockScaleSplit` (with its `start` in the packed dim) takes
    the blocks covering its rank's rows, so segment boundaries inside a block (GDN
    `in_proj_qkv` with key_dim not a multiple of B) share that block; rank r holds
    `[seg_0's blocks | seg_1's blocks | ...]`."""

    segments: tuple[BlockScaleSplit, ...]

    def pieces(self, full, rank, size, name=""):
        shape, pieces, at = list(full.shape), [], 0
        dim = self.segments[0].dim
        for seg in self.segments:
            part = seg.pieces(full, rank, size, name)
            pieces += [Piece(p.source, dim, at + p.start, p.length) for p in part.pieces]
            at += part.shape[dim]
        shape[dim] = at
        return ShardPieces(tuple(shape), tuple(pieces))

    def shard(self, full, rank, size, name=""):
        dim = self.segments[0].dim
        return torch.cat([s.shard(full, rank, size, name) for s in self.segments], dim=dim)

    def unshard(self, parts, name=""):
        first = self.segments[0]
        size, dim = len(parts), first.dim
        shape = list(parts[0].shape)
        shape[dim] = first.grid()
        full = parts[0].new_zeros(shape)
        counts = [s.blocks(size, name) for s in self.segments]
        for seg, per_rank in zip(self.segments, zip(*(p.split(counts, dim) for p in parts))):
            seg.unshard_into(full, list(per_rank), name)
        return full
