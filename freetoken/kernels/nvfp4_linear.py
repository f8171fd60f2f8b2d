"""NVFP4 linear for dense layers, `y = x W^T`: the routed-expert down kernels with a single
expert and unit routing weights (one pair per row), so the dense and MoE paths share every
line of dequantization code."""

from __future__ import annotations

import torch

from freetoken.formats.nvfp4.format import check_shapes
from freetoken.kernels import nvfp4_launch, nvfp4_mma_launch
from freetoken.kernels.moe_align import align_pairs

COLUMNS = False
"""True: a decode call of several 16-bit tokens on the mma kernels takes them as the mma's
columns (`nvfp4_mma_launch.dense_mma_launch`: each weight tile read once per eight
tokens); False: down with one slot per token (each token reads the whole weight). Off until
timed on a GPU (docs/performance.md, 2026-12-08: the LM head at 16 tokens is the step's
largest kernel)."""


def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, block_scale: torch.Tensor,
                 global_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 path: str = "auto", tiles: nvfp4_launch.Tiles | None = None) -> torch.Tensor:
    """`x` [..., K] times an NVFP4 weight [N, K] (packed [N, K/2], block_scale [N, K/16],
    global_scale scalar), plus `bias`; float32 accumulation, result in x's dtype."""
    k_inputs = check_shapes(packed, block_scale, "nvfp4_linear weight")
    if x.shape[-1] != k_inputs:
        raise ValueError(f"nvfp4_linear: x has {x.shape[-1]} features, the weight "
                         f"{tuple(packed.shape)} takes {k_inputs}")
    lead, n_out = x.shape[:-1], packed.shape[0]
    x2 = x.reshape(-1, k_inputs).contiguous()
    rows = x2.shape[0]
    tiles = tiles or nvfp4_launch.tiles_for(x.device)
    device = x.device
    w, s = packed.unsqueeze(0), block_scale.view(torch.uint8).unsqueeze(0)
    g = global_scale.to(torch.float32).reshape(1).contiguous()
    if path == "auto":
        path = "decode" if rows <= nvfp4_launch.DECODE_MAX_TOKENS else "prefill"
    # With a bias, keep float32 until it is added: one rounding to x's dtype, not two.
    out_dtype = x.dtype if bias is None and path == "decode" else torch.float32
    out = torch.empty(rows, n_out, dtype=out_dtype, device=device)
    if path == "decode" and rows:
        _decode(x2, w, s, g, out, k_inputs, tiles)
    elif rows:
        ids = torch.zeros(rows, dtype=torch.int32, device=device)
        ones = torch.ones(rows, dtype=torch.float32, device=device)
        sorted_pairs, block_expert = align_pairs(ids, 1, tiles.prefill_m)
        nvfp4_launch.down_prefill_launch(x2, sorted_pairs, block_expert, ones, w, s, g, out,
                                         num_pairs=rows, k_inputs=k_inputs, tiles=tiles)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype).reshape(*lead, n_out)


def _decode(x, w, s, g, out, k_inputs, tiles):
    """out = g * (w[0] @ x[:, :k_inputs].T).T (one expert: w [1, rows, k_inputs / 2], s its
    block scales, g [1] its global scale); `out` [T, rows] in any float dtype. 16-bit
    activations on a GPU take the mma kernels (`down_mma` with one slot per token on x in
    place, its sums times g; several tokens as the mma's columns with COLUMNS), others the
    CUDA-core ones."""
    if nvfp4_launch.uses_mma(x, tiles) and COLUMNS and x.shape[0] > 1:
        nvfp4_mma_launch.dense_mma_launch(x, w, s, out, k_inputs, tiles, out_scale=g)
        return
    ids = torch.zeros(x.shape[0], dtype=torch.int32, device=x.device)
    if nvfp4_launch.uses_mma(x, tiles):
        nvfp4_mma_launch.down_mma_launch(x, ids, w, s, out, k_inputs=k_inputs, top_k=1,
                                         tiles=tiles, out_scale=g)
        return
    xw, stride_x_nibble = nvfp4_launch.word_order(x, k_inputs, scale=g)
    nvfp4_launch.down_decode_launch(xw, stride_x_nibble, ids, w, s, out, k_inputs=k_inputs,
                                    top_k=1, tiles=tiles)
