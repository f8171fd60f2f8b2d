"""RMSNorm as HF computes it: statistics in fp32, weight applied in the input dtype (one
Triton launch in steps that take the CUDA paths)."""

from __future__ import annotations

import torch
from torch import nn

from freetoken.context import uses_kernels
from freetoken.kernels import norm_rope


class RMSNorm(nn.Module):
    """`w * (x * rsqrt(mean(x^2) + eps))`; with `offset=True` the weight is `1 + w`
    (Gemma-style, applied in fp32)."""

    def __init__(self, hidden: int, eps: float = 1e-6, offset: bool = False):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if uses_kernels():
            return norm_rope.rms_norm(x, self.weight, self.eps, self.offset)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)
