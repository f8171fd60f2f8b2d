"""Weight-only NVFP4 for the parallel linear layers (attention, shared expert): the packed
weight is dequantized to the activation dtype and multiplied with unquantized activations,
as Hopper serves NVFP4 checkpoints. Both producers' conventions: ModelOpt's
`weight_scale_2` multiplies, compressed-tensors' `weight_global_scale` divides (inverted
here, per forward, so the shard specs stay bitwise invertible). A fused layer keeps one
global scale per checkpoint tensor (q | k | v, gate | up): producers usually make them
equal, nothing here assumes it.

Parameters (TP-local): `weight` uint8 [local_out, local_in / 2], `weight_scale` e4m3
[local_out, local_in / 16], `weight_scale_2` float32 [tensors]; the derived buffer
`weight_scale_2_group` (int32 [local_out]) names each row's global for the CUDA GEMM
(`freetoken.kernels.quant_gemm.nvfp4_gemm`, the global applied once per output, divided
in-kernel for compressed-tensors). A row-parallel split must fall on a 16-input group
(checked when the layer is built)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from freetoken.formats.nvfp4.format import GROUP, dequantize
from freetoken.kernels import quant_gemm
from freetoken.layers.quantization.weight_only import WeightOnlyMethod, row_index


@dataclass(frozen=True)
class NVFP4Linear(WeightOnlyMethod):
    """`rows`: rank-local rows of each output segment; `groups`: the checkpoint tensor each
    comes from (index into `weight_scale_2`); `reciprocal`: the stored globals divide."""

    rows: tuple[int, ...]
    groups: tuple[int, ...]
    reciprocal: bool = False

    def create_weights(self, layer: nn.Module, local_in: int, local_out: int) -> None:
        """Register the packed `weight`, its block `weight_scale` and the globals."""
        if local_in % GROUP:
            raise ValueError(f"{local_in} NVFP4 inputs per rank are not a whole number of "
                             f"{GROUP}-element groups")
        layer.weight = nn.Parameter(torch.empty(local_out, local_in // 2, dtype=torch.uint8),
                                    requires_grad=False)
        layer.weight_scale = nn.Parameter(
            torch.empty(local_out, local_in // GROUP, dtype=torch.float8_e4m3fn),
            requires_grad=False)
        layer.weight_scale_2 = nn.Parameter(torch.empty(max(self.groups) + 1,
                                                        dtype=torch.float32),
                                            requires_grad=False)
        row_index(layer, "weight_scale_2_group", torch.repeat_interleave(
            torch.tensor(self.groups, device="cpu"), torch.tensor(self.rows, device="cpu")))

    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The rank-local weight in `dtype`, each segment with its tensor's global (through
        the device's row index: no host data, so a CUDA graph can capture it)."""
        g = layer.weight_scale_2.float()
        g = 1.0 / g if self.reciprocal else g
        per_row = g[layer.weight_scale_2_group.long()]
        ones = torch.ones((), dtype=torch.float32, device=g.device)
        values = dequantize(layer.weight, layer.weight_scale, ones, "weight")
        return (values * per_row[:, None]).to(dtype)

    fuses = True
    tile_format = "nvfp4"

    def kernel(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, **fused
               ) -> torch.Tensor:
        """x [T, local_in] times the weight through `quant_gemm.nvfp4_gemm` (`fused`: its
        tiles, norm and residual)."""
        return quant_gemm.nvfp4_gemm(x, layer.weight, layer.weight_scale, layer.weight_scale_2,
                                     layer.weight_scale_2_group, self.reciprocal, bias,
                                     **fused)
