"""Tokens' (token, slot) pairs sorted by expert into fixed-size blocks, the layout the grouped
MoE kernels (NVFP4 and bf16 experts alike) walk, computed on the device without a host sync."""

from __future__ import annotations

import torch


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort pairs by expert, padding each expert's run to a multiple of `block_m`.

    Returns `rows` int32 [num_blocks * block_m] (pair index per sorted row, len(ids) where
    padding) and `block_expert` int32 [num_blocks] (-1: block unused). num_blocks is the upper
    bound cdiv(n, block_m) + min(E, n), so the grid needs no device-to-host copy."""
    n = ids.numel()
    num_blocks = -(-n // block_m) + min(num_experts, n)
    ids = ids.to(torch.int64)
    order = torch.argsort(ids, stable=True)
    # scatter_add instead of bincount: bincount reads the max back to the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    first = torch.cumsum(counts, 0) - counts
    sorted_e = ids[order]
    rank_in_expert = torch.arange(n, device=ids.device) - first[sorted_e]
    dest = padded_end[sorted_e] - padded[sorted_e] + rank_in_expert
    rows = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=ids.device)
    rows[dest] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return rows, block_expert.to(torch.int32)
