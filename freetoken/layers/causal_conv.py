"""Depthwise causal 1-D convolution with a carried state (GatedDeltaNet's short convolution).

The state of a sequence is its last `kernel - 1` inputs; a sequence that starts in this call
has zeros there, which is exactly HF's left padding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CausalConv1d(nn.Module):
    """`weight` [channels, 1, kernel] as HF's `nn.Conv1d(groups=channels)` stores it; channels
    are rank-local. Output is `silu(conv(x))`."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.channels, self.kernel = channels, kernel
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)

    def state_shape(self) -> tuple[int, int]:
        return self.channels, self.kernel - 1

    def forward(self, x: torch.Tensor, state: torch.Tensor | None):
        """x: [B, T, C] new inputs; state: [B, C, kernel - 1] or None (sequences start here).
        Returns (out [B, T, C], new state [B, C, kernel - 1])."""
        batch, length, channels = x.shape
        x = x.transpose(1, 2)
        if state is None:
            state = x.new_zeros(batch, channels, self.kernel - 1)
        window = torch.cat([state.to(x.dtype), x], dim=-1)
        out = F.conv1d(window.to(self.weight.dtype), self.weight, groups=channels)
        new_state = window[..., window.shape[-1] - (self.kernel - 1):]
        return F.silu(out).to(x.dtype).transpose(1, 2), new_state
