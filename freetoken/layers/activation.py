"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.context import uses_kernels
from freetoken.kernels import norm_rope


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `x = [gate | up]` on the last dim (one Triton launch in steps
    that take the CUDA paths)."""
    if uses_kernels() and x.dim() == 2:
        return norm_rope.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
