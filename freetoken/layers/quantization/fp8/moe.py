"""Routed experts in block FP8, weight-only, beside the NVFP4 ones: each expert a token routes
to has its gate|up and down weights dequantized to the activation dtype, then the same
SiLU-gated MLP and fp32 accumulation as `FusedExperts` (the torch path). In a step that takes
the CUDA paths the grouped kernels of `freetoken.kernels.fused_moe` dequantize the codes in
registers instead, without a host sync (so decode steps can be graphed); the buffers
`w13_scale_row` and `w2_scale_row` (int32, derived at construction) name each weight row's
scale row.

Parameters (I = TP-local intermediate size, B the block): `w13_weight` e4m3 [E, 2I, H] (gate
rows, then up rows), `w13_weight_scale` float32 [E, gate blocks + up blocks, ceil(H / B1)],
each of gate and up with its own scale rows; `w2_weight` e4m3 [E, H, I], `w2_weight_scale`
float32 [E, ceil(H / B0), blocks of I]; with static input activations (`input_scales`) each
expert's stored scalar input scales, `w13_input_scale` float32 [E, 2] (gate, up) and
`w2_input_scale` float32 [E], checked finite and above 0 at load and unused. At TP 8 on
Qwen3.5-35B (I = 64 < 128) ranks share a block; each dequantizes from its offset inside it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.context import uses_kernels
from freetoken.distributed import get_tp_info
from freetoken.formats.fp8.block import FP8, dequantize
from freetoken.formats.fp8.specs import BlockScaleSplit
from freetoken.kernels import fused_moe, quant_gemm
from freetoken.layers import invariant
from freetoken.layers.activation import silu_and_mul
from freetoken.layers.moe import FusedExperts
from freetoken.layers.quantization.weight_only import row_index


def _param(*shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class BlockFP8FusedExperts(nn.Module):
    """All experts of one layer in block FP8; `forward(x, topk_weights, topk_ids)` returns
    this rank's partial sum."""

    def __init__(self, num_experts: int, hidden: int, full_intermediate: int,
                 block: tuple[int, int], input_scales: bool = False):
        super().__init__()
        tp = get_tp_info()
        self.num_experts, self.block, self.tp = num_experts, block, tp
        i = self.local_intermediate = FusedExperts.layout(full_intermediate,
                                                          tp.size).size("gate")
        self.rows = BlockScaleSplit(0, block[0], full_intermediate)
        self.cols = BlockScaleSplit(1, block[1], full_intermediate)
        h_rows, h_cols = -(-hidden // block[0]), -(-hidden // block[1])
        e = num_experts
        self.w13_weight = _param(e, 2 * i, hidden, dtype=FP8)
        self.w13_weight_scale = _param(e, 2 * self.rows.blocks(tp.size), h_cols,
                                       dtype=torch.float32)
        self.w2_weight = _param(e, hidden, i, dtype=FP8)
        self.w2_weight_scale = _param(e, h_rows, self.cols.blocks(tp.size),
                                      dtype=torch.float32)
        if input_scales:
            self.w13_input_scale = _param(e, 2, dtype=torch.float32)
            self.w2_input_scale = _param(e, dtype=torch.float32)
        # The indices are computed on CPU: arithmetic under the model's device context
        # (meta while the engine builds) would import torch._dynamo, seconds per process.
        gate_rows = (self.rows.offset(tp.rank, tp.size) + torch.arange(i, device="cpu")) \
            // block[0]
        row_index(self, "w13_scale_row",
                  torch.cat([gate_rows, gate_rows + self.rows.blocks(tp.size)]))
        row_index(self, "w2_scale_row", torch.arange(hidden, device="cpu") // block[0])
        self.canonical = invariant.active_reductions()

    def dequantize_w13(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `e`'s gate|up rows on this rank [2I, H] in `dtype`."""
        i, blocks = self.local_intermediate, self.rows.blocks(self.tp.size)
        offset = (self.rows.offset(self.tp.rank, self.tp.size), 0)
        w, s = self.w13_weight[e], self.w13_weight_scale[e]
        return torch.cat([dequantize(w[:i], s[:blocks], self.block, offset, dtype),
                          dequantize(w[i:], s[blocks:], self.block, offset, dtype)])

    def dequantize_w2(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `e`'s down weight on this rank [H, I] in `dtype`."""
        offset = (0, self.cols.offset(self.tp.rank, self.tp.size))
        return dequantize(self.w2_weight[e], self.w2_weight_scale[e], self.block, offset, dtype)

    def block_scales(self) -> tuple[fused_moe.ExpertBlockScales, fused_moe.ExpertBlockScales]:
        """The scales of w13 and w2 as the grouped kernels take them."""
        return (fused_moe.ExpertBlockScales(self.w13_weight_scale, self.w13_scale_row,
                                            self.block[1]),
                fused_moe.ExpertBlockScales(self.w2_weight_scale, self.w2_scale_row,
                                            self.block[1],
                                            self.cols.offset(self.tp.rank, self.tp.size)))

    def combines(self, x: torch.Tensor) -> bool:
        """Whether `forward` takes `sum_slots=False`, `shared` and `residual` for x: where
        the quantized kernels serve it (in a step that takes the CUDA paths, the caller's
        test), outside the tp_invariant mode."""
        return self.canonical is None and quant_gemm.serves(x)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                sum_slots: bool = True, shared: fused_moe.SharedExpertRows | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's weighted expert sum, rounded once to x's dtype. On the CUDA path
        (`fused_moe.fused_moe` with the block scales) as `FusedExperts.forward`:
        `sum_slots=False` the float32 slots, `shared` a block-FP8 shared expert in the same
        launches (one token), `residual` added in the down launch."""
        if uses_kernels() and quant_gemm.serves(x):
            w13_scales, w2_scales = self.block_scales()
            return fused_moe.fused_moe(x, weights, ids, self.w13_weight, self.w2_weight,
                                       sum_slots=sum_slots, w13_scales=w13_scales,
                                       w2_scales=w2_scales, shared=shared, residual=residual)
        if not sum_slots or shared is not None or residual is not None:
            raise ValueError("BlockFP8FusedExperts: sum_slots=False, shared and residual are "
                             "for the CUDA path only")
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        hit = torch.bincount(ids.flatten(), minlength=self.num_experts).nonzero().flatten()
        for e in hit.tolist():
            token, slot = torch.where(ids == e)
            h = silu_and_mul(F.linear(x[token], self.dequantize_w13(e, x.dtype)))
            h = F.linear(h, self.dequantize_w2(e, x.dtype)) * weights[token, slot, None]
            out.index_add_(0, token, h.float())
        return out.to(x.dtype)

    def leaves(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """tp_invariant mode: this rank's fp32 leaves [local chunks, T, H] of the weighted
        expert sum: the grouped kernels' canonical chunks where the step takes the CUDA
        paths, else the dequantized weights (`invariant.expert_leaves`)."""
        canonical = self.canonical
        if uses_kernels():
            w13_scales, w2_scales = self.block_scales()
            return fused_moe.fused_moe_leaves(x, weights, ids, self.w13_weight, self.w2_weight,
                                              canonical.local_chunks, w13_scales, w2_scales)

        def expert_mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
            w13 = self.dequantize_w13(e, rows.dtype)
            h = silu_and_mul(invariant.column_linear(rows, w13, None, canonical.tile), canonical)
            return invariant.chunk_leaves(h, self.dequantize_w2(e, rows.dtype),
                                          canonical.local_chunks)

        return invariant.expert_leaves(x, weights, ids, self.num_experts, expert_mlp, canonical)

