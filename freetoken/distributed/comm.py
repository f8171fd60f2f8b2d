"""Every collective the engine issues goes through a Communicator."""

from __future__ import annotations

import torch
import torch.distributed as dist


class Communicator:
    """Collectives over the TP group; with one rank every call is the identity."""

    def __init__(self, size: int = 1):
        self.size = size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks, in place (any layout); returns it."""
        if self.size > 1:
            _in_place(dist.all_reduce, x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim` in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)

    def all_reduce_tree(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks as `tree_sum`'s fixed binary tree with rank 0 leftmost: every
        rank's tensor is gathered (in x's dtype, unrounded) and combined in that order, so
        the result is the same bits on every rank, whatever order the backend reduces in.
        Returns a new tensor; the tp_invariant mode's all-reduce (size a power of two)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format)
                 for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return tree_sum(parts)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite `x` on every rank with rank `src`'s value (any layout); returns it."""
        if self.size > 1:
            _in_place(dist.broadcast, x, src)
        return x


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The canonical tree: adjacent pairs summed (left + right), level by level, until one
    tensor is left. A consecutive, aligned run of leaves is a subtree, which is what lets
    ranks sum their own leaves first. The number of parts must be a power of two."""
    if not parts or len(parts) & (len(parts) - 1):
        raise ValueError(f"tree_sum needs a power-of-two number of parts, got {len(parts)}")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def _in_place(op, x: torch.Tensor, *args) -> None:
    """Run the in-place collective `op` on a contiguous buffer and write it back into `x`:
    gloo silently works on the `numel` storage elements that follow a strided view's offset,
    not on the view's own elements, and NCCL refuses a non-contiguous tensor."""
    buffer = x if x.is_contiguous() else x.contiguous()
    op(buffer, *args)
    if buffer is not x:
        x.copy_(buffer)


_COMM = Communicator()


def set_communicator(comm: Communicator) -> None:
    global _COMM
    _COMM = comm


def get_communicator() -> Communicator:
    return _COMM
