"""The generic shard specs (`ShardSpec`, see `freetoken.formats.shard`): replicate, split on a
dim, split per segment of a packed tensor, by head (with KV-head replication), padded
vocab-parallel rows, per-head interleaved parts. Format-specific specs (NVFP4) live in
`freetoken.formats.nvfp4.specs`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from freetoken.formats.shard import Piece, ShardError, ShardPieces, fresh, whole


def _chunk(full: torch.Tensor, dim: int, rank: int, size: int, name: str) -> torch.Tensor:
    return fresh(_chunk_view(full, dim, rank, size, name))


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
        return fresh(full)

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
    names: tuple[str, ...] = field(default=(), compare=False)
    """What each segment holds (`q`, `k`, `v`), for people reading a plan; may be empty."""

    def piece_labels(self, size: int) -> tuple[str, ...]:
        """The segment each of `pieces`' pieces comes from."""
        return self.names or tuple(f"segment {i}" for i in range(len(self.sizes)))

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
            return fresh(full.narrow(self.dim, start, step))
        # Only the last rank(s) pad: build just this rank's rows, never a padded full copy.
        shape = list(full.shape)
        shape[self.dim] = step
        out = full.new_zeros(shape)
        out.narrow(self.dim, 0, have).copy_(full.narrow(self.dim, start, have))
        return out

    def unshard(self, parts, name=""):
        return torch.cat(parts, dim=self.dim).narrow(self.dim, 0, self.full_size)


@dataclass(frozen=True)
class InterleavedHeads:
    """Rows interleaved per head along dim 0, `[a_0 | b_0 | a_1 | b_1 | ...]` with `parts`
    blocks of head_dim rows per head (Qwen3.5's attention `q_proj`: `[q_h | gate_h]`).

    Rank r takes whole heads `[r * local, (r + 1) * local)`, each with all its parts, and
    returns them grouped by part, `[a of its heads | b of its heads]`, the layout the engine's
    fused projection splits with one `split`. Equivalently: de-interleave to
    `[a_all | b_all]`, then split each part on its own (a per-part `Segments` split)."""

    num_heads: int
    parts: int = 2
    names: tuple[str, ...] = field(default=(), compare=False)
    """What each part holds (`q`, `gate`), for people reading a plan; may be empty."""

    def piece_labels(self, size: int) -> tuple[str, ...]:
        """The part each of `pieces`' pieces comes from (one piece per part and local head)."""
        names = self.names or tuple(f"part {p}" for p in range(self.parts))
        return tuple(names[p] for p in range(self.parts) for _ in range(self.num_heads // size))

    def _head_rows(self, full: torch.Tensor, name: str) -> int:
        rows = full.shape[0]
        if rows % (self.num_heads * self.parts):
            raise ShardError(f"{name}: dim 0 is {rows}, not {self.num_heads} heads x "
                             f"{self.parts} parts of equal size")
        return rows // (self.num_heads * self.parts)

    def _local_heads(self, size, name):
        if self.num_heads % size:
            raise ShardError(f"{name}: {self.num_heads} heads cannot be split across "
                             f"tp_size={size}")
        return self.num_heads // size

    def pieces(self, full, rank, size, name=""):
        """One piece per (part, local head): `head_dim` contiguous checkpoint rows each."""
        local, head_dim = self._local_heads(size, name), self._head_rows(full, name)
        pieces = []
        for part in range(self.parts):
            for h in range(local):
                row = ((rank * local + h) * self.parts + part) * head_dim
                at = (part * local + h) * head_dim
                pieces.append(Piece(full.narrow(0, row, head_dim), 0, at, head_dim))
        return ShardPieces((self.parts * local * head_dim, *full.shape[1:]), tuple(pieces))

    def shard(self, full, rank, size, name=""):
        local = self._local_heads(size, name)
        head_dim = self._head_rows(full, name)
        rest = tuple(full.shape[1:])
        mine = full.reshape(self.num_heads, self.parts, head_dim, *rest)[
            rank * local : (rank + 1) * local]
        # clone() of the transposed view always copies: the shard owns its storage.
        grouped = mine.transpose(0, 1).clone(memory_format=torch.contiguous_format)
        return grouped.reshape(self.parts * local * head_dim, *rest)

    def unshard(self, parts, name=""):
        local = self.num_heads // len(parts)
        rest = tuple(parts[0].shape[1:])
        head_dim = parts[0].shape[0] // (self.parts * local)
        heads = [p.reshape(self.parts, local, head_dim, *rest).transpose(0, 1) for p in parts]
        return torch.cat(heads).reshape(self.num_heads * self.parts * head_dim, *rest)
