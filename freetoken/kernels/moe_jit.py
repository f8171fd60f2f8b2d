"""Triton kernels for routed experts with 16-bit (or float32) weights: a grouped GEMM over
(token, slot) pairs sorted by expert into blocks of BLOCK_M (`freetoken.kernels.moe_align`),
pair p = token * top_k + slot. Products accumulate in float32.

- `gate_up_kernel`: program (block, columns) computes a tile of gate and the matching tile of
  up for its block's pairs and writes h = SiLU(gate) * up, rounded once to h's dtype.
- `down_kernel`: program (block, columns) computes a tile of h W_down^T for its block's
  pairs, times each pair's routing weight, and writes it in float32 (the launcher sums each
  token's slots in float32 and rounds once, as the torch reference does).
Blocks whose expert is -1 (the unused tail of the upper-bound grid) return at once.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gate_up_kernel(
    # pointers
    x_ptr,
    w13_ptr,
    h_ptr,
    rows_ptr,
    block_expert_ptr,
    # sizes
    num_pairs,
    hidden,
    inter,
    top_k,
    # strides
    stride_x_token,
    stride_w13_expert,
    stride_w13_row,
    stride_h_pair,
    # meta
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """h[pair, n] = silu(x[token] . w13[e, n]) * (x[token] . w13[e, inter + n]) for the
    BLOCK_M pairs of block program_id(0) and BLOCK_N columns n of program_id(1)."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    pairs = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    token = (pairs // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w = w13_ptr + expert.to(tl.int64) * stride_w13_expert
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + token[:, None] * stride_x_token + ks[None, :],
                    mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w + cols[None, :] * stride_w13_row + ks[:, None], mask=w_mask,
                         other=0.0)
        w_up = tl.load(w + (cols + inter)[None, :] * stride_w13_row + ks[:, None], mask=w_mask,
                       other=0.0)
        gate = tl.dot(a, w_gate, gate, input_precision=PRECISION)
        up = tl.dot(a, w_up, up, input_precision=PRECISION)
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + pairs.to(tl.int64)[:, None] * stride_h_pair + cols[None, :],
             h.to(h_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


@triton.jit
def down_kernel(
    # pointers
    h_ptr,
    w2_ptr,
    weights_ptr,
    out_ptr,
    rows_ptr,
    block_expert_ptr,
    # sizes
    num_pairs,
    hidden,
    inter,
    # strides
    stride_h_pair,
    stride_w2_expert,
    stride_w2_row,
    stride_out_pair,
    # meta
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out[pair, n] = weight[pair] * (h[pair] . w2[e, n]) in float32 for the BLOCK_M pairs of
    block program_id(0) and BLOCK_N output columns n of program_id(1)."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    pairs = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair_ok = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w = w2_ptr + expert.to(tl.int64) * stride_w2_expert
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(h_ptr + pairs[:, None] * stride_h_pair + ks[None, :],
                    mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w + cols[None, :] * stride_w2_row + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    weight = tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + pairs[:, None] * stride_out_pair + cols[None, :], acc * weight[:, None],
             mask=pair_ok[:, None] & col_ok[None, :])
