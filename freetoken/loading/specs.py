"""Shard specs: pure functions from (full checkpoint tensor, rank, size) to a fresh, contiguous
rank-local tensor, each with its inverse. Never return a view: a `narrow()` of the full tensor
keeps the whole parent storage alive on every rank.

Each spec also says where its shard comes from without building it (`pieces`): views of the
full tensor, each bound for one region of the shard. The loader copies those views straight
into the parameter (`shard_into`), once, with any dtype cast fused into the copy; `shard()`
stays an independent implementation, so the two can be checked against each other."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class ShardError(ValueError):
    """A tensor cannot be split as its rule asks."""


@dataclass(frozen=True, eq=False)
class Piece:
    """`source` (a view of the full checkpoint tensor; None for zeros) fills the shard's region
    `narrow(dim, start, length)`, or the whole shard when `dim` is None. Source and region
    have the same shape."""

    source: torch.Tensor | None
    dim: int | None = None
    start: int = 0
    length: int = 0

    def region(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.dim is None else out.narrow(self.dim, self.start, self.length)


@dataclass(frozen=True, eq=False)
class ShardPieces:
    """A rank's shard as the views it is made of: its shape, and pieces that cover it once."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...] = field(default_factory=tuple)


def whole(view: torch.Tensor) -> ShardPieces:
    """A shard that is one view of the full tensor."""
    return ShardPieces(tuple(view.shape), (Piece(view),))


def write_pieces(pieces: ShardPieces, out: torch.Tensor) -> None:
    """Copy every piece into its region of `out` (casting to out's dtype): the only copy."""
    for piece in pieces.pieces:
        region = piece.region(out)
        if piece.source is None:
            region.zero_()
        else:
            region.copy_(piece.source)


