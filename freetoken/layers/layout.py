"""The TP-local layout of a parallel layer's weight: its rank-local rows as named segments.
Each parallel layer computes its own (`QKVParallelLinear.layout`, `FusedExperts.layout`, ...)
from the TP size it is given; the layer sizes its parameters from it and the model's shard
rules take their slots from the same call, so the two cannot drift apart."""

from __future__ import annotations

from dataclasses import dataclass

GATE_UP = ("gate", "up")
"""The segments of a SiLU-gated MLP's merged projection."""


@dataclass(frozen=True)
class LocalRows:
    """A column-parallel weight's rank-local rows as named consecutive segments (`[q | k |
    v]`, `[gate | up]`), each with its local size."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.names) != len(self.sizes):
            raise ValueError(f"segments {self.names} given {len(self.sizes)} sizes")

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def slot(self, first: str, last: str | None = None) -> slice:
        """The local rows of segment `first` (through segment `last`, when given): where a
        shard rule puts that segment's shard in the weight."""
        start, stop = self.names.index(first), self.names.index(last or first) + 1
        offset = sum(self.sizes[:start])
        return slice(offset, offset + sum(self.sizes[start:stop]))

    def size(self, first: str, last: str | None = None) -> int:
        """How many local rows segment `first` (through `last`) has."""
        rows = self.slot(first, last)
        return rows.stop - rows.start

    def select(self, *names: str) -> LocalRows:
        """The rows of segments `names` alone, as a weight of their own holds them."""
        return LocalRows(names, tuple(self.size(name) for name in names))
