"""Tokens' (token, slot) pairs sorted by expert into fixed-size blocks, the layout the grouped
MoE kernels (NVFP4 and bf16 experts alike) walk, computed on the device without a host sync:
by torch ops (`align_by_expert`, the reference) or in one launch (`align_small`, the kernel
`moe_jit.align_kernel`); `align_pairs` takes the launch where it serves."""

from __future__ import annotations

import torch

from freetoken.kernels import jit_module, next_pow2

ALIGN_MAX_PAIRS = 1024
"""Up to this many pairs are sorted by `align_small` (one launch), more by torch ops
(`align_pairs`)."""


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_by_expert`'s layout of the pairs `ids` [n]: one launch
    (`align_small`) up to ALIGN_MAX_PAIRS pairs, the torch sort beyond."""
    if ids.numel() <= ALIGN_MAX_PAIRS:
        return align_small(ids, num_experts, block_m)
    return align_by_expert(ids, num_experts, block_m)


def align_small(ids: torch.Tensor, num_experts: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_by_expert`'s result (same rows, same block experts) in one launch of
    one program per expert; for up to ALIGN_MAX_PAIRS pairs."""
    n = ids.numel()
    if n > ALIGN_MAX_PAIRS:
        raise ValueError(f"align_small: {n} pairs, at most {ALIGN_MAX_PAIRS}")
    expert_blocks = -(-n // block_m)   # the most blocks one expert's run can take
    num_blocks = expert_blocks + min(num_experts, n)
    rows = torch.empty(num_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=ids.device)
    jit_module("moe_jit").align_kernel[(num_experts,)](
        ids_ptr=ids.reshape(-1).contiguous(), rows_ptr=rows, block_expert_ptr=block_expert,
        num_pairs=n, num_blocks=num_blocks, expert_blocks=expert_blocks, BLOCK_M=block_m,
        BLOCK_E=_pow2(num_experts), BLOCK_P=_pow2(n),
        BLOCK_B=min(16, _pow2(expert_blocks)),
        TAIL_ROWS=_pow2(-(-num_blocks * block_m // num_experts)),
        TAIL_BLOCKS=_pow2(-(-num_blocks // num_experts)), num_warps=4)
    return rows, block_expert


def _pow2(n: int) -> int:
    return max(16, next_pow2(n))


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
