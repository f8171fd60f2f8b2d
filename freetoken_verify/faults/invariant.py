"""Faults only a zero-tolerance comparison sees, in the engine's tp_invariant reductions
(`freetoken.layers.invariant`), for `--fault`: each moves TP=N's logits off TP=1's bits by far
less than any tolerance (fp32: about 1e-6 absolute), so only `--bitwise` golden catches them."""

from __future__ import annotations

import torch

from freetoken.distributed import get_communicator, get_tp_info
from freetoken.distributed.comm import tree_sum
from freetoken.layers import invariant


def invariant_leaves_left_to_right() -> None:
    """Rank 1 sums its fp32 leaves of each row-parallel reduction left to right instead of in
    the canonical binary tree (a reduction order that differs on one rank)."""
    clean = invariant.finish

    def finish(leaves: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if get_tp_info().rank != 1:
            return clean(leaves, dtype)
        parts = list(leaves.unbind(0))
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return invariant.reduce_subtrees(tree_sum([total])).to(dtype)

    invariant.finish = finish


def invariant_bf16_wire() -> None:
    """The invariant all-reduce sends bf16 partial sums and lets the backend add them (a
    partial sum rounded to bf16 before the all-reduce)."""

    def reduce_subtrees(subtree: torch.Tensor) -> torch.Tensor:
        return get_communicator().all_reduce(subtree.to(torch.bfloat16)).to(subtree.dtype)

    invariant.reduce_subtrees = reduce_subtrees


INVARIANT_FAULTS = {
    "invariant-leaves-left-to-right": invariant_leaves_left_to_right,
    "invariant-bf16-wire": invariant_bf16_wire,
}
