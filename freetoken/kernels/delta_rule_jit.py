"""Triton kernel for one decode step of GatedDeltaNet's gated delta rule, the state in
float32, read and written in place at each sequence's state slot:

    S = exp(g) S;  S += k beta (v - S^T k)^T;  o = S^T q

with the step's gating and normalisation folded in, as the torch path computes them:
beta = sigmoid(b) (rounded to b's dtype), g = -exp(A_log) * softplus(a + dt_bias) in
float32, q and k L2-normalised (eps 1e-6 inside the root) and q scaled by dk^-0.5.

Program (sequence, value head, block of BLOCK_V value channels) holds its [dk, BLOCK_V]
slice of the state in registers: one read and one write of the state per step, where the
torch rule passes over it several times. Value head j reads key head j // (value heads /
key heads), so q and k are not repeated per value head.
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels import jit_ops as ops


@triton.jit
def gated_delta_decode_kernel(
    # pointers
    q_ptr,
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    state_ptr,
    slots_ptr,
    out_ptr,
    # sizes
    key_dim,
    value_dim,
    q_scale,
    # strides
    stride_qk_seq,
    stride_qk_head,
    stride_v_seq,
    stride_v_head,
    stride_ab_seq,
    stride_state_slot,
    stride_state_head,
    stride_state_key,
    stride_out_seq,
    stride_out_head,
    # meta
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """o[seq, head, block] and the slot's state slice after one token."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < key_dim, cols < value_dim
    key_head = head // GROUP
    qk = seq * stride_qk_seq + key_head * stride_qk_head + rows
    q = tl.load(q_ptr + qk, mask=row_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + qk, mask=row_ok, other=0.0).to(tl.float32)
    q = q / tl.sqrt(ops.sum_(q * q, axis=0) + 1e-6) * q_scale
    k = k / tl.sqrt(ops.sum_(k * k, axis=0) + 1e-6)
    v = tl.load(v_ptr + seq * stride_v_seq + head * stride_v_head + cols, mask=col_ok,
                other=0.0).to(tl.float32)
    b = tl.load(b_ptr + seq * stride_ab_seq + head)
    beta = ops.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)
    a = tl.load(a_ptr + seq * stride_ab_seq + head).to(tl.float32) + tl.load(
        dt_bias_ptr + head).to(tl.float32)
    # softplus with torch's threshold: x itself above 20.
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
    g = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32)) * softplus
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    s_ptrs = (state_ptr + slot * stride_state_slot + head * stride_state_head
              + rows[:, None] * stride_state_key + cols[None, :])
    mask = row_ok[:, None] & col_ok[None, :]
    state = tl.load(s_ptrs, mask=mask, other=0.0) * tl.exp(g)
    predicted = ops.sum_(state * k[:, None], axis=0)
    state += k[:, None] * ((v - predicted) * beta)[None, :]
    tl.store(s_ptrs, state, mask=mask)
    out = ops.sum_(state * q[:, None], axis=0)
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + cols,
             out.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def conv_update_kernel(
    # pointers
    x_ptr,
    weight_ptr,
    state_ptr,
    slots_ptr,
    out_ptr,
    # sizes
    channels,
    # strides
    stride_x_seq,
    stride_state_slot,
    stride_state_channel,
    stride_out_seq,
    # meta
    KERNEL: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Sequence program_id(0), BLOCK_C channels: the depthwise causal conv of its new input
    over the slot's last KERNEL - 1 inputs, then SiLU (float32, rounded once); the slot's
    state shifts by one input, in place."""
    seq = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = cols < channels
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    state = state_ptr + slot * stride_state_slot + cols * stride_state_channel
    x = tl.load(x_ptr + seq * stride_x_seq + cols, mask=ok, other=0.0)
    acc = x.to(tl.float32) * tl.load(weight_ptr + cols * KERNEL + KERNEL - 1, mask=ok,
                                     other=0.0).to(tl.float32)
    for j in tl.static_range(KERNEL - 1):
        past = tl.load(state + j, mask=ok, other=0.0)
        acc += past.to(tl.float32) * tl.load(weight_ptr + cols * KERNEL + j, mask=ok,
                                             other=0.0).to(tl.float32)
        if j > 0:
            tl.store(state + j - 1, past, mask=ok)
    tl.store(state + KERNEL - 2, x.to(state_ptr.dtype.element_ty), mask=ok)
    out = acc * ops.sigmoid(acc)
    tl.store(out_ptr + seq * stride_out_seq + cols, out.to(out_ptr.dtype.element_ty), mask=ok)
