"""The shard spec Qwen3.5's gated attention needs beyond `freetoken.loading.specs`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.loading.specs import ShardError


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

    def shard(self, full, rank, size, name=""):
        if self.num_heads % size:
            raise ShardError(f"{name}: {self.num_heads} heads cannot be split across "
                             f"tp_size={size}")
        head_dim, local = self._head_rows(full, name), self.num_heads // size
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
