"""Weight-only block FP8 for the parallel linear layers: the e4m3 weight is dequantized to the
activation dtype in the GEMM's place and multiplied with unquantized activations (how an
engine without FP8 activations serves Qwen's FP8 releases, whose dynamic activation scheme
stores no activation scales). A checkpoint with static activations (HF `fp8`
`activation_scheme: static`, compressed-tensors static input activations) stores one scalar
per module: kept as `input_scale` float32 [tensors], checked finite and above 0 at load,
unused by the GEMM.

Parameters of a layer with this method (TP-local): `weight` float8_e4m3fn [local_out,
local_in] and `weight_scale` float32 [scale rows, scale columns], the checkpoint's
`weight_scale_inv` (a multiplier; bf16 values are exact in float32). A fused layer keeps each
segment's own scale rows (q | k | v, gate | up), never one scale for all; each segment's
shard may share its first and last block with the neighbouring rank (see
`freetoken.formats.fp8.specs.BlockScaleSplit`), so each segment records its offset inside
its first block and dequantizes exactly.

On CUDA the GEMM dequantizes in registers (`freetoken.kernels.quant_gemm.fp8_gemm`): the
buffer `weight_scale_row` (int32 [local_out], derived at construction) names each weight
row's scale row, segments and offsets included, and the input split's offset inside its
first column block is the launch's `col_offset`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from freetoken.formats.fp8.block import FP8, dequantize
from freetoken.formats.fp8.specs import BlockScaleSplit
from freetoken.kernels import quant_gemm
from freetoken.layers.quantization.weight_only import WeightOnlyMethod, row_index


@dataclass(frozen=True)
class BlockFP8Linear(WeightOnlyMethod):
    """How one linear layer's rank holds a block-FP8 weight: `rows` the scale split of each
    output segment (its own row block: the format's, or 1 for a scale expanded to one row
    per weight row at load), `cols` of the input dim (`heads=1`: not split), `block` (rows,
    inputs), `tp_rank` / `tp_size` the rank it was built for."""

    block: tuple[int, int]
    rows: tuple[BlockScaleSplit, ...]
    cols: BlockScaleSplit
    tp_rank: int
    tp_size: int
    input_scales: int = 0
    """How many checkpoint tensors' static input scales the layer keeps (0: none stored)."""

    def scale_shape(self) -> tuple[int, int]:
        """The rank-local `weight_scale` shape: every segment's scale rows, stacked."""
        return (sum(r.blocks(self.tp_size) for r in self.rows), self.cols.blocks(self.tp_size))

    def create_weights(self, layer: nn.Module, local_in: int, local_out: int) -> None:
        """Register the layer's fp8 `weight`, float32 `weight_scale` (and `input_scale`, one
        per checkpoint tensor, when stored) and the derived `weight_scale_row` buffer."""
        layer.weight = nn.Parameter(torch.empty(local_out, local_in, dtype=FP8),
                                    requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.empty(self.scale_shape(), dtype=torch.float32),
                                          requires_grad=False)
        if self.input_scales:
            layer.input_scale = nn.Parameter(torch.empty(self.input_scales, dtype=torch.float32),
                                             requires_grad=False)
        row_index(layer, "weight_scale_row", self.scale_rows())

    def scale_rows(self) -> torch.Tensor:
        """The scale row of each rank-local weight row: segment by segment, its first
        scale row plus (its offset inside its first block + row) // its row block."""
        parts, first = [], 0
        for seg in self.rows:
            rows = seg.full_size // _parts(seg, self.tp_size)
            offset = seg.offset(self.tp_rank, self.tp_size)
            parts.append(first + (offset + torch.arange(rows, device="cpu")) // seg.block)
            first += seg.blocks(self.tp_size)
        return torch.cat(parts)

    fuses = True
    tile_format = "fp8-block"

    def kernel(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, **fused
               ) -> torch.Tensor:
        """x [T, local_in] times the weight through `quant_gemm.fp8_gemm` (`fused`: its
        tiles, norm and residual)."""
        return quant_gemm.fp8_gemm(x, layer.weight, layer.weight_scale, layer.weight_scale_row,
                                   self.block[1], self.col_offset(), bias,
                                   tile_format=self.tile_format, **fused)

    def col_offset(self) -> int:
        """The rank's input split's offset inside its first column block."""
        return self.cols.offset(self.tp_rank, self.tp_size)

    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The layer's rank-local weight [local_out, local_in] in `dtype`, segment by
        segment, each with its own scale rows and block offsets."""
        col_offset = self.col_offset()
        parts, row, scale_row = [], 0, 0
        for seg in self.rows:
            rows = seg.full_size // _parts(seg, self.tp_size)
            blocks = seg.blocks(self.tp_size)
            parts.append(dequantize(layer.weight[row:row + rows],
                                    layer.weight_scale[scale_row:scale_row + blocks],
                                    (seg.block, self.block[1]),
                                    (seg.offset(self.tp_rank, self.tp_size), col_offset)))
            row, scale_row = row + rows, scale_row + blocks
        return torch.cat(parts).to(dtype)


def _parts(split: BlockScaleSplit, size: int) -> int:
    """How many chunks the weight dim is cut into (fewer than ranks when replicated)."""
    return split.heads if split.heads is not None and split.heads < size else size
