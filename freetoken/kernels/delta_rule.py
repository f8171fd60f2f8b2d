"""Launcher of the gated delta rule's decode step (`delta_rule_jit`), checked against
`freetoken.layers.delta_rule.recurrent_gated_delta_rule`, the engine's CPU path."""

from __future__ import annotations

import importlib

import torch


def _jit():
    """The kernel module, imported on first use (see `freetoken.kernels.use_interpreter`)."""
    return importlib.import_module("freetoken.kernels.delta_rule_jit")


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor
                       ) -> torch.Tensor:
    """One token per sequence: q, k [B, key heads, dk] (normalised, q scaled), v [B, value
    heads, dv], g and beta [B, value heads]; `state` [slots, value heads, dk, dv] float32,
    updated in place at `slots` [B]. Returns o [B, value heads, dv] float32."""
    batch, value_heads, value_dim = v.shape
    key_dim = q.shape[-1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.contiguous(), beta.contiguous()
    out = torch.empty(batch, value_heads, value_dim, dtype=torch.float32, device=v.device)
    block_v = min(32, _pow2(value_dim))
    if batch:
        _jit().gated_delta_decode_kernel[(batch, value_heads, -(-value_dim // block_v))](
            q_ptr=q, k_ptr=k, v_ptr=v, g_ptr=g, beta_ptr=beta, state_ptr=state,
            slots_ptr=slots, out_ptr=out, key_dim=key_dim, value_dim=value_dim,
            stride_qk_seq=q.stride(0), stride_qk_head=q.stride(1),
            stride_v_seq=v.stride(0), stride_v_head=v.stride(1), stride_gb_seq=g.stride(0),
            stride_state_slot=state.stride(0), stride_state_head=state.stride(1),
            stride_state_key=state.stride(2), stride_out_seq=out.stride(0),
            stride_out_head=out.stride(1), GROUP=value_heads // q.shape[1],
            BLOCK_K=_pow2(key_dim), BLOCK_V=block_v, num_warps=4)
    return out
