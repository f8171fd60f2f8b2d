"""NVFP4 linear layers for dense weights a checkpoint quantizes (W4A16), with the same TP
split as the unquantized ones: replicated, column-parallel (output rows split) or
row-parallel (inputs split on 16-element groups, partial outputs all-reduced)."""

from __future__ import annotations

import torch
from torch import nn

from freetoken.distributed import divide, get_communicator, get_tp_info
from freetoken.formats.nvfp4.format import GROUP
from freetoken.formats.nvfp4.specs import local_inputs
from freetoken.layers.quantization.nvfp4.backend import TRITON, choose_backend
from freetoken.layers.quantization.nvfp4.reference import reference_linear

MODES = ("replicated", "column", "row")


class NVFP4Linear(nn.Module):
    """`y = x W^T (+ b)` with an NVFP4 weight: `weight` uint8 [local_out, local_in / 2],
    `weight_scale` e4m3 [local_out, local_in / 16], `weight_scale_2` float32 scalar.

    `mode`: replicated (every rank holds W), column (output rows split; output stays
    rank-local), row (inputs split; the partial outputs are all-reduced unless
    `reduce=False`). A bias is added after the all-reduce, once."""

    def __init__(self, full_in: int, full_out: int, mode: str = "replicated",
                 bias: bool = False, backend: str = "auto", reduce: bool = True,
                 global_scale_is_reciprocal: bool = False):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"NVFP4Linear mode must be one of {', '.join(MODES)}, got {mode!r}")
        size = get_tp_info().size
        self.mode, self.reduce, self.backend = mode, reduce and mode == "row", backend
        self.global_scale_is_reciprocal = global_scale_is_reciprocal
        self.local_out = divide(full_out, size, "out_features") if mode == "column" else full_out
        self.local_in = local_inputs(full_in, size, "in_features") if mode == "row" else full_in
        if self.local_in % GROUP:
            raise ValueError(f"in_features={full_in} is not a multiple of the {GROUP}-element "
                             "NVFP4 group")
        self.weight = nn.Parameter(torch.empty(self.local_out, self.local_in // 2,
                                               dtype=torch.uint8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(self.local_out, self.local_in // GROUP,
                                                     dtype=torch.float8_e4m3fn),
                                         requires_grad=False)
        self.weight_scale_2 = nn.Parameter(torch.empty((), dtype=torch.float32),
                                           requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.local_out), requires_grad=False) if bias \
            else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.weight_scale_2.float()
        g = 1.0 / g if self.global_scale_is_reciprocal else g
        choice = choose_backend(x.device, x.dtype, self.local_in, None, self.backend)
        if choice.name == TRITON:
            from freetoken.kernels.nvfp4_linear import nvfp4_linear

            y = nvfp4_linear(x, self.weight, self.weight_scale, g)
        else:
            y = reference_linear(x, self.weight, self.weight_scale, g)
        if self.reduce:
            y = get_communicator().all_reduce(y)
        return y + self.bias.to(y.dtype) if self.bias is not None else y
