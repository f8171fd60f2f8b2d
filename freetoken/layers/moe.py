"""Mixture-of-experts building blocks: top-k routing and experts split on the intermediate
dimension (each rank computes a partial sum that the MoE block all-reduces once)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.context import uses_kernels
from freetoken.distributed import divide, get_tp_info
from freetoken.kernels import fused_moe
from freetoken.layers import invariant
from freetoken.layers.activation import silu_and_mul
from freetoken.layers.layout import GATE_UP, LocalRows


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype):
    """Softmax in fp32 -> top-k -> optional renormalisation; weights cast to `dtype` (one
    Triton launch in steps that take the CUDA paths)."""
    if uses_kernels():
        return fused_moe.route(router_logits, top_k, renormalize, dtype)
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


class FusedExperts(nn.Module):
    """All experts of one layer, stacked: `w13` [E, 2 * I_local, H] holds gate then up rows,
    `w2` [E, H, I_local]. The result is this rank's partial sum (no all-reduce)."""

    def __init__(self, num_experts: int, hidden: int, full_intermediate: int):
        super().__init__()
        self.num_experts = num_experts
        rows = self.layout(full_intermediate, get_tp_info().size)
        i = self.local_intermediate = rows.size("gate")
        self.w13 = nn.Parameter(torch.empty(num_experts, rows.total, hidden),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, i), requires_grad=False)
        self.canonical = invariant.active_reductions()

    @staticmethod
    def layout(full_intermediate: int, tp: int) -> LocalRows:
        """Each expert's w13 `[gate | up]` rows at `tp` ranks (w2's inputs are one of them)."""
        i = divide(full_intermediate, tp, "moe_intermediate_size")
        return LocalRows(GATE_UP, (i, i))

    def combines(self, x: torch.Tensor) -> bool:
        """Whether `forward` takes `sum_slots=False`, `shared` and `residual` for x: in a
        step that takes the CUDA paths (the caller's test)."""
        return self.canonical is None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                sum_slots: bool = True, shared: fused_moe.SharedExpertRows | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """Each token's weighted expert outputs summed in fp32 and rounded once to x's dtype,
        as HF's default (grouped_mm) experts do; summing in bf16 rounds once per expert and
        moves bf16 logits by as much as HF's eager and grouped_mm paths differ. In a step
        that takes the Triton paths (CUDA) the grouped kernels compute the same sum without a
        host sync; there `sum_slots=False` returns the weighted slots themselves, float32
        [T, top_k, H], for a caller that sums them in a launch of its own, and `shared` (one
        token) adds the block's gated shared expert in the same launches, and `residual`
        (one token) `residual + ` the result in the down launch."""
        if uses_kernels():
            return fused_moe.fused_moe(x, weights, ids, self.w13, self.w2, sum_slots=sum_slots,
                                       shared=shared, residual=residual)
        if not sum_slots or shared is not None or residual is not None:
            raise ValueError("FusedExperts: sum_slots=False, shared and residual are for the "
                             "CUDA path only")
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        hit = torch.bincount(ids.flatten(), minlength=self.num_experts).nonzero().flatten()
        for e in hit.tolist():
            token, slot = torch.where(ids == e)
            h = silu_and_mul(F.linear(x[token], self.w13[e]))
            h = F.linear(h, self.w2[e]) * weights[token, slot, None]
            out.index_add_(0, token, h.float())
        return out.to(x.dtype)

    def leaves(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """tp_invariant mode: this rank's fp32 leaves [local chunks, T, H] of the weighted
        expert sum (`invariant.expert_leaves`), for the MoE block's canonical reduction."""
        canonical = self.canonical
        if uses_kernels():
            return fused_moe.fused_moe_leaves(x, weights, ids, self.w13, self.w2,
                                              canonical.local_chunks)

        def expert_mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
            h = silu_and_mul(invariant.column_linear(rows, self.w13[e], None, canonical.tile),
                             canonical)
            return invariant.chunk_leaves(h, self.w2[e], canonical.local_chunks)

        return invariant.expert_leaves(x, weights, ids, self.num_experts, expert_mlp, canonical)
