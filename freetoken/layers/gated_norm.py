"""The gated RMSNorm at the output of GatedDeltaNet (HF's Qwen3_5MoeRMSNormGated)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.context import uses_kernels
from freetoken.kernels import norm_rope
from freetoken.layers import invariant


class GatedRMSNorm(nn.Module):
    """`w * rms_norm(x) * silu(z)` over the last dim. Unlike Qwen3.5's decoder norms the
    weight is used directly (no `1 + w`); statistics and the gate in fp32."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden), requires_grad=False)
        self.canonical = invariant.active_reductions()

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if uses_kernels() and x.dim() == 3:
            return norm_rope.gated_rms_norm(x, gate, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * invariant.elementwise(self.canonical, F.silu, gate.float())).to(dtype)
