"""The per-step batch layout every attention layer reads (set by the model runner)."""

from __future__ import annotations

from dataclasses import dataclass

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


_CONTEXT: ForwardContext | None = None


def set_forward_context(ctx: ForwardContext | None) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("no forward context: the model must be run by the model runner")
    return _CONTEXT
