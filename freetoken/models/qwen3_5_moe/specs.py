"""The shard spec Qwen3.5's gated attention needs beyond `freetoken.loading.specs`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.loading.specs import Piece, ShardError, ShardPieces


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
