"""Weight-only FP8 per tensor for the parallel linear layers: each checkpoint tensor's rows
are dequantized with that tensor's own 0-d scale, so a fused layer (q | k | v, gate | up,
GDN in_proj_qkv | in_proj_z, Qwen3.5's q|gate from one q_proj) keeps one `weight_scale`
entry per checkpoint tensor. The static `input_scale`s are loaded and checked (finite,
above 0) but unused: activations stay unquantized.

Parameters (TP-local): `weight` float8_e4m3fn [local_out, local_in], `weight_scale` and
`input_scale` float32 [tensors]; the derived buffer `weight_scale_group` (int32 [local_out])
names each row's tensor for the CUDA GEMM (`freetoken.kernels.quant_gemm.fp8_gemm`, the
scale applied once per output)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from freetoken.formats.fp8.block import FP8
from freetoken.kernels import quant_gemm
from freetoken.layers.quantization.weight_only import WeightOnlyMethod, row_index


@dataclass(frozen=True)
class FP8TensorLinear(WeightOnlyMethod):
    """`rows`: the rank-local rows of each output segment; `groups`: the checkpoint tensor
    (index into `weight_scale`) each segment comes from."""

    rows: tuple[int, ...]
    groups: tuple[int, ...]
    input_scales: bool = True
    """Whether the checkpoint stores static input scales (`ModuleFormat.input_scales`:
    ModelOpt always, compressed-tensors with static input activations)."""

    def create_weights(self, layer: nn.Module, local_in: int, local_out: int) -> None:
        """Register the fp8 `weight` and one `weight_scale` / `input_scale` per tensor."""
        count = max(self.groups) + 1
        layer.weight = nn.Parameter(torch.empty(local_out, local_in, dtype=FP8),
                                    requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.empty(count, dtype=torch.float32),
                                          requires_grad=False)
        if self.input_scales:
            layer.input_scale = nn.Parameter(torch.empty(count, dtype=torch.float32),
                                             requires_grad=False)
        row_index(layer, "weight_scale_group", torch.repeat_interleave(
            torch.tensor(self.groups, device="cpu"), torch.tensor(self.rows, device="cpu")))

    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The rank-local weight in `dtype`, each segment times its tensor's scale (through
        the device's row index: no host data, so a CUDA graph can capture it)."""
        per_row = layer.weight_scale[layer.weight_scale_group.long()]
        return (layer.weight.float() * per_row[:, None]).to(dtype)

    fuses = True
    tile_format = "fp8-tensor"

    def kernel(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, **fused
               ) -> torch.Tensor:
        """x [T, local_in] times the weight through `quant_gemm.fp8_gemm`: the scales as a
        one-column block scale, one block spanning every input (`fused`: its tiles,
        norm and residual)."""
        return quant_gemm.fp8_gemm(x, layer.weight, layer.weight_scale.view(-1, 1),
                                   layer.weight_scale_group, layer.weight.shape[1], 0, bias,
                                   tile_format=self.tile_format, **fused)
