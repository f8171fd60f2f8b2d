"""NVFP4 linear for dense layers, `y = x W^T`: the routed-expert down kernels with a single
expert and unit routing weights (one pair per row), so the dense and MoE paths share every
line of dequantization code."""

from __future__ import annotations

import torch

from freetoken.formats.nvfp4.format import check_shapes
from freetoken.kernels import nvfp4_moe


def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, block_scale: torch.Tensor,
                 global_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 path: str = "auto", tiles: nvfp4_moe.Tiles | None = None) -> torch.Tensor:
    """`x` [..., K] times an NVFP4 weight [N, K] (packed [N, K/2], block_scale [N, K/16],
    global_scale scalar), plus `bias`; float32 accumulation, result in x's dtype."""
    k_inputs = check_shapes(packed, block_scale, "nvfp4_linear weight")
    if x.shape[-1] != k_inputs:
        raise ValueError(f"nvfp4_linear: x has {x.shape[-1]} features, the weight "
                         f"{tuple(packed.shape)} takes {k_inputs}")
    lead, n_out = x.shape[:-1], packed.shape[0]
    x2 = x.reshape(-1, k_inputs).contiguous()
    rows = x2.shape[0]
    tiles = tiles or nvfp4_moe.tiles_for(x.device)
    device = x.device
    w, s = packed.unsqueeze(0), block_scale.view(torch.uint8).unsqueeze(0)
    g = global_scale.to(torch.float32).reshape(1).contiguous()
    if path == "auto":
        path = "decode" if rows <= nvfp4_moe.DECODE_MAX_TOKENS else "prefill"
    # With a bias, keep float32 until it is added: one rounding to x's dtype, not two.
    out_dtype = x.dtype if bias is None and path == "decode" else torch.float32
    out = torch.empty(rows, n_out, dtype=out_dtype, device=device)
    if path == "decode" and rows:
        nvfp4_moe.down_decode_launch(x2, w, s, g, out, k_inputs, tiles)
    elif rows:
        ids = torch.zeros(rows, dtype=torch.int32, device=device)
        ones = torch.ones(rows, dtype=torch.float32, device=device)
        order, blocks = nvfp4_moe.align_by_expert(ids, 1, tiles.prefill_m)
        nvfp4_moe.down_prefill_launch(x2, order, blocks, ones, w, s, g, out, rows, k_inputs,
                                      tiles)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype).reshape(*lead, n_out)