def shard_into(spec, full: torch.Tensor, rank: int, size: int, out: torch.Tensor,
               name: str = "") -> None:
    """Write rank `rank`'s shard of `full` straight into `out` (any dtype and device), bitwise
    what `spec.shard` returns cast to out's dtype, without building the shard first.

    Rank-dependent: each rank writes its own slice."""
    pieces = spec.pieces(full, rank, size, name)
    if tuple(out.shape) != pieces.shape:
        raise ShardError(f"{name}: shard shape {pieces.shape} does not fit a destination of "
                         f"shape {tuple(out.shape)}")
    write_pieces(pieces, out)


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy that owns its storage (`clone()` alone keeps the input's strides)."""
    return t.clone(memory_format=torch.contiguous_format)


def _chunk(full: torch.Tensor, dim: int, rank: int, size: int, name: str) -> torch.Tensor:
    return _fresh(_chunk_view(full, dim, rank, size, name))


def _chunk_view(full: torch.Tensor, dim: int, rank: int, size: int, name: str) -> torch.Tensor:
    """Chunk `rank` of `size` along `dim` as a view (the fast path's source)."""
    length = full.shape[dim]
    if length % size:
        raise ShardError(f"{name}: dim {dim} of size {length} cannot be split across "
                         f"tp_size={size}")
    step = length // size
    return full.narrow(dim, rank * step, step)


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole tensor."""

    def shard(self, full, rank, size, name=""):
        return _fresh(full)

    def pieces(self, full, rank, size, name=""):
        return whole(full)

    def unshard(self, parts, name=""):
        return parts[0]


@dataclass(frozen=True)
class Split:
    """Equal contiguous chunks along `dim`, rank r takes chunk r."""

    dim: int = 0

    def shard(self, full, rank, size, name=""):
        return _chunk(full, self.dim, rank, size, name)

    def pieces(self, full, rank, size, name=""):
        return whole(_chunk_view(full, self.dim, rank, size, name))

    def unshard(self, parts, name=""):
        return torch.cat(parts, dim=self.dim)


@dataclass(frozen=True)
class Segments:
    """A packed tensor `[seg_0 | seg_1 | ...]` along `dim`: each segment is split on its own
    and rank r holds `[seg_0_r | seg_1_r | ...]`. `unit` is the granularity a split must
    respect inside each segment (a head, an NVFP4 group)."""

    sizes: tuple[int, ...]
    dim: int = 0
    unit: int = 1

    def _check(self, full, size, name):
        if full.shape[self.dim] != sum(self.sizes):
            raise ShardError(f"{name}: dim {self.dim} is {full.shape[self.dim]}, segments "
                             f"{list(self.sizes)} sum to {sum(self.sizes)}")
        for s in self.sizes:
            if s % (size * self.unit):
                raise ShardError(f"{name}: segment of {s} cannot be split across "
                                 f"tp_size={size} in units of {self.unit}")

    def shard(self, full, rank, size, name=""):
        self._check(full, size, name)
        segs = torch.split(full, list(self.sizes), dim=self.dim)
        return torch.cat([_chunk(s, self.dim, rank, size, name) for s in segs], dim=self.dim)

    def pieces(self, full, rank, size, name=""):
        self._check(full, size, name)
        dim = self.dim % full.dim()
        shape, pieces, start, at = list(full.shape), [], 0, 0
        for seg in self.sizes:
            view = _chunk_view(full.narrow(dim, start, seg), dim, rank, size, name)
            pieces.append(Piece(view, dim, at, seg // size))
            start, at = start + seg, at + seg // size
        shape[dim] = at
        return ShardPieces(tuple(shape), tuple(pieces))

    def unshard(self, parts, name=""):
        size = len(parts)
        local = [s // size for s in self.sizes]
        per_rank = [torch.split(p, local, dim=self.dim) for p in parts]
        segs = [torch.cat([pr[i] for pr in per_rank], dim=self.dim) for i in range(len(local))]
        return torch.cat(segs, dim=self.dim)


@dataclass(frozen=True)
class Heads:
    """Split by head along `dim`; with fewer heads than ranks, rank r holds head
    `r * num_heads // size` (KV-head replication)."""

    num_heads: int
    dim: int = 0

    def _head_owner(self, rank, size):
        return rank * self.num_heads // size

    def _check(self, full, size, name):
        if full.shape[self.dim] % self.num_heads:
            raise ShardError(f"{name}: dim {self.dim} of size {full.shape[self.dim]} is not "
                             f"{self.num_heads} whole heads")
        if self.num_heads >= size and self.num_heads % size:
            raise ShardError(f"{name}: {self.num_heads} heads cannot be split across "
                             f"tp_size={size}")
        if self.num_heads < size and size % self.num_heads:
            raise ShardError(f"{name}: {self.num_heads} heads cannot be replicated across "
                             f"tp_size={size}")

    def shard(self, full, rank, size, name=""):
        self._check(full, size, name)
        if self.num_heads >= size:
            return _chunk(full, self.dim, rank, size, name)
        return _chunk(full, self.dim, self._head_owner(rank, size), self.num_heads, name)

    def pieces(self, full, rank, size, name=""):
        self._check(full, size, name)
        if self.num_heads >= size:
            return whole(_chunk_view(full, self.dim, rank, size, name))
        owner = self._head_owner(rank, size)
        return whole(_chunk_view(full, self.dim, owner, self.num_heads, name))

    def unshard(self, parts, name=""):
        size = len(parts)
        if self.num_heads >= size:
            return torch.cat(parts, dim=self.dim)
        firsts = [next(r for r in range(size) if self._head_owner(r, size) == h)
                  for h in range(self.num_heads)]
        return torch.cat([parts[r] for r in firsts], dim=self.dim)

    def replicas(self, size: int) -> list[list[int]]:
        """Groups of ranks that must hold identical shards."""
        if self.num_heads >= size:
            return [[r] for r in range(size)]
        return [[r for r in range(size) if self._head_owner(r, size) == h]
                for h in range(self.num_heads)]


@dataclass(frozen=True)
class PaddedSplit:
    """Pad `dim` with zeros to a multiple of tp_size, then split (vocab-parallel rows)."""

    full_size: int
    dim: int = 0

    def _rows(self, full, rank, size, name):
        """(rows per rank, first row of this rank, rows it has before the padding)."""
        if full.shape[self.dim] != self.full_size:
            raise ShardError(f"{name}: dim {self.dim} is {full.shape[self.dim]}, "
                             f"expected {self.full_size}")
        step = -(-self.full_size // size)
        start = min(rank * step, self.full_size)
        return step, start, min(step, self.full_size - start)

    def pieces(self, full, rank, size, name=""):
        step, start, have = self._rows(full, rank, size, name)
        dim = self.dim % full.dim()
        shape = list(full.shape)
        shape[dim] = step
        pieces = [Piece(full.narrow(dim, start, have), dim, 0, have)] if have else []
        if have < step:
            pieces.append(Piece(None, dim, have, step - have))
        return ShardPieces(tuple(shape), tuple(pieces))

    def shard(self, full, rank, size, name=""):
        step, start, have = self._rows(full, rank, size, name)
        if have == step:
            return _fresh(full.narrow(self.dim, start, step))
        # Only the last rank(s) pad: build just this rank's rows, never a padded full copy.
        shape = list(full.shape)
        shape[self.dim] = step
        out = full.new_zeros(shape)
        out.narrow(self.dim, 0, have).copy_(full.narrow(self.dim, start, have))
        return out

    def unshard(self, parts, name=""):
        return torch.cat(parts, dim=self.dim).narrow(self.dim, 0, self.full_size)
