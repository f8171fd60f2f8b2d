"""Triton kernel for one decode step of the gated delta rule (GatedDeltaNet), the state in
float32, read and written in place at each sequence's state slot:

    S = exp(g) S;  S += k beta (v - S^T k)^T;  o = S^T q

Program (sequence, value head, block of BLOCK_V value channels) holds its [dk, BLOCK_V]
slice of the state in registers: one read and one write of the state per step, where the
torch rule passes over it several times. Value head j reads key head j // (value heads /
key heads), so q and k are not repeated per value head.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gated_delta_decode_kernel(
    # pointers
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    slots_ptr,
    out_ptr,
    # sizes
    key_dim,
    value_dim,
    # strides
    stride_qk_seq,
    stride_qk_head,
    stride_v_seq,
    stride_v_head,
    stride_gb_seq,
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
    v = tl.load(v_ptr + seq * stride_v_seq + head * stride_v_head + cols, mask=col_ok,
                other=0.0).to(tl.float32)
    g = tl.load(g_ptr + seq * stride_gb_seq + head).to(tl.float32)
    beta = tl.load(beta_ptr + seq * stride_gb_seq + head).to(tl.float32)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    s_ptrs = (state_ptr + slot * stride_state_slot + head * stride_state_head
              + rows[:, None] * stride_state_key + cols[None, :])
    mask = row_ok[:, None] & col_ok[None, :]
    state = tl.load(s_ptrs, mask=mask, other=0.0) * tl.exp(g)
    predicted = tl.sum(state * k[:, None], axis=0)
    state += k[:, None] * ((v - predicted) * beta)[None, :]
    tl.store(s_ptrs, state, mask=mask)
    out = tl.sum(state * q[:, None], axis=0)
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + cols, out, mask=col_ok)
