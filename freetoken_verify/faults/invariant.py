"""Faults only a zero-tolerance comparison sees, for `--fault`: in the engine's tp_invariant
reductions (`freetoken.layers.invariant`: a subtree or the wire in bf16, another summation
order or tree on one rank, a column tiling that follows the launch's width) and in arithmetic
one rank does in lower precision than the others (rotary angles, the per-head q/k norm's
variance). Each moves TP=N's logits off TP=1's bits by less than the tolerance of the dtype it
is catalogued in, so `--bitwise` golden and bisect catch and name it where the tolerance
comparison passes (docs/verification.md records each one's tolerance-mode verdict)."""

from __future__ import annotations

import torch

from freetoken.distributed import get_communicator, get_tp_info
from freetoken.distributed.comm import tree_sum
from freetoken.layers import invariant
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rotary import RotaryEmbedding


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


def invariant_subtree_bf16() -> None:
    """Rank 1 rounds its fp32 subtree sum to bf16 before the reduction (a partial result
    stored in the activation dtype on one rank)."""
    clean = invariant.reduce_subtrees

    def reduce_subtrees(subtree: torch.Tensor) -> torch.Tensor:
        if get_tp_info().rank == 1:
            subtree = subtree.to(torch.bfloat16).to(subtree.dtype)
        return clean(subtree)

    invariant.reduce_subtrees = reduce_subtrees


def invariant_tree_order_swapped() -> None:
    """Rank 1 builds its subtree with its two middle leaves swapped (leaves [0, 2, 1, 3]:
    chunk 0 paired with chunk 2, not 1), another tree over the same leaves; it needs four
    leaves per rank (TP 2 of 8 chunks). Swapping the operands of one node changes nothing
    (IEEE addition commutes): the tree's shape is the order."""
    clean = invariant.finish

    def finish(leaves: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        parts = list(leaves.unbind(0))
        if get_tp_info().rank != 1 or len(parts) < 4:
            return clean(leaves, dtype)
        parts[1], parts[2] = parts[2], parts[1]
        return invariant.reduce_subtrees(tree_sum(parts)).to(dtype)

    invariant.finish = finish


def invariant_tiles_by_width() -> None:
    """Column-parallel GEMMs (and the LM head) are tiled by the launch's own width: one GEMM
    of all the rank's weight rows, whose result per element depends on how many columns the
    rank holds (torch's CPU matmul picks its kernel by shape)."""
    clean = invariant.column_linear

    def column_linear(x, weight, bias, tile=invariant.TILE):
        return clean(x, weight, bias, tile=weight.shape[0])

    invariant.column_linear = column_linear


def rotary_bf16_on_ranks() -> None:
    """Ranks > 0 compute the rotary angles (position x inverse frequency), and so cos and
    sin, in bf16 instead of fp32: their heads rotate by slightly other angles."""
    clean = RotaryEmbedding.cos_sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        if get_tp_info().rank == 0:
            return clean(self, positions, dtype)
        inv_freq = self.inv_freq.to(positions.device, torch.bfloat16)
        freqs = positions.to(torch.bfloat16)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    RotaryEmbedding.cos_sin = cos_sin


def qk_norm_variance_bf16_on_ranks() -> None:
    """On ranks > 0 the per-head q/k RMSNorm (inputs [tokens, heads, head_dim]) takes the
    mean of squares in bf16 instead of fp32 (a norm kernel reducing in the activation dtype
    on the heads a rank holds)."""
    clean = RMSNorm.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if get_tp_info().rank == 0 or x.dim() != 3:
            return clean(self, x)
        variance = x.to(torch.bfloat16).pow(2).mean(-1, keepdim=True).float()
        h = x.float() * torch.rsqrt(variance + self.eps)
        if self.offset:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)

    RMSNorm.forward = forward


INVARIANT_FAULTS = {
    "invariant-leaves-left-to-right": invariant_leaves_left_to_right,
    "invariant-bf16-wire": invariant_bf16_wire,
    "invariant-subtree-bf16": invariant_subtree_bf16,
    "invariant-tree-order-swapped": invariant_tree_order_swapped,
    "invariant-tiles-by-width": invariant_tiles_by_width,
    "rotary-bf16-on-ranks": rotary_bf16_on_ranks,
    "qk-norm-variance-bf16-on-ranks": qk_norm_variance_bf16_on_ranks,
}
