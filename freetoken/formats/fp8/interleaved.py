"""The block scale of Qwen3.5's attention `q_proj`, whose rows interleave `[q_h | gate_h]`
per head and which the engine regroups into `[q of its heads | gate of its heads]`
(`InterleavedHeads`). A head of head_dim rows is block-aligned only when B divides head_dim
(true at 35B: 256 = 2 x 128; not on tiny models); to move scales with their rows for every
head_dim, the scale is EXPANDED AT LOAD to one scale row per weight row, then regrouped like
the weight. The layer then dequantizes q and gate with a row block of 1. The inverse takes
every B-th expanded row back, so the split is bitwise invertible."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.formats.shard import Piece, ShardError, ShardPieces
from freetoken.formats.specs import InterleavedHeads


@dataclass(frozen=True)
class InterleavedBlockRows:
    """Scale [ceil(rows / block), cols] of a weight of `rows` rows split by
    `InterleavedHeads(num_heads, parts)`: rank r gets one scale row per weight row it holds,
    in the regrouped order."""

    block: int
    rows: int
    num_heads: int
    parts: int = 2

    def _heads(self) -> InterleavedHeads:
        return InterleavedHeads(self.num_heads, self.parts)

    def _check(self, full: torch.Tensor, name: str) -> None:
        grid = -(-self.rows // self.block)
        if full.dim() != 2 or full.shape[0] != grid:
            raise ShardError(f"{name}: block scale of shape {tuple(full.shape)}; {self.rows} "
                             f"rows in blocks of {self.block} need {grid} scale rows")

    def _expanded(self, full: torch.Tensor) -> torch.Tensor:
        return full.repeat_interleave(self.block, 0)[:self.rows]

    def pieces(self, full, rank, size, name=""):
        """One piece per run of rows inside one block: that block's scale row, broadcast."""
        self._check(full, name)
        rows = self._heads().pieces(torch.empty(self.rows, 0, device="meta"), rank, size, name)
        pieces = []
        for head in rows.pieces:
            row = _first_row(head, self.rows, rank, size, self)
            at, end = head.start, head.start + head.length
            while at < end:
                run = min(end - at, self.block - row % self.block)
                view = full.narrow(0, row // self.block, 1).expand(run, full.shape[1])
                pieces.append(Piece(view, 0, at, run))
                at, row = at + run, row + run
        return ShardPieces((rows.shape[0], full.shape[1]), tuple(pieces))

    def shard(self, full, rank, size, name=""):
        self._check(full, name)
        return self._heads().shard(self._expanded(full), rank, size, name)

    def unshard(self, parts, name=""):
        expanded = self._heads().unshard(parts, name)
        return expanded[::self.block].clone()


def _first_row(head: Piece, rows: int, rank: int, size: int, spec: InterleavedBlockRows) -> int:
    """The checkpoint row a regrouped piece starts at, from its position in the shard (its
    part and local head)."""
    head_dim = rows // (spec.num_heads * spec.parts)
    local = spec.num_heads // size
    part, h = divmod(head.start // head_dim, local)
    return ((rank * local + h) * spec.parts + part) * head_dim
