"""NVFP4 prefill kernels (many tokens): (token, slot) pairs sorted by expert into blocks of
BLOCK_M rows (`freetoken.kernels.moe_align.align_by_expert`), tensor-core `tl.dot` on weight
tiles dequantized in registers. The launchers are in `freetoken.kernels.nvfp4_launch`.

Tiles are dequantized with the bit arithmetic of `nvfp4_dequant_jit`, in float32 (Triton's
interpreter mis-computes bf16 arithmetic), and cast to the activations' dtype for `tl.dot`
(exact: e2m1 * e4m3 has at most 6 significant bits). A dense NVFP4 linear is `down_prefill`
with one expert and unit routing weights.
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels.nvfp4_dequant_jit import FP4_UNBIAS, e4m3, fp4_word, silu_mul


@triton.jit
def _load_tile(w_ptr, w_scale_ptr, rows, rows_ok, groups, groups_ok, stride_w_row,
               stride_scale_row):
    """Bytes [rows, groups, 8] (int32) and block scales [rows, groups] (float32) of weight
    `rows` for K-groups `groups` (16 inputs = 8 bytes each)."""
    byte = groups[:, None] * 8 + tl.arange(0, 8)[None, :]
    mask = rows_ok[:, None, None] & groups_ok[None, :, None]
    b = tl.load(w_ptr + rows[:, None, None] * stride_w_row + byte[None, :, :], mask=mask,
                other=0)
    s_mask = rows_ok[:, None] & groups_ok[None, :]
    s = tl.load(w_scale_ptr + rows[:, None] * stride_scale_row + groups[None, :], mask=s_mask,
                other=0)
    return b.to(tl.int32), e4m3(s.to(tl.int32))


@triton.jit
def _dequant_tiles(w_ptr, w_scale_ptr, rows, rows_ok, groups, groups_ok, stride_w_row,
                   stride_scale_row, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                   dtype: tl.constexpr):
    """True weight values (without the global scale) of the even and odd inputs,
    [rows, 8 * groups] each in `dtype`. e2m1 * e4m3 has at most 6 significant bits, so the
    cast to bf16 is exact."""
    b, s = _load_tile(w_ptr, w_scale_ptr, rows=rows, rows_ok=rows_ok, groups=groups,
                      groups_ok=groups_ok, stride_w_row=stride_w_row,
                      stride_scale_row=stride_scale_row)
    s = (s * FP4_UNBIAS)[:, :, None]
    low = tl.reshape(fp4_word(b, 0) * s, (BLOCK_N, 8 * GROUPS))
    high = tl.reshape(fp4_word(b, 4) * s, (BLOCK_N, 8 * GROUPS))
    return low.to(dtype), high.to(dtype)


@triton.jit
def _sorted_block(block_expert_ptr, sorted_pairs_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """This program's block of the expert-sorted layout: its expert (-1: unused block), its
    sorted rows, the pair each holds and which hold one."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    sorted_rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + sorted_rows)
    return expert, sorted_rows, pair, pair < num_pairs


@triton.jit
def _x_cols(x_ptr, rows, rows_ok, first_group, k_groups, stride_x_row, GROUPS: tl.constexpr):
    """Even and odd inputs of activation `rows` for K-groups first_group.., transposed:
    [8 * groups, rows] each, in the activations' dtype (the tensor-core operand)."""
    byte = first_group * 8 + tl.arange(0, 8 * GROUPS)
    mask = (byte < k_groups * 8)[:, None] & rows_ok[None, :]
    ptr = x_ptr + rows[None, :] * stride_x_row + 2 * byte[:, None]
    return tl.load(ptr, mask=mask, other=0.0), tl.load(ptr + 1, mask=mask, other=0.0)


