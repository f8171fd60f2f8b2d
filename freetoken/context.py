"""The per-step batch layout every attention layer reads (set by the model runner)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DeviceBatch:
    """The step's layout as device tensors, for the CUDA kernels (which read them without
    a host sync; a graphed decode step captures static buffers of this shape).

    `block_tables` int32 [B, max blocks] (unused entries 0), `context_lens` int32 [B],
    `query_starts` int32 [B + 1] (sequence i's tokens are [query_starts[i],
    query_starts[i + 1]) of the flat batch), `seq_slots` int64 [B] linear-state slots."""

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_starts: torch.Tensor
    seq_slots: torch.Tensor


@dataclass
class ForwardContext:
    """One forward step over a flat batch of tokens from several sequences.

    `query_lens[i]` new tokens of sequence i attend to its first `context_lens[i]` cached
    positions (new tokens included); `slot_mapping[t]` is the cache slot token t is written to;
    `block_tables[i]` lists sequence i's cache blocks; `seq_slots[i]` is its linear-state slot.
    `device` holds the same layout as device tensors on CUDA (None on CPU: the torch paths).
    """

    is_prefill: bool
    query_lens: list[int]
    context_lens: list[int]
    slot_mapping: torch.Tensor
    block_tables: list[list[int]]
    seq_slots: list[int] | None = None
    device: DeviceBatch | None = None
    _decode: dict = field(default_factory=dict, repr=False)

    def cached(self, key, build):
        """`build()`, computed once per step and shared by every layer that asks for `key`."""
        if key not in self._decode:
            self._decode[key] = build()
        return self._decode[key]

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


def device_batch(query_lens: list[int], context_lens: list[int],
                 block_tables: list[list[int]], seq_slots: list[int], device) -> DeviceBatch:
    """A DeviceBatch from the step's host lists, in one host-to-device copy."""
    width = max(len(t) for t in block_tables)
    batch = len(query_lens)
    host = torch.zeros(batch * (width + 3) + 1, dtype=torch.int32)
    tables = host[: batch * width].view(batch, width)
    for i, blocks in enumerate(block_tables):
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    rest = host[batch * width:]
    rest[:batch] = torch.tensor(context_lens, dtype=torch.int32)
    rest[batch + 1 : 2 * batch + 1] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    rest[2 * batch + 1:] = torch.tensor(seq_slots, dtype=torch.int32)
    dev = host.to(device, non_blocking=False)
    rest = dev[batch * width:]
    return DeviceBatch(dev[: batch * width].view(batch, width), rest[:batch],
                       rest[batch : 2 * batch + 1], rest[2 * batch + 1:].long())


_CONTEXT: ForwardContext | None = None


def set_forward_context(ctx: ForwardContext | None) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def uses_kernels() -> bool:
    """Whether the running step takes the Triton paths (its context carries device tensors)."""
    return _CONTEXT is not None and _CONTEXT.device is not None


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("no forward context: the model must be run by the model runner")
    return _CONTEXT
