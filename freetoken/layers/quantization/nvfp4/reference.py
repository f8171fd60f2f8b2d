"""Torch reference for NVFP4 layers: dequantize by table lookup, then matmul in float32.

This is both the oracle the Triton kernels are checked against and the torch backend that
serves CPU. It dequantizes only the experts a batch hits, one at a time, so its peak extra
memory is one expert's float32 weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.formats.nvfp4.format import dequantize
from freetoken.layers import invariant


def dequantize_w13(packed: torch.Tensor, block_scale: torch.Tensor,
                   global_scale: torch.Tensor) -> torch.Tensor:
    """One expert's fused gate|up weight [2 * I, H] in float32. `global_scale` [2] holds the
    gate and up `weight_scale_2`, which differ: each half gets its own."""
    inter = packed.shape[0] // 2
    gate = dequantize(packed[:inter], block_scale[:inter], global_scale[0], "w13 gate")
    up = dequantize(packed[inter:], block_scale[inter:], global_scale[1], "w13 up")
    return torch.cat([gate, up])


def reference_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  w13: torch.Tensor, w13_scale: torch.Tensor, w13_global: torch.Tensor,
                  w2: torch.Tensor, w2_scale: torch.Tensor, w2_global: torch.Tensor
                  ) -> torch.Tensor:
    """This rank's routed-expert partial sum for `x` [T, H], in x's dtype, computed in float32.

    w13 [E, 2 * I, H / 2] uint8, w13_scale [E, 2 * I, H / 16] e4m3, w13_global [E, 2] float32
    (gate, up); w2 [E, H, I / 2], w2_scale [E, H, I / 16], w2_global [E]. Rank-dependent
    through the TP-local intermediate size I."""
    xf = x.to(torch.float32)
    out = torch.zeros_like(xf)
    hit = torch.unique(topk_ids.flatten())
    for e in hit.tolist():
        token, slot = torch.where(topk_ids == e)
        gate_up = F.linear(xf[token], dequantize_w13(w13[e], w13_scale[e], w13_global[e]))
        gate, up = gate_up.chunk(2, dim=-1)
        h = F.silu(gate) * up
        down = F.linear(h, dequantize(w2[e], w2_scale[e], w2_global[e], "w2"))
        out.index_add_(0, token, down * topk_weights[token, slot, None].to(torch.float32))
    return out.to(x.dtype)


def reference_moe_leaves(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         w13: torch.Tensor, w13_scale: torch.Tensor, w13_global: torch.Tensor,
                         w2: torch.Tensor, w2_scale: torch.Tensor, w2_global: torch.Tensor,
                         reductions: invariant.CanonicalReductions) -> torch.Tensor:
    """tp_invariant mode: `reference_moe`'s arithmetic as this rank's fp32 leaves
    [local chunks, T, H] (`invariant.expert_leaves`): gate | up in canonical tiles, down in
    canonical chunks of the intermediate dimension. Same tensors as `reference_moe`."""
    xf = x.to(torch.float32)

    def expert_mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = invariant.column_linear(rows, dequantize_w13(w13[e], w13_scale[e],
                                                               w13_global[e]),
                                          None, reductions.tile)
        gate, up = gate_up.chunk(2, dim=-1)
        down = dequantize(w2[e], w2_scale[e], w2_global[e], "w2")
        h = invariant.pointwise(invariant.silu_mul, gate, up)
        return invariant.chunk_leaves(h, down, reductions.local_chunks)

    return invariant.expert_leaves(xf, topk_weights, topk_ids, w13.shape[0], expert_mlp,
                                   reductions)


def reference_linear(x: torch.Tensor, packed: torch.Tensor, block_scale: torch.Tensor,
                     global_scale: torch.Tensor, bias: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """`x W^T (+ b)` for an NVFP4 weight W [N, K], computed in float32, returned in x's
    dtype."""
    w = dequantize(packed, block_scale, global_scale)
    y = F.linear(x.to(torch.float32), w)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)
