"""Launchers of `norm_rope_jit`: RMSNorm and rotary embedding in one launch each, for the
engine's CUDA path (its CPU path, `freetoken.layers.norm` and `freetoken.layers.rotary`, is
the reference they are checked against)."""

from __future__ import annotations

import importlib

import torch


def _jit():
    """The kernel module, imported on first use (see `freetoken.kernels.use_interpreter`)."""
    return importlib.import_module("freetoken.kernels.norm_rope_jit")


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [tokens, heads, channels] with unit channel stride (a view where possible)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.unsqueeze(1) if x.dim() == 2 else x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """RMSNorm over the last dim of x ([tokens, N] or [tokens, heads, N]); a new tensor of
    x's shape and dtype. `offset`: the weight is `1 + w` (applied in float32)."""
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    tokens, heads, channels = rows.shape
    if tokens:
        _jit().rms_norm_kernel[(tokens, heads)](
            x_ptr=rows, weight_ptr=weight, out_ptr=out, channels=channels, eps=eps,
            stride_x_token=rows.stride(0), stride_x_head=rows.stride(1),
            stride_out_token=out.stride(0), stride_out_head=out.stride(1),
            OFFSET=offset, BLOCK_N=_pow2(channels), num_warps=4 if channels >= 1024 else 1)
    return out.view(x.shape)


def rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
            inv_freq: torch.Tensor, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first `rotary_dim` channels of q [tokens, q_heads, d] and k
    [tokens, k_heads, d] in place (rotate-half); returns them."""
    tokens = q.shape[0]
    if tokens:
        half = rotary_dim // 2
        _jit().rotary_kernel[(tokens,)](
            q_ptr=q, k_ptr=k, positions_ptr=positions, inv_freq_ptr=inv_freq,
            q_heads=q.shape[1], k_heads=k.shape[1],
            stride_q_token=q.stride(0), stride_q_head=q.stride(1),
            stride_k_token=k.stride(0), stride_k_head=k.stride(1),
            HALF=half, BLOCK_HALF=_pow2(half), BLOCK_QH=_pow2(q.shape[1]),
            BLOCK_KH=_pow2(k.shape[1]), num_warps=1)
    return q, k
