"""Qwen3.5 MoE block: top-k routed experts plus a shared expert scaled by
`sigmoid(shared_expert_gate(x))`. Experts and the shared expert are split on their
intermediate dimension; router and shared-expert gate are replicated. Both paths produce
rank-partial sums that are added first and all-reduced once."""

from __future__ import annotations

import torch
from torch import nn

from freetoken.distributed import get_communicator
from freetoken.formats.quant import FP8_BLOCK
from freetoken.layers.activation import silu_and_mul
from freetoken.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from freetoken.layers.moe import FusedExperts, route
from freetoken.models.qwen3_5_moe.config import Qwen35MoeConfig


class SharedExpert(nn.Module):
    """A SiLU-gated MLP whose result is this rank's partial sum (no all-reduce)."""

    def __init__(self, hidden: int, intermediate: int, formats: tuple = (None, None)):
        super().__init__()
        what = "shared_expert_intermediate_size"
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, what=what,
                                                       fmt=formats[0])
        self.down_proj = RowParallelLinear(intermediate, hidden, what=what, reduce=False,
                                           fmt=formats[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


def _routed_experts(cfg: Qwen35MoeConfig, fmt) -> nn.Module:
    """`NVFP4FusedExperts` (backend auto: torch on CPU, triton on CUDA) when the checkpoint
    stores the experts in NVFP4, `BlockFP8FusedExperts` in block FP8, else `FusedExperts`;
    all split on the intermediate dim."""
    if fmt is not None and fmt.kind == FP8_BLOCK:
        from freetoken.layers.quantization.fp8.moe import BlockFP8FusedExperts

        return BlockFP8FusedExperts(cfg.num_experts, cfg.hidden_size,
                                    cfg.moe_intermediate_size, fmt.block)
    if not cfg.nvfp4_experts:
        return FusedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
    from freetoken.layers.quantization.nvfp4 import NVFP4FusedExperts

    return NVFP4FusedExperts(
        cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
        global_scale_is_reciprocal=cfg.quantization.global_scale_is_reciprocal)


class SparseMoeBlock(nn.Module):
    """`prefix`: the block's engine name (`model.layers.L.mlp`), which picks the formats of
    its experts and shared expert."""

    def __init__(self, cfg: Qwen35MoeConfig, prefix: str = ""):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts)
        self.experts = _routed_experts(cfg, cfg.format_of(f"{prefix}.experts"))
        shared = f"{prefix}.shared_expert"
        self.shared_expert = SharedExpert(cfg.hidden_size, cfg.shared_expert_intermediate_size,
                                          (cfg.format_of(f"{shared}.gate_up_proj"),
                                           cfg.format_of(f"{shared}.down_proj")))
        self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, True, x.dtype)
        # The sigmoid gate is replicated, so scaling each rank's partial sum by it is exact.
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return get_communicator().all_reduce(self.experts(x, weights, ids) + shared)
