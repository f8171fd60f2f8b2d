"""The shard-spec protocol and what the loader does with it. A spec is a pure function from
(full checkpoint tensor, rank, size) to a fresh, contiguous rank-local tensor, with its inverse.
Never a view: a `narrow()` of the full tensor keeps the whole parent storage alive on every
rank.

Each spec also says where its shard comes from without building it (`pieces`): views of the
full tensor, each bound for one region of the shard. The loader copies those views straight
into the parameter (`shard_into`), once, with any dtype cast fused into that copy; `shard()`
stays an independent implementation, so the two can be checked against each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

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


@runtime_checkable
class ShardSpec(Protocol):
    """How one checkpoint tensor is split across `size` ranks. `shard` and `pieces` are
    rank-dependent: rank `rank` gets its own part. `name` is the checkpoint tensor's name, for
    error messages only."""

    def shard(self, full: torch.Tensor, rank: int, size: int, name: str = "") -> torch.Tensor:
        """Rank `rank`'s part of `full`: a fresh, contiguous tensor owning its storage."""
        ...

    def pieces(self, full: torch.Tensor, rank: int, size: int, name: str = "") -> ShardPieces:
        """The same part as views of `full`, for the loader to copy straight into place."""
        ...

    def unshard(self, parts: list[torch.Tensor], name: str = "") -> torch.Tensor:
        """The full tensor from every rank's part (rank order): the inverse of `shard`."""
        ...


def write_pieces(pieces: ShardPieces, out: torch.Tensor) -> None:
    """Copy every piece into its region of `out` (casting to out's dtype): the only copy."""
    for piece in pieces.pieces:
        region = piece.region(out)
        if piece.source is None:
            region.zero_()
        else:
            region.copy_(piece.source)


def shard_into(spec: ShardSpec, full: torch.Tensor, rank: int, size: int, out: torch.Tensor,
               name: str = "") -> None:
    """Write rank `rank`'s shard of `full` straight into `out` (any dtype and device), bitwise
    what `spec.shard` returns cast to out's dtype, without building the shard first.

    Rank-dependent: each rank writes its own slice."""
    pieces = spec.pieces(full, rank, size, name)
    if tuple(out.shape) != pieces.shape:
        raise ShardError(f"{name}: shard shape {pieces.shape} does not fit a destination of "
                         f"shape {tuple(out.shape)}")
    write_pieces(pieces, out)


def fresh(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy that owns its storage (`clone()` alone keeps the input's strides; a
    `narrow()` view would pin the full tensor)."""
    return t.clone(memory_format=torch.contiguous_format)
