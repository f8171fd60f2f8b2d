"""Qwen3.5 MoE block: top-k routed experts plus a shared expert scaled by
`sigmoid(shared_expert_gate(x))`. Experts and the shared expert are split on their
intermediate dimension; router and shared-expert gate are replicated. Both paths produce
rank-partial sums that are added first and all-reduced once."""

from __future__ import annotations

import torch
from torch import nn

from freetoken.context import uses_kernels
from freetoken.distributed import get_communicator, get_tp_info
from freetoken.formats.quant import FP8_BLOCK
from freetoken.kernels import fused_moe, gemv
from freetoken.kernels.moe_rows import SharedExpertRows
from freetoken.layers import invariant
from freetoken.layers.activation import silu_and_mul
from freetoken.layers.layout import LocalRows
from freetoken.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from freetoken.layers.moe import FusedExperts, route
from freetoken.layers.quantization.fp8.block_linear import BlockFP8Linear
from freetoken.layers.quantization.fp8.moe import BlockFP8FusedExperts
from freetoken.layers.quantization.nvfp4.moe import NVFP4FusedExperts
from freetoken.models.qwen3_5_moe.config import Qwen35MoeConfig

SHARED = "shared_expert_intermediate_size"


class SharedExpert(nn.Module):
    """A SiLU-gated MLP whose result is this rank's partial sum (no all-reduce)."""

    def __init__(self, hidden: int, intermediate: int, formats: tuple = (None, None)):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, what=SHARED,
                                                       fmt=formats[0])
        self.down_proj = RowParallelLinear(intermediate, hidden, what=SHARED, reduce=False,
                                           fmt=formats[1])

    @staticmethod
    def layout(intermediate: int, tp: int) -> LocalRows:
        """gate_up_proj's `[gate | up]` rows at `tp` ranks (down_proj's inputs are one of
        them)."""
        return MergedColumnParallelLinear.layout([intermediate] * 2, tp, SHARED)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if uses_kernels():
            return self.down_proj(self.gate_up_proj.forward_gated(x))
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.gate_up_proj.canonical))

    def leaves(self, x: torch.Tensor) -> torch.Tensor:
        """tp_invariant mode: the down projection's fp32 leaves [local chunks, T, H]."""
        return self.down_proj.leaves(silu_and_mul(self.gate_up_proj(x),
                                                  self.gate_up_proj.canonical))


