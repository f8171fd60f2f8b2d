"""Paged KV cache: a pool of fixed-size blocks handed out to sequences."""

from __future__ import annotations

import torch

from freetoken.engine.sequence import Sequence


class BlockManager:
    """Free-list allocator of cache blocks; a sequence of n tokens holds ceil(n / block_size)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self.free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` enough blocks for `num_tokens` tokens."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self.free.pop())

    def release(self, seq: Sequence) -> None:
        self.free.extend(reversed(seq.block_table))
        seq.block_table = []
        seq.num_cached = 0

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + (
            position % self.block_size)


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[2, layers, blocks, block_size, local_kv_heads, head_dim] for k and v."""
    return torch.zeros(2, num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                       dtype=dtype, device=device)
