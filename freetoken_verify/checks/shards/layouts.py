"""Layout statements: which global rows (or columns) of each checkpoint tensor TP rank r must
hold, in which local order, and where in the engine's parameters they go, derived from the
checkpoint's config.json and the model facts of the design alone, never from the engine's
shard specs or plans.

A statement lists the tensor's segments along its split dim (`[q keys | k keys | v]` of a
GatedDeltaNet conv1d, `[q_h | gate_h]` interleaved per head of a gated q_proj, one segment for a
plain head split) and splits each on its own by whole units (a head, a row, a 16-input NVFP4 group).
A block-FP8 scale is stated over its weight's segments (`Statement.block`): rank r holds, per
segment, the scale blocks covering the weight indices it holds, padded with zero entries to the
most any rank holds of that segment (two ranks whose indices share a block both hold it), or,
expanded at load, one scale entry per weight index (`per_row`).
`Statement.index(rank, tp)` is then the list of global indices rank r holds, in its local order;
`freetoken_verify.checks.shards.layout_compare` builds the expected local tensor from it by indexing
the full checkpoint tensor and compares what a rank holds with it, row by row.

The per-model statements are in `freetoken_verify.checks.shards.layout_book`."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

PAD = -1
"""Index of a padding row (vocab padding): the rank must hold zeros there."""


class LayoutError(ValueError):
    """The config's sizes cannot be laid out at this TP size, or a tensor's shape disagrees
    with the config; the message names the tensor and the sizes."""


@dataclass(frozen=True)
class Segment:
    """One named part of a packed tensor along its split dim: `units` units of `unit` indices
    each, unit u at global indices `start + u * stride + [0, unit)` (`stride` 0: contiguous).
    Each rank holds whole units: `units / tp` consecutive ones, or, when `replicate` and there
    are fewer units than ranks (KV heads), unit `r * units // tp`."""

    label: str
    start: int
    units: int
    unit: int = 1
    unit_name: str = "head"
    stride: int = 0
    replicate: bool = False

    @property
    def step(self) -> int:
        return self.stride or self.unit

    @property
    def extent(self) -> int:
        """Global indices this segment spans (interleaved segments share their span)."""
        return self.units * self.unit

    def owned(self, rank: int, tp: int, name: str) -> range:
        """The units rank `rank` of `tp` holds."""
        if self.units >= tp:
            if self.units % tp:
                raise LayoutError(f"{name}: {self.units} {self.unit_name}s of {self.label} "
                                  f"cannot be split across tp_size={tp}")
            local = self.units // tp
            return range(rank * local, (rank + 1) * local)
        if not self.replicate or tp % self.units:
            raise LayoutError(f"{name}: {self.units} {self.unit_name}s of {self.label} "
                              f"cannot be split across tp_size={tp}")
        head = rank * self.units // tp
        return range(head, head + 1)

    def rows(self, rank: int, tp: int, name: str) -> torch.Tensor:
        units = torch.tensor(list(self.owned(rank, tp, name)), dtype=torch.long)
        return (self.start + units[:, None] * self.step + torch.arange(self.unit)).flatten()

    def unit_of(self, index: int) -> int | None:
        """Which unit global `index` belongs to, or None when it is not in this segment."""
        offset = index - self.start
        if offset < 0 or offset % self.step >= self.unit or offset // self.step >= self.units:
            return None
        return offset // self.step


@dataclass(frozen=True)
class Statement:
    """Where checkpoint tensor `name` goes on every rank.

    `param` None: the engine ignores the tensor. `dim` None: every rank holds it whole
    (replicated). Otherwise rank r holds `index(r, tp)` along `dim`, segment by segment.
    `vocab` > 0: rows of a vocab of that size, padded with zero rows to a multiple of tp.
    `slot` indexes the engine parameter's leading dims (ints and slices), as the rank's
    local tensor is written there."""

    name: str
    param: str | None
    slot: tuple = ()
    dim: int | None = None
    segments: tuple[Segment, ...] = ()
    vocab: int = 0
    block: int = 0
    """> 0: the tensor is a block scale, one entry per `block` consecutive indices of the
    weight dim the segments describe (the last block may be partial)."""
    per_row: bool = False
    """With `block`: the rank holds one scale entry per weight index it holds (the scale
    expanded at load, as for q_proj's interleaved heads), not one per block."""
    shapes: tuple[tuple[int, ...], ...] = ()
    """The full shapes the config and the format allow (empty: only `dim` is checked)."""

    @property
    def ignored(self) -> bool:
        return self.param is None

    @property
    def replicated(self) -> bool:
        return self.param is not None and self.dim is None

    @property
    def weight_extent(self) -> int:
        """The global size of the dim the segments describe (the weight's, for a scale)."""
        return self.vocab or sum(s.extent for s in self.segments)

    @property
    def extent(self) -> int:
        """The global size of `dim` the statement expects."""
        return -(-self.weight_extent // self.block) if self.block else self.weight_extent

    def index(self, rank: int, tp: int) -> torch.Tensor:
        """Global indices along `dim` that rank `rank` of `tp` holds, in local order;
        `PAD` where it must hold a zero padding row (entry)."""
        if self.vocab:
            step = -(-self.vocab // tp)
            rows = torch.arange(rank * step, (rank + 1) * step)
            return torch.where(rows < self.vocab, rows, PAD)
        if not self.block:
            return torch.cat([s.rows(rank, tp, self.name) for s in self.segments])
        return torch.cat([self._blocks(s, rank, tp) for s in self.segments])

    def _blocks(self, seg: Segment, rank: int, tp: int) -> torch.Tensor:
        """The scale entries of segment `seg` rank `rank` holds: the block of each weight
        index (`per_row`), or the blocks its indices touch, in order, then PAD up to the
        most blocks any rank's indices of `seg` touch."""
        if self.per_row:
            return seg.rows(rank, tp, self.name) // self.block
        seg.owned(rank, tp, self.name)  # a split that cannot be made names this tensor
        return torch.tensor(_padded_blocks(seg, self.block, tp)[rank])

    def describe(self, index: int) -> str:
        """What global index `index` is: `k keys, key head 2`, `vocab row 7`, `padding`; for
        a block scale, the weight indices of the block: `rows 96..119: q keys, key heads
        6..7`."""
        if index == PAD:
            return "padding"
        if not self.block:
            return self._weight_index(index)
        first = index * self.block
        last = min(first + self.block, self.weight_extent) - 1
        word = "rows" if self.dim == 0 else "columns"
        return f"{word} {first}..{last}: {self._weight_span(first, last)}"

    def _weight_span(self, first: int, last: int) -> str:
        """Weight indices `first..last`: `q keys, key heads 6..7`, or where each end is."""
        for s in self.segments:
            a, b = s.unit_of(first), s.unit_of(last)
            if a is not None and b is not None:
                if s.unit == 1:
                    return s.label  # units of one index: the span says it already
                return f"{s.label}, {s.unit_name} {a}" if a == b else \
                    f"{s.label}, {s.unit_name}s {a}..{b}"
        a, b = self._weight_index(first), self._weight_index(last)
        return a if a == b else f"{a} to {b}"

    def _weight_index(self, index: int) -> str:
        if self.vocab:
            return "vocab row" if index < self.vocab else "past the vocab"
        for s in self.segments:
            unit = s.unit_of(index)
            if unit is not None:
                return f"{s.label}, {s.unit_name} {unit}"
        return "outside every segment"

    def check_shape(self, shape: tuple[int, ...]) -> None:
        """LayoutError when the checkpoint tensor's shape (or its split dim) disagrees with
        the config and the format."""
        if self.shapes and tuple(shape) not in self.shapes:
            allowed = " or ".join(str(s) for s in self.shapes)
            raise LayoutError(f"{self.name}: shape {tuple(shape)}, the config and its format "
                              f"give {allowed}")
        if self.ignored or self.dim is None:
            return
        have = shape[self.dim] if len(shape) > self.dim else None
        if have != self.extent:
            parts = " + ".join(f"{s.label} {s.extent}" for s in self.segments) or "vocab"
            parts += f", in blocks of {self.block}" if self.block else ""
            raise LayoutError(f"{self.name}: dim {self.dim} is {have}, the config gives "
                              f"{self.extent} ({parts})")


def heads(label: str, count: int, size: int, unit_name: str = "head", start: int = 0,
          replicate: bool = False) -> Segment:
    """`count` contiguous heads of `size` indices each."""
    return Segment(label, start, count, size, unit_name, replicate=replicate)


@functools.lru_cache(maxsize=4096)
def _padded_blocks(seg: Segment, block: int, tp: int) -> tuple[tuple[int, ...], ...]:
    """Per rank, the blocks of `block` indices its indices of `seg` touch, in order, then PAD
    up to the most any rank touches (cached: a checkpoint has thousands of experts of one
    geometry)."""
    touched = [torch.unique_consecutive(seg.rows(r, tp, seg.label) // block).tolist()
               for r in range(tp)]
    width = max(len(t) for t in touched)
    return tuple(tuple(t + [PAD] * (width - len(t))) for t in touched)


def contiguous(parts: list[tuple[str, int, int, str]]) -> tuple[Segment, ...]:
    """Contiguous segments `(label, units, unit, unit_name)`, in order."""
    segments, start = [], 0
    for label, units, unit, unit_name in parts:
        segments.append(Segment(label, start, units, unit, unit_name))
        start += units * unit
    return tuple(segments)


def packed(name: str, param: str, parts: list[tuple[str, int, int, str]], slot: tuple = (),
           dim: int = 0) -> Statement:
    """A tensor of contiguous segments `(label, units, unit, unit_name)`, in order."""
    return Statement(name, param, slot, dim, contiguous(parts))


def replicated(name: str, param: str, slot: tuple = ()) -> Statement:
    """Every rank holds the tensor whole."""
    return Statement(name, param, slot)


def ignored(name: str, shapes: tuple[tuple[int, ...], ...] = ()) -> Statement:
    """The engine does not load the tensor (`shapes`: the full shapes it may still have, as
    for an input scale it drops, a scalar)."""
    return Statement(name, None, shapes=shapes)