def _routed_experts(cfg: Qwen35MoeConfig, fmt) -> nn.Module:
    """`NVFP4FusedExperts` (backend auto: torch on CPU, triton on CUDA) when the checkpoint
    stores the experts in NVFP4, `BlockFP8FusedExperts` in block FP8, else `FusedExperts`;
    all split on the intermediate dim."""
    if fmt is not None and fmt.kind == FP8_BLOCK:
        return BlockFP8FusedExperts(cfg.num_experts, cfg.hidden_size,
                                    cfg.moe_intermediate_size, fmt.block, fmt.input_scales)
    if not cfg.nvfp4_experts:
        return FusedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
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
        return self._from_logits(x, self.gate(x))

    def _from_logits(self, x: torch.Tensor, logits: torch.Tensor,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output for x given its router logits, plus `residual` where given:
        on the CUDA path at TP 1 (no all-reduce between) inside the block's last launch."""
        weights, ids = route(logits, self.top_k, True, x.dtype)
        if uses_kernels() and self._gates_in_combine(x):
            shared = self._shared_rows(x)
            if residual is not None and get_tp_info().size == 1:
                return self._routed_and_shared(x, weights, ids, shared, residual=residual)
            out = get_communicator().all_reduce(self._routed_and_shared(x, weights, ids,
                                                                         shared))
        elif self.shared_expert.down_proj.canonical is not None:
            out = self._canonical(x, weights, ids)
        else:
            # The sigmoid gate is replicated, so scaling each rank's partial sum by it is
            # exact.
            shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            out = get_communicator().all_reduce(self.experts(x, weights, ids) + shared)
        return out if residual is None else residual + out

    def _canonical(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        """tp_invariant mode: routed + gated shared leaves, chunk by chunk, in fp32, then one
        canonical reduction and one rounding."""
        gate = torch.sigmoid(self.shared_expert_gate(x)).to(torch.float32)
        leaves = self.experts.leaves(x, weights, ids) + gate * self.shared_expert.leaves(x)
        return invariant.finish(leaves, x.dtype)

    def _gates_in_combine(self, x: torch.Tensor) -> bool:
        """Whether `gemv.moe_combine` serves x: a decode batch of the 16-bit router's and
        shared gate's dtype, the decode kernels on, outside the tp_invariant mode."""
        return gemv.enabled() and self.shared_expert_gate.bias is None and \
            self.shared_expert.down_proj.canonical is None and \
            gemv.fits(x, self.gate.weight) and gemv.fits(x, self.shared_expert_gate.weight)

    def forward_residual(self, h: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """`h + self(norm(h))`, the decoder layer's second half. On the CUDA path for a
        decode batch the norm runs inside the router's GEMV, which also stores the
        normalised x for the experts (where the tile table has that call,
        `ReplicatedLinear.forward_keeping_normed`), whatever the experts' format, and at
        TP 1 the residual add runs inside the block's last launch (`_routed_and_shared`):
        one token's block with the shared expert in the routed row kernels is then the
        router, the routing and two expert launches (16-bit and block-FP8 experts at one
        token, NVFP4 ones on the tensor-core decode). Called as a method, not a module: on
        that path the block's own hooks would record the residual sum (bisect compares a
        module's output with HF's), as for the mixers."""
        if not uses_kernels():
            return h + self(norm(h))
        fused = self.gate.forward_keeping_normed(h, norm)
        if fused is None:
            x = norm(h)
            logits = self.gate(x)
        else:
            x, logits = fused
        return self._from_logits(x, logits, residual=h)

    def _routed_and_shared(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                           shared: SharedExpertRows | None,
                           residual: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's routed sum plus the gated shared expert (plus `residual`, added in the
        same launch), on the CUDA path for a decode batch (`_gates_in_combine`): in the
        routed experts' own launches (`shared` given: the row kernels, or NVFP4's
        tensor-core decode), or the routed slots, the shared expert and its gate combined in
        one launch (`gemv.moe_combine`). Experts that do not give their
        slots (`combines` False: NVFP4, or block FP8 where its kernels do not serve x) give
        their rounded sum as the one slot."""
        if shared is not None:
            return self.experts(x, weights, ids, shared=shared, residual=residual)
        if self.experts.combines(x):
            slots = self.experts(x, weights, ids, sum_slots=False)
        else:
            slots = self.experts(x, weights, ids)[:, None]
        return gemv.moe_combine(slots, x, self.shared_expert_gate.weight, self.shared_expert(x),
                                residual=residual)

    def _shared_rows(self, x: torch.Tensor):
        """The shared expert and its gate for the routed experts' kernels, which then
        compute them as one more slot (`fused_moe.SHARED_IN_ROWS`): for the row kernels
        (one token, rows taken, experts that give their slots) 16-bit projections beside
        16-bit routed experts, or block-FP8 ones beside block-FP8 experts of the same column
        block (`SharedExpertRows`); for NVFP4 experts on their tensor-core decode an NVFP4
        shared expert of their shapes (`NVFP4FusedExperts.shared_slot`). None otherwise:
        more tokens, biased or unfused formats (a 16-bit shared expert beside quantized
        experts)."""
        gate_up, down = self.shared_expert.gate_up_proj, self.shared_expert.down_proj
        gate = self.shared_expert_gate
        if isinstance(self.experts, NVFP4FusedExperts):
            return self.experts.shared_slot(x, gate_up, down, gate)
        if x.shape[0] != 1 or not (fused_moe.ROWS_AT_ONE_TOKEN and fused_moe.SHARED_IN_ROWS) \
                or not self.experts.combines(x):
            return None
        if any(lin.bias is not None for lin in (gate_up, down, gate)) or \
                gate.quant is not None or gate.weight.dtype != x.dtype:
            return None
        if type(self.experts) is FusedExperts:
            if gate_up.quant is None and down.quant is None and \
                    gate_up.weight.dtype == down.weight.dtype == x.dtype:
                return SharedExpertRows(gate_up.weight, down.weight, gate.weight)
            return None
        if not isinstance(self.experts, BlockFP8FusedExperts):
            return None
        block = self.experts.block
        if not all(isinstance(lin.quant, BlockFP8Linear) and lin.quant.block[1] == block[1]
                   for lin in (gate_up, down)):
            return None
        return SharedExpertRows(gate_up.weight, down.weight, gate.weight,
                                w13_scale=gate_up.weight_scale,
                                w13_scale_row=gate_up.weight_scale_row,
                                w2_scale=down.weight_scale, w2_scale_row=down.weight_scale_row,
                                block_cols=block[1], w2_col_offset=down.quant.col_offset())
