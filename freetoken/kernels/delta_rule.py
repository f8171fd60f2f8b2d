"""Launchers of GatedDeltaNet's decode kernels (`delta_rule_jit`): the conv update and the
gated delta rule's step, checked against `freetoken.layers.causal_conv.CausalConv1d` and
`freetoken.layers.delta_rule.recurrent_gated_delta_rule`, the engine's CPU path."""

from __future__ import annotations

import torch

from freetoken.kernels import jit_module, next_pow2


def _jit():
    """The kernel module, imported on first use (see `freetoken.kernels.jit_module`)."""
    return jit_module("delta_rule_jit")



def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                       b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                       state: torch.Tensor, slots: torch.Tensor,
                       out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One token per sequence: q, k [B, key heads, dk] (after the conv, not yet normalised),
    v [B, value heads, dv], the gate inputs a and b [B, value heads] and the parameters
    A_log and dt_bias [value heads]; `state` [slots, value heads, dk, dv] float32, updated
    in place at `slots` [B]. Returns o [B, value heads, dv] in `out_dtype` (computed in
    float32, rounded once)."""
    batch, value_heads, value_dim = v.shape
    key_dim = q.shape[-1]
    # Views into the projection and conv outputs are read in place when q and k share
    # strides and so do a and b (the kernel takes one stride for each pair).
    if q.stride() != k.stride() or q.stride(-1) != 1:
        q, k = q.contiguous(), k.contiguous()
    if a.stride() != b.stride() or a.stride(-1) != 1:
        a, b = a.contiguous(), b.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    out = torch.empty(batch, value_heads, value_dim, dtype=out_dtype, device=v.device)
    block_v = min(32, next_pow2(value_dim))
    if batch:
        _jit().gated_delta_decode_kernel[(batch, value_heads, -(-value_dim // block_v))](
            q_ptr=q, k_ptr=k, v_ptr=v, a_ptr=a, b_ptr=b, a_log_ptr=a_log,
            dt_bias_ptr=dt_bias, state_ptr=state, slots_ptr=slots, out_ptr=out,
            key_dim=key_dim, value_dim=value_dim, q_scale=key_dim**-0.5,
            stride_qk_seq=q.stride(0), stride_qk_head=q.stride(1),
            stride_v_seq=v.stride(0), stride_v_head=v.stride(1), stride_ab_seq=a.stride(0),
            stride_state_slot=state.stride(0), stride_state_head=state.stride(1),
            stride_state_key=state.stride(2), stride_out_seq=out.stride(0),
            stride_out_head=out.stride(1), GROUP=value_heads // q.shape[1],
            BLOCK_K=next_pow2(key_dim), BLOCK_V=block_v, num_warps=4)
    return out


def conv_update(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
    """One new input per sequence: x [B, C], weight [C, 1, kernel], state [slots, C,
    kernel - 1] updated in place at `slots` [B]. Returns silu(conv) [B, C] in x's dtype."""
    batch, channels = x.shape
    kernel = weight.shape[-1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(batch, channels, dtype=x.dtype, device=x.device)
    block_c = 256
    if batch:
        _jit().conv_update_kernel[(batch, -(-channels // block_c))](
            x_ptr=x, weight_ptr=weight, state_ptr=state, slots_ptr=slots, out_ptr=out,
            channels=channels, stride_x_seq=x.stride(0), stride_state_slot=state.stride(0),
            stride_state_channel=state.stride(1), stride_out_seq=out.stride(0),
            KERNEL=kernel, BLOCK_C=block_c, num_warps=4)
    return out
