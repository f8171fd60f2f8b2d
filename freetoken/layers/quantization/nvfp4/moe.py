"""NVFP4 routed experts: the drop-in for `FusedExperts` when a checkpoint stores its experts
in NVFP4 (W4A16: weights stay 4-bit, activations keep the model's dtype)."""

from __future__ import annotations

import torch
from torch import nn

from freetoken.context import uses_kernels
from freetoken.distributed import get_tp_info
from freetoken.formats.nvfp4.format import GROUP, dequantize
from freetoken.formats.nvfp4.specs import local_inputs
from freetoken.kernels import fused_moe
from freetoken.layers import invariant
from freetoken.layers.layout import GATE_UP, LocalRows
from freetoken.layers.quantization.nvfp4.backend import TRITON, choose_backend
from freetoken.layers.quantization.nvfp4.linear import NVFP4Linear
from freetoken.layers.quantization.nvfp4.reference import reference_moe, reference_moe_leaves


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class NVFP4FusedExperts(nn.Module):
    """All experts of one layer in NVFP4, split on the intermediate dimension like
    `FusedExperts`; `forward(x, topk_weights, topk_ids)` returns this rank's partial sum.

    Parameters (normalised ModelOpt fields, I = TP-local intermediate size):
    `w13_weight` uint8 [E, 2I, H/2] (gate rows, then up rows), `w13_weight_scale` e4m3
    [E, 2I, H/16], `w13_weight_scale_2` float32 [E, 2] (gate and up carry different global
    scales); `w2_weight` uint8 [E, H, I/2], `w2_weight_scale` e4m3 [E, H, I/16],
    `w2_weight_scale_2` float32 [E]. With `global_scale_is_reciprocal` (compressed-tensors)
    the stored global scales divide; they are inverted per forward, which keeps the shard
    specs bitwise invertible. `backend`: auto, triton or torch (see `choose_backend`).
    """

    def __init__(self, num_experts: int, hidden: int, full_intermediate: int,
                 backend: str = "auto", global_scale_is_reciprocal: bool = False):
        super().__init__()
        if hidden % GROUP:
            raise ValueError(f"hidden_size={hidden} is not a multiple of the {GROUP}-element "
                             "NVFP4 group")
        self.num_experts, self.hidden = num_experts, hidden
        rows = self.layout(full_intermediate, get_tp_info().size)
        self.local_intermediate = i = rows.size("gate")
        self.backend = backend
        self.global_scale_is_reciprocal = global_scale_is_reciprocal
        e, fp8 = num_experts, torch.float8_e4m3fn
        self.w13_weight = _param(e, rows.total, hidden // 2, dtype=torch.uint8)
        self.w13_weight_scale = _param(e, rows.total, hidden // GROUP, dtype=fp8)
        self.w13_weight_scale_2 = _param(e, 2, dtype=torch.float32)
        self.w2_weight = _param(e, hidden, i // 2, dtype=torch.uint8)
        self.w2_weight_scale = _param(e, hidden, i // GROUP, dtype=fp8)
        self.w2_weight_scale_2 = _param(e, dtype=torch.float32)
        self.canonical = invariant.active_reductions()

    @staticmethod
    def layout(full_intermediate: int, tp: int) -> LocalRows:
        """Each expert's w13 `[gate | up]` rows at `tp` ranks (w2's inputs are one of them):
        ShardError unless every rank's share is whole 16-element groups."""
        i = local_inputs(full_intermediate, tp, "moe_intermediate_size")
        return LocalRows(GATE_UP, (i, i))

    def global_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2], w2 [E]) global scales as multipliers, float32."""
        g13, g2 = self.w13_weight_scale_2.float(), self.w2_weight_scale_2.float()
        if self.global_scale_is_reciprocal:
            return 1.0 / g13, 1.0 / g2
        return g13, g2

    def backend_for(self, x: torch.Tensor):
        """The backend serving `x` (its device and dtype) and why."""
        return choose_backend(x.device, x.dtype, self.hidden, self.local_intermediate,
                              self.backend)

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        g13, g2 = self.global_scales()
        return (self.w13_weight, self.w13_weight_scale, g13, self.w2_weight,
                self.w2_weight_scale, g2)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every expert's weights in float32: w13 [E, 2I, H] (gate and up each with its own
        global scale) and w2 [E, H, I]."""
        w13, s13, g13, w2, s2, g2 = self._tensors()
        i = self.local_intermediate
        gate = dequantize(w13[:, :i], s13[:, :i], g13[:, 0], "w13 gate")
        up = dequantize(w13[:, i:], s13[:, i:], g13[:, 1], "w13 up")
        return torch.cat([gate, up], dim=1), dequantize(w2, s2, g2, "w2")

    def leaves(self, x: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor) -> torch.Tensor:
        """tp_invariant mode: this rank's fp32 leaves [local chunks, T, H] of the routed
        sum, computed in float32 on the dequantized experts: by the grouped kernels'
        canonical chunks where the step takes the CUDA paths (the NVFP4 kernels' tiling
        follows the TP-local shape, so they are not TP-invariant), else by the torch
        reference."""
        if uses_kernels():
            return fused_moe.fused_moe_leaves(x.to(torch.float32), topk_weights, topk_ids,
                                              *self.dequantized(), self.canonical.local_chunks)
        return reference_moe_leaves(x, topk_weights, topk_ids, *self._tensors(),
                                    self.canonical)

    def combines(self, x: torch.Tensor) -> bool:
        """Never: `forward` sums the slots itself (the MoE block combines that sum with its
        gated shared expert, unless `shared_slot` gives the shared expert to `forward`)."""
        return False

    def shared_slot(self, x: torch.Tensor, gate_up: nn.Module, down: nn.Module,
                    gate: nn.Module):
        """The MoE block's shared expert (`gate_up`, `down`) and its sigmoid `gate` as one
        more slot of every token of x (`nvfp4_mma_launch.SharedSlot`), where the tensor-core
        decode serves x (`nvfp4_moe.takes_shared`) and the shared expert is NVFP4 of the
        routed experts' TP-local shapes without biases, its globals of one convention, and
        the gate x's dtype and unquantized (`nvfp4_moe.shared_mismatch`); else None (the
        block combines it apart)."""
        from freetoken.kernels import nvfp4_moe
        from freetoken.kernels.nvfp4_mma_launch import SharedSlot

        if not fused_moe.SHARED_IN_ROWS or self.backend_for(x).name != TRITON or \
                not nvfp4_moe.takes_shared(x):
            return None
        up_q, down_q = gate_up.quant, down.quant
        if not (isinstance(up_q, NVFP4Linear) and isinstance(down_q, NVFP4Linear)) or \
                up_q.reciprocal != down_q.reciprocal or \
                up_q.rows != (self.local_intermediate,) * 2 or \
                any(lin.bias is not None for lin in (gate_up, down, gate)) or \
                gate.quant is not None:
            return None
        slot = SharedSlot(gate_up.weight, gate_up.weight_scale, gate_up.weight_scale_2,
                          up_q.groups[0], up_q.groups[1], down.weight, down.weight_scale,
                          down.weight_scale_2[down_q.groups[0]:], gate.weight.reshape(-1),
                          up_q.reciprocal)
        routed = dict(w13=self.w13_weight, w13_scale=self.w13_weight_scale,
                      w2=self.w2_weight, w2_scale=self.w2_weight_scale)
        return None if nvfp4_moe.shared_mismatch(x, routed, slot) else slot

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                shared=None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's routed sum for x; with `shared` (a `shared_slot`) plus the gated
        shared expert's partial sum, and then `residual` where given."""
        if self.backend_for(x).name == TRITON:
            from freetoken.kernels import nvfp4_moe

            # the stored globals as they are: inverted where the kernels read them
            return nvfp4_moe.fused_moe(
                x, topk_weights, topk_ids, self.w13_weight, self.w13_weight_scale,
                self.w13_weight_scale_2.float(), self.w2_weight, self.w2_weight_scale,
                self.w2_weight_scale_2.float(), shared=shared, residual=residual,
                reciprocal=self.global_scale_is_reciprocal)
        args = self._tensors()
        if shared is not None or residual is not None:
            raise ValueError("NVFP4FusedExperts: a shared slot or residual needs the triton "
                             "backend's tensor-core decode")
        return reference_moe(x, topk_weights, topk_ids, *args)
