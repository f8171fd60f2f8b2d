"""The per-step batch layout every attention layer reads (set by the model runner)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardContext:
    """One forward step over a flat batch of tokens from several sequences.

    `query_lens[i]` new tokens of sequence i attend to its first `context_lens[i]` cached
    positions (new tokens included); `slot_mapping[t]` is the cache slot token t is written to;
    `block_tables[i]` lists sequence i's cache blocks; `seq_slots[i]` is its linear-state slot.
    """

    is_prefill: bool
    query_lens: list[int]
    context_lens: list[int]
    slot_mapping: torch.Tensor
    block_tables: list[list[int]]
    seq_slots: list[int] | None = None
    _decode: dict = field(default_factory=dict, repr=False)

    def decode_layout(self, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """For a decode step: cache slots [batch, longest context] of every sequence's
        positions (padding points at slot 0) and the mask of real positions. Built once per
        step, shared by every attention layer."""
        if block_size not in self._decode:
            lens = torch.tensor(self.context_lens, device=device)
            width = max(len(t) for t in self.block_tables)
            tables = torch.zeros(len(self.block_tables), width, dtype=torch.long, device=device)
            for i, blocks in enumerate(self.block_tables):
                tables[i, : len(blocks)] = torch.tensor(blocks, device=device)
            pos = torch.arange(int(lens.max()), device=device)
            slots = tables[:, pos // block_size] * block_size + pos % block_size
            valid = pos[None, :] < lens[:, None]
            self._decode[block_size] = (slots.masked_fill(~valid, 0), valid)
        return self._decode[block_size]


_CONTEXT: ForwardContext | None = None


def set_forward_context(ctx: ForwardContext | None) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("no forward context: the model must be run by the model runner")
    return _CONTEXT