@triton.jit
def gate_up_prefill(
    # pointers
    x_ptr,                   # [tokens, hidden] activations
    sorted_pairs_ptr,        # [sorted rows] pair held by each sorted row (num_pairs: none)
    block_expert_ptr,        # [blocks] expert of each block of BLOCK_M sorted rows (-1: none)
    w_ptr,                   # [experts, 2 * intermediate, hidden / 2] bytes (gate, up rows)
    w_scale_ptr,             # [experts, 2 * intermediate, hidden / 16] e4m3 bytes
    gate_up_global_ptr,      # [experts, 2] float32 (gate, up)
    h_ptr,                   # [sorted rows, intermediate] (out), in sorted order
    # sizes
    num_pairs,
    intermediate,
    k_groups,                # 16-input groups of a row
    top_k,
    # strides (w and its scales in bytes)
    stride_x_token,
    stride_w_expert,
    stride_w_row,
    stride_scale_expert,
    stride_scale_row,
    stride_h_row,
    # meta-parameters
    BLOCK_M: tl.constexpr,   # sorted rows per block
    BLOCK_N: tl.constexpr,   # output rows per program
    GROUPS: tl.constexpr,    # 16-input groups per K-step
    PRECISION: tl.constexpr,  # tl.dot input precision
):
    """Each program computes one (block of BLOCK_M sorted rows of one expert, block of BLOCK_N
    rows) of h: h[r, n] = silu(gate_e[n] . x_t) * (up_e[n] . x_t) for the pair (t, slot) that
    sorted row r holds, e its expert."""
    expert, sorted_rows, pair, pair_ok = _sorted_block(block_expert_ptr, sorted_pairs_ptr,
                                                       num_pairs, BLOCK_M)
    if expert < 0:
        return
    token = tl.where(pair_ok, pair // top_k, 0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < intermediate
    w_expert_ptr = w_ptr + expert * stride_w_expert
    scale_expert_ptr = w_scale_ptr + expert * stride_scale_expert
    acc_gate = tl.full([BLOCK_N, BLOCK_M], 0.0, tl.float32)
    acc_up = tl.full([BLOCK_N, BLOCK_M], 0.0, tl.float32)
    for first_group in range(0, k_groups, GROUPS):
        groups = first_group + tl.arange(0, GROUPS)
        groups_ok = groups < k_groups
        x_even, x_odd = _x_cols(x_ptr, token, pair_ok, first_group=first_group,
                                k_groups=k_groups, stride_x_row=stride_x_token, GROUPS=GROUPS)
        low, high = _dequant_tiles(w_expert_ptr, scale_expert_ptr, rows=rows, rows_ok=rows_ok,
                                   groups=groups, groups_ok=groups_ok,
                                   stride_w_row=stride_w_row, stride_scale_row=stride_scale_row,
                                   BLOCK_N=BLOCK_N, GROUPS=GROUPS, dtype=x_even.dtype)
        acc_gate = tl.dot(low, x_even, acc_gate, input_precision=PRECISION)
        acc_gate = tl.dot(high, x_odd, acc_gate, input_precision=PRECISION)
        low, high = _dequant_tiles(w_expert_ptr, scale_expert_ptr, rows=rows + intermediate,
                                   rows_ok=rows_ok, groups=groups, groups_ok=groups_ok,
                                   stride_w_row=stride_w_row, stride_scale_row=stride_scale_row,
                                   BLOCK_N=BLOCK_N, GROUPS=GROUPS, dtype=x_even.dtype)
        acc_up = tl.dot(low, x_even, acc_up, input_precision=PRECISION)
        acc_up = tl.dot(high, x_odd, acc_up, input_precision=PRECISION)
    h = silu_mul(acc_gate, acc_up, gate_up_global_ptr, expert)
    ptr = h_ptr + sorted_rows[None, :].to(tl.int64) * stride_h_row + rows[:, None]
    tl.store(ptr, h, mask=rows_ok[:, None] & pair_ok[None, :])


@triton.jit
def down_prefill(
    # pointers
    h_ptr,                   # [sorted rows, k_groups * 16] (gate_up_prefill's h)
    sorted_pairs_ptr,        # [sorted rows] pair held by each sorted row (num_pairs: none)
    block_expert_ptr,        # [blocks] expert of each block of BLOCK_M sorted rows (-1: none)
    topk_weights_ptr,        # [pairs] routing weights
    w_ptr,                   # [experts, n_rows, k_groups * 8] bytes
    w_scale_ptr,             # [experts, n_rows, k_groups] e4m3 bytes
    down_global_ptr,         # [experts] float32
    out_ptr,                 # [pairs, n_rows] float32 (out), by pair
    # sizes
    num_pairs,
    n_rows,
    k_groups,                # 16-input groups of a row
    # strides (w and its scales in bytes)
    stride_h_row,
    stride_w_expert,
    stride_w_row,
    stride_scale_expert,
    stride_scale_row,
    stride_out_pair,
    # meta-parameters
    BLOCK_M: tl.constexpr,   # sorted rows per block
    BLOCK_N: tl.constexpr,   # output rows per program
    GROUPS: tl.constexpr,    # 16-input groups per K-step
    PRECISION: tl.constexpr,  # tl.dot input precision
):
    """Each program computes one (block of BLOCK_M sorted rows of one expert, block of BLOCK_N
    rows) of out: out[p, n] = w_e[n] . h[r] * down_global[e] * topk_weights[p] for the pair p
    that sorted row r holds, e its expert."""
    expert, sorted_rows, pair, pair_ok = _sorted_block(block_expert_ptr, sorted_pairs_ptr,
                                                       num_pairs, BLOCK_M)
    if expert < 0:
        return
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < n_rows
    w_expert_ptr = w_ptr + expert * stride_w_expert
    scale_expert_ptr = w_scale_ptr + expert * stride_scale_expert
    acc = tl.full([BLOCK_N, BLOCK_M], 0.0, tl.float32)
    for first_group in range(0, k_groups, GROUPS):
        groups = first_group + tl.arange(0, GROUPS)
        groups_ok = groups < k_groups
        h_even, h_odd = _x_cols(h_ptr, sorted_rows.to(tl.int64), pair_ok,
                                first_group=first_group, k_groups=k_groups,
                                stride_x_row=stride_h_row, GROUPS=GROUPS)
        low, high = _dequant_tiles(w_expert_ptr, scale_expert_ptr, rows=rows, rows_ok=rows_ok,
                                   groups=groups, groups_ok=groups_ok,
                                   stride_w_row=stride_w_row, stride_scale_row=stride_scale_row,
                                   BLOCK_N=BLOCK_N, GROUPS=GROUPS, dtype=h_even.dtype)
        acc = tl.dot(low, h_even, acc, input_precision=PRECISION)
        acc = tl.dot(high, h_odd, acc, input_precision=PRECISION)
    topk_weights = tl.load(topk_weights_ptr + pair, mask=pair_ok, other=0.0).to(tl.float32)
    out = acc * tl.load(down_global_ptr + expert) * topk_weights[None, :]
    ptr = out_ptr + tl.where(pair_ok, pair, 0)[None, :].to(tl.int64) * stride_out_pair
    tl.store(ptr + rows[:, None], out, mask=rows_ok[:, None] & pair_ok[None, :])
