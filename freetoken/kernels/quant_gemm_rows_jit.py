"""The weight-only FP8 GEMM without tensor cores (`fp8_gemm_rows_kernel`), for a token or
two against a whole weight (`quant_gemm.fp8_gemm` with `rows` tiles): one token per program,
any number of output rows per program, each step's e4m3 codes widened to float32 and
multiplied elementwise, so a weight of few rows still fills the GPU and a program issues
its weight tile in one or two wide steps (`quant_gemm_jit.fp8_gemm_kernel` pads the tokens
to a 16-row dot tile and takes at least 16 rows per program).

The scale of weight element (n, k) is `scale[scale_row[n], (k + col_offset) // BLOCK_COLS]`
as in `fp8_gemm_kernel`. SCALE: 0, once per output row (per tensor); 1, once per
SUB-input group of each step (every group lies inside one column block: SUB divides
BLOCK_COLS and col_offset, and BLOCK_K is a multiple of SUB); 2, to every element. Every
program's reduction order is fixed, so a launch gives the same bits each time.

The decode step's fusions of `gemv_rows_jit` (a token's layer without launches of their own
for its neighbours): NORM, the RMSNorm of the token's row applied as x is loaded (rounded to
the activations' dtype as the separate norm rounds it; STORE_NORMED also stores it, for the
layers after it that read the same input); HAS_RESIDUAL, the decoder layer's residual added
to the rounded output (after a split, in `gemv_jit.gemv_reduce_kernel`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels import jit_ops as ops
from freetoken.kernels.gemv_jit import epilogue
from freetoken.kernels.gemv_rows_jit import row_input, row_scale
from freetoken.kernels.quant_gemm_jit import store_block


@triton.jit
def fp8_gemm_rows_kernel(
    # pointers
    x_ptr,                  # [tokens, in_features] activations
    weight_ptr,             # [out_features, in_features] float8_e4m3fn
    scale_ptr,              # [scale rows, scale columns] float32
    scale_row_ptr,          # [out_features] int32: each weight row's scale row
    bias_ptr,
    norm_weight_ptr,        # NORM: [in_features] the RMSNorm's weight
    residual_ptr,           # HAS_RESIDUAL: [tokens, out_features]
    partial_ptr,            # [splits, tokens, out_features] float32 (SPLIT)
    out_ptr,                # [tokens, out_features]
    normed_ptr,             # STORE_NORMED: [tokens, in_features] out, the normalised x
    # sizes
    tokens,
    out_features,
    in_features,
    split_features,
    col_offset,
    eps,
    # strides
    stride_x_token,
    stride_weight_row,
    stride_scale_row,
    stride_residual_token,
    stride_partial_split,
    stride_out_token,
    stride_normed_token,
    # meta
    SCALE: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    SUB: tl.constexpr,
    NORM: tl.constexpr,
    STORE_NORMED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
):
    """out[t, n] for token t = program_id(1) and the rows of block program_id(0) (see the
    module docstring); with SPLIT, program_id(2) takes `split_features` inputs (a whole
    number of steps) and stores its float32 partial sum, scales applied."""
    G: tl.constexpr = BLOCK_K // SUB
    token = tl.program_id(1)
    rows = token + tl.arange(0, 1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < tokens
    col_ok = cols < out_features
    x_row = x_ptr + token.to(tl.int64) * stride_x_token
    w_rows = weight_ptr + cols.to(tl.int64)[:, None] * stride_weight_row
    s_rows = scale_ptr + tl.load(scale_row_ptr + cols, mask=col_ok, other=0) * stride_scale_row
    norm_scale = 1.0
    if NORM:
        norm_scale = row_scale(x_row, in_features, eps, NORM_BLOCK)
    normed_row = normed_ptr + token.to(tl.int64) * stride_normed_token
    k_start = tl.program_id(2) * split_features
    k_end = tl.minimum(k_start + split_features, in_features)
    acc = tl.full([BLOCK_N], 0, dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        xv, w_mask = row_input(x_row, ks, in_features, col_ok, norm_weight_ptr, norm_scale,
                               normed_row, EVEN_K, NORM, STORE_NORMED)
        w = tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0)
        prod = w.to(tl.float32) * xv.to(tl.float32)
        if SCALE == 2:
            s = tl.load(s_rows[:, None] + ((ks + col_offset) // BLOCK_COLS)[None, :],
                        mask=w_mask, other=0.0)
            acc += ops.sum_(prod * s, axis=1)
        elif SCALE == 1:
            groups = k0 + tl.arange(0, G) * SUB
            s = tl.load(s_rows[:, None] + ((groups + col_offset) // BLOCK_COLS)[None, :],
                        mask=col_ok[:, None] & (groups < in_features)[None, :], other=0.0)
            part = ops.sum_(tl.reshape(prod, [BLOCK_N, G, SUB]), axis=2)
            acc += ops.sum_(part * s, axis=1)
        else:
            acc += ops.sum_(prod, axis=1)
    if SCALE == 0:
        acc = acc * tl.load(s_rows, mask=col_ok, other=0.0)
    if SPLIT:
        store_block(acc[None, :], rows, cols, row_ok, col_ok, bias_ptr, partial_ptr, out_ptr,
                    out_features, stride_partial_split, stride_out_token, HAS_BIAS, SPLIT)
    else:
        epilogue(acc[None, :], acc[None, :], rows, cols, row_ok, col_ok, bias_ptr,
                 residual_ptr, out_ptr, out_features, stride_residual_token, stride_out_token,
                 False, HAS_BIAS, HAS_RESIDUAL)
