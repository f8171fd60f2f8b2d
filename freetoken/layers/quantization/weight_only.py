"""What the weight-only linear methods share: `apply`, the layer's `x W^T + b` through the
method's Triton GEMM on CUDA (`freetoken.kernels.quant_gemm`; FREETOKEN_QUANT_KERNELS=0
turns it off), else through the method's dequantized weight and `F.linear` (the CPU path,
and the reference the kernels are checked against)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.kernels import quant_gemm


class WeightOnlyMethod:
    """A quantization method whose `dequantize(layer, dtype)` gives the rank-local weight
    and whose `kernel(layer, x, bias)` computes the GEMM from the stored tensors (x 2-D,
    contiguous rows)."""

    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def kernel(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, **fused
               ) -> torch.Tensor:
        raise NotImplementedError

    fuses = False
    """Whether `kernel` takes the row kernels' decode fusions (`norm`, `normed`, `gated`,
    `residual` keywords of `quant_gemm.fp8_gemm` and `quant_gemm.nvfp4_gemm`) and their
    `tiles`."""
    tile_format = "fp8"
    """The tile table's format of `kernel`'s calls (`quant_gemm.tiles_for`: its own entries
    before its kind's)."""

    def apply_fused(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None,
                    **fused) -> torch.Tensor | None:
        """`apply` with the decode step's fusions in the same launch (`norm`: a
        `gemv.Norm` applied to x first, `normed`: where to store norm(x), `gated`: a
        [gate | up] weight's `silu(gate) * up`, `residual`: added to the result), or None
        where this call cannot take them (a method without them, no kernels, a call off
        the row kernel: more than a token or two; a norm while `quant_gemm.DECODE_NORM` is
        off), for the caller's unfused steps."""
        if not (self.fuses and quant_gemm.DECODE_FUSIONS and quant_gemm.serves(x)
                and x.dim() == 2 and x.stride(-1) == 1):
            return None
        if fused.get("norm") is not None and not quant_gemm.DECODE_NORM:
            return None
        tiles = quant_gemm.fusing_tiles(x.shape[0], layer.weight.shape[0], x.shape[1],
                                        self.tile_format, fused.get("norm") is not None)
        if tiles is None:
            return None
        return self.kernel(layer, x, bias, tiles=tiles, **fused)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
        """`F.linear(x, W, bias)` for x [..., local_in] with the layer's quantized W."""
        if not quant_gemm.serves(x):
            return F.linear(x, self.dequantize(layer, x.dtype), bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        return self.kernel(layer, x2, bias).reshape(*lead, -1)


def row_index(layer: nn.Module, name: str, values: torch.Tensor) -> None:
    """Register `values` (one per local weight row) as the layer's int32 buffer `name`: which
    scale row or global each row reads, derived from the method, never loaded (so not a
    parameter, and not in the state dict)."""
    layer.register_buffer(name, values.to(device=torch.get_default_device(),
                                          dtype=torch.int32), persistent=False)
