"""Shard specs: pure functions from (full checkpoint tensor, rank, size) to a fresh, contiguous
rank-local tensor, each with its inverse. Never return a view: a `narrow()` of the full tensor
keeps the whole parent storage alive on every rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class ShardError(ValueError):
    """A tensor cannot be split as its rule asks."""


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy that owns its storage (`clone()` alone keeps the input's strides)."""
    return t.clone(memory_format=torch.contiguous_format)


def _chunk(full: torch.Tensor, dim: int, rank: int, size: int, name: str) -> torch.Tensor:
    length = full.shape[dim]
    if length % size:
        raise ShardError(f"{name}: dim {dim} of size {length} cannot be split across "
                         f"tp_size={size}")
    step = length // size
    return _fresh(full.narrow(dim, rank * step, step))


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole tensor."""

    def shard(self, full, rank, size, name=""):
        return _fresh(full)

    def unshard(self, parts, name=""):
        return parts[0]


@dataclass(frozen=True)
class Split:
    """Equal contiguous chunks along `dim`, rank r takes chunk r."""

    dim: int = 0

    def shard(self, full, rank, size, name=""):
        return _chunk(full, self.dim, rank, size, name)

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

    def shard(self, full, rank, size, name=""):
        if full.shape[self.dim] % self.num_heads:
            raise ShardError(f"{name}: dim {self.dim} of size {full.shape[self.dim]} is not "
                             f"{self.num_heads} whole heads")
        if self.num_heads >= size:
            if self.num_heads % size:
                raise ShardError(f"{name}: {self.num_heads} heads cannot be split across "
                                 f"tp_size={size}")
            return _chunk(full, self.dim, rank, size, name)
        if size % self.num_heads:
            raise ShardError(f"{name}: {self.num_heads} heads cannot be replicated across "
                             f"tp_size={size}")
        return _chunk(full, self.dim, self._head_owner(rank, size), self.num_heads, name)

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

    def shard(self, full, rank, size, name=""):
        if full.shape[self.dim] != self.full_size:
            raise ShardError(f"{name}: dim {self.dim} is {full.shape[self.dim]}, "
                             f"expected {self.full_size}")
        step = -(-self.full_size // size)
        start = min(rank * step, self.full_size)
        have = min(step, self.full_size - start)
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
