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


class StatePool:
    """Linear-state slots (a GatedDeltaNet layer's conv and recurrent state live at index
    `slot` of its state tensors), one per running sequence: taken on admission, given back
    when the sequence finishes or is preempted. A preempted sequence re-prefills from scratch
    into whatever slot it gets next, so its state is recomputed, never restored."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))
        self.owner: dict[int, int] = {}

    def acquire(self, seq: Sequence) -> int:
        """`seq`'s slot, taking a free one if it has none."""
        if seq.seq_id not in self.owner:
            if not self.free:
                raise RuntimeError(f"no free linear-state slot for sequence {seq.seq_id}: all "
                                   f"{self.num_slots} are held by running sequences")
            self.owner[seq.seq_id] = self.free.pop()
        return self.owner[seq.seq_id]

    def release(self, seq: Sequence) -> None:
        slot = self.owner.pop(seq.seq_id, None)
        if slot is not None:
            self.free.append(slot)
