"""Depthwise causal 1-D convolution with a carried state (GatedDeltaNet's short convolution).

The state of a sequence is its last `kernel - 1` inputs; a sequence that starts in this call
has zeros there, which is exactly HF's left padding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.layers import invariant


class CausalConv1d(nn.Module):
    """`weight` [channels, 1, kernel] as HF's `nn.Conv1d(groups=channels)` stores it; channels
    are rank-local. Output is `silu(conv(x))`. In the tp_invariant mode the convolution is
    written out as `kernel` multiply-adds per output in a fixed order, and the SiLU goes
    through `invariant.pointwise`, so no result depends on how many channels the rank holds."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.channels, self.kernel = channels, kernel
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)
        self.canonical = invariant.active_reductions()

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
        new_state = window[..., window.shape[-1] - (self.kernel - 1):]
        if self.canonical is not None:
            out = self._taps(window.to(torch.float32), length).to(self.weight.dtype)
            # Channels last in memory: a reduction over channels of a transposed view (the
            # per-head l2norm that follows) is vectorised by layout, not by row.
            out = invariant.pointwise(F.silu, out).to(x.dtype).transpose(1, 2).contiguous()
            return out, new_state
        out = F.conv1d(window.to(self.weight.dtype), self.weight, groups=channels)
        return F.silu(out).to(x.dtype).transpose(1, 2), new_state

    def _taps(self, window: torch.Tensor, length: int) -> torch.Tensor:
        """The depthwise convolution as fp32 elementwise multiply-adds, tap 0 first."""
        weight = self.weight.to(torch.float32)
        out = window[..., :length] * weight[:, 0, 0, None]
        for tap in range(1, self.kernel):
            out = out + window[..., tap : tap + length] * weight[:, 0, tap, None]
        return out
