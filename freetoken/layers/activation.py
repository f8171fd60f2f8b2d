"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.context import uses_kernels
from freetoken.kernels import norm_rope
from freetoken.layers import invariant


def silu_and_mul(x: torch.Tensor, canonical=None) -> torch.Tensor:
    """`silu(gate) * up` for `x = [gate | up]` on the last dim (one Triton launch in steps
    that take the CUDA paths); with `canonical` (the tp_invariant mode) through
    `invariant.pointwise`, whose result per element does not depend on the TP size."""
    if uses_kernels() and x.dim() == 2:
        return norm_rope.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    if canonical is not None:
        return invariant.pointwise(invariant.silu_mul, gate, up)
    return F.silu(gate) * up
