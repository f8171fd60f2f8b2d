"""RMSNorm as HF computes it: statistics in fp32, weight applied in the input dtype."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """`w * (x * rsqrt(mean(x^2) + eps))`; with `offset=True` the weight is `1 + w`
    (Gemma-style, applied in fp32)."""

    def __init__(self, hidden: int, eps: float = 1e-6, offset: bool = False):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)
