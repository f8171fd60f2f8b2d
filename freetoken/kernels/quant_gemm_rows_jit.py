"""The weight-only quantized GEMMs without tensor cores, for a token or two against a whole
weight (`quant_gemm.fp8_gemm` and `quant_gemm.nvfp4_gemm` with `rows` tiles): one token per
program, any number of output rows per program, each step's weights widened to float32 and
multiplied elementwise, so a weight of few rows still fills the GPU and a program issues
its weight tile in one or two wide steps (`quant_gemm_jit`'s kernels pad the tokens to a
16-row dot tile and take at least 16 rows per program).

`fp8_gemm_rows_kernel`: e4m3 codes. The scale of weight element (n, k) is
`scale[scale_row[n], (k + col_offset) // BLOCK_COLS]` as in `fp8_gemm_kernel`. SCALE: 0,
once per output row (per tensor); 1, once per SUB-input group of each step (every group
lies inside one column block: SUB divides BLOCK_COLS and col_offset, and BLOCK_K is a
multiple of SUB); 2, to every element.

`nvfp4_gemm_rows_kernel`: packed e2m1 words (8 inputs each) decoded as the CUDA-core MoE
decode decodes them (`nvfp4_decode_jit.word_step`: a word's 8 products summed in float32,
the sum of a 16-input group times its block scale), the step's inputs split into the
words' 8 planes in registers (`_planes`); the row's global multiplies the finished sum.

Every program's reduction order is fixed, so a launch gives the same bits each time.

The decode step's fusions of `gemv_rows_jit` (a token's layer without launches of their own
for its neighbours): NORM, the RMSNorm of the token's row applied as x is loaded (rounded to
the activations' dtype as the separate norm rounds it; STORE_NORMED also stores it, for the
layers after it that read the same input); GATED, a [gate | up] weight of 2 out_features
rows whose result is `silu(gate) * up` (up row n is row out_features + n, with its own
scales; a split launch runs ungated over all 2 out_features rows and the reduction gates
them); HAS_RESIDUAL, the decoder layer's residual added to the rounded output (after a
split, in `gemv_jit.gemv_reduce_kernel`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels import jit_ops as ops
from freetoken.kernels.gemv_jit import epilogue
from freetoken.kernels.gemv_rows_jit import early_residual, load_pair, row_input, row_scale
from freetoken.kernels.nvfp4_decode_jit import unbias, word_step, word_tables
from freetoken.kernels.quant_gemm_jit import row_global, store_block


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
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    EARLY: tl.constexpr = 1,    # the residual loaded first (`early_residual`)
):
    """out[t, n] for token t = program_id(1) and the rows of block program_id(0) (see the
    module docstring); with SPLIT, program_id(2) takes `split_features` inputs (a whole
    number of steps) and stores its float32 partial sum, scales applied."""
    token = tl.program_id(1)
    rows = token + tl.arange(0, 1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < tokens
    col_ok = cols < out_features
    x_row = x_ptr + token.to(tl.int64) * stride_x_token
    w_rows = weight_ptr + cols.to(tl.int64)[:, None] * stride_weight_row
    up_rows = w_rows + out_features * stride_weight_row
    s_rows = scale_ptr + tl.load(scale_row_ptr + cols, mask=col_ok, other=0) * stride_scale_row
    s_up = scale_ptr
    if GATED:
        s_up = scale_ptr + tl.load(scale_row_ptr + out_features + cols, mask=col_ok,
                                   other=0) * stride_scale_row
    residual = early_residual(residual_ptr, rows, cols, row_ok, col_ok, stride_residual_token,
                              EARLY, HAS_RESIDUAL, SPLIT)
    norm_scale = 1.0
    if NORM:
        norm_scale = row_scale(x_row, in_features, eps, NORM_BLOCK)
    normed_row = normed_ptr + token.to(tl.int64) * stride_normed_token
    k_start = tl.program_id(2) * split_features
    k_end = tl.minimum(k_start + split_features, in_features)
    acc = tl.full([BLOCK_N], 0, dtype=tl.float32)
    acc_up = tl.full([BLOCK_N], 0, dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        xv, w_mask = row_input(x_row, ks, in_features, col_ok, norm_weight_ptr, norm_scale,
                               normed_row, EVEN_K, NORM, STORE_NORMED)
        w, w_up = load_pair(w_rows, up_rows, ks, w_mask, GATED)
        xf = xv.to(tl.float32)
        acc += _fp8_step(w, s_rows, xf, k0, ks, w_mask, col_ok, in_features, col_offset,
                         SCALE, BLOCK_COLS, SUB, BLOCK_N, BLOCK_K)
        if GATED:
            acc_up += _fp8_step(w_up, s_up, xf, k0, ks, w_mask, col_ok, in_features,
                                col_offset, SCALE, BLOCK_COLS, SUB, BLOCK_N, BLOCK_K)
    if SCALE == 0:
        acc = acc * tl.load(s_rows, mask=col_ok, other=0.0)
        if GATED:
            acc_up = acc_up * tl.load(s_up, mask=col_ok, other=0.0)
    _finish(acc, acc_up, rows, cols, row_ok, col_ok, bias_ptr, residual_ptr, partial_ptr,
            out_ptr, out_features, stride_residual_token, stride_partial_split,
            stride_out_token, GATED, HAS_BIAS, HAS_RESIDUAL, SPLIT, residual)


@triton.jit
def _fp8_step(w, s_rows, xf, k0, ks, w_mask, col_ok, in_features, col_offset,
              SCALE: tl.constexpr, BLOCK_COLS: tl.constexpr, SUB: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One step's [BLOCK_N] sums of the e4m3 tile `w` times xf [1, BLOCK_K], their scales
    (rows `s_rows`) applied per element or per SUB group (SCALE 2, 1; 0: by the caller)."""
    G: tl.constexpr = BLOCK_K // SUB
    prod = w.to(tl.float32) * xf
    if SCALE == 2:
        s = tl.load(s_rows[:, None] + ((ks + col_offset) // BLOCK_COLS)[None, :], mask=w_mask,
                    other=0.0)
        return ops.sum_(prod * s, axis=1)
    elif SCALE == 1:
        groups = k0 + tl.arange(0, G) * SUB
        s = tl.load(s_rows[:, None] + ((groups + col_offset) // BLOCK_COLS)[None, :],
                    mask=col_ok[:, None] & (groups < in_features)[None, :], other=0.0)
        part = ops.sum_(tl.reshape(prod, [BLOCK_N, G, SUB]), axis=2)
        return ops.sum_(part * s, axis=1)
    else:
        return ops.sum_(prod, axis=1)


@triton.jit
def _finish(acc, acc_up, rows, cols, row_ok, col_ok, bias_ptr, residual_ptr, partial_ptr,
            out_ptr, out_features, stride_residual_token, stride_partial_split,
            stride_out_token, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
            HAS_RESIDUAL: tl.constexpr, SPLIT: tl.constexpr, residual=None):
    """Store a program's finished [BLOCK_N] sums (and the up half's, GATED): float32
    partials (SPLIT), else `gemv_jit.epilogue`'s bias, SiLU-and-mul, residual (`residual`
    where it was loaded ahead, `gemv_rows_jit.early_residual`) and rounding."""
    if SPLIT:
        store_block(acc[None, :], rows, cols, row_ok, col_ok, bias_ptr, partial_ptr, out_ptr,
                    out_features, stride_partial_split, stride_out_token, HAS_BIAS, SPLIT)
    else:
        epilogue(acc[None, :], acc_up[None, :], rows, cols, row_ok, col_ok, bias_ptr,
                 residual_ptr, out_ptr, out_features, stride_residual_token, stride_out_token,
                 GATED, HAS_BIAS, HAS_RESIDUAL, residual)


@triton.jit
def _planes(xv, KW: tl.constexpr):
    """One step's inputs [1, 8 KW] (input order, float32) as the 8 planes `word_step` takes,
    plane j [1, KW] holding input 8w + j: `quant_gemm_jit._interleave` undone, the input's
    index bits split off lowest first."""
    c0, c1 = tl.split(tl.reshape(xv, [KW, 2, 2, 2]))
    b00, b01 = tl.split(c0)
    b10, b11 = tl.split(c1)
    p0, p4 = tl.split(b00)
    p2, p6 = tl.split(b01)
    p1, p5 = tl.split(b10)
    p3, p7 = tl.split(b11)
    return (p0[None, :], p1[None, :], p2[None, :], p3[None, :], p4[None, :], p5[None, :],
            p6[None, :], p7[None, :])


@triton.jit
def nvfp4_gemm_rows_kernel(
    # pointers
    x_ptr,                  # [tokens, in_features] activations
    weight_ptr,             # [out_features, in_features / 8] int32 words of 8 nibbles
    scale_ptr,              # [out_features, in_features / 16] e4m3 bytes (uint8)
    global_ptr,             # [groups] float32 global scales
    group_ptr,              # [out_features] int32: each row's global
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
    zero,                   # always 0 (see `nvfp4_decode_jit.word_tables`)
    eps,
    # strides (weights in words, scales in bytes)
    stride_x_token,
    stride_weight_row,
    stride_scale_row,
    stride_residual_token,
    stride_partial_split,
    stride_out_token,
    stride_normed_token,
    # meta
    RECIPROCAL: tl.constexpr,
    ASM: tl.constexpr,      # 1: PTX word decode (GPU), 0: bit arithmetic (interpreter)
    NORM: tl.constexpr,
    STORE_NORMED: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KW: tl.constexpr,       # words per step (8 KW inputs, KW even)
    NORM_BLOCK: tl.constexpr,
    EARLY: tl.constexpr = 1,    # the residual loaded first (`early_residual`)
):
    """out[t, n] for token t = program_id(1) and the rows of block program_id(0) (see the
    module docstring); with SPLIT, program_id(2) takes `split_features` inputs (a whole
    number of steps) and stores its float32 partial sum, scales applied."""
    G: tl.constexpr = KW // 2
    token = tl.program_id(1)
    rows = token + tl.arange(0, 1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < tokens
    col_ok = cols < out_features
    x_row = x_ptr + token.to(tl.int64) * stride_x_token
    w_rows = weight_ptr + cols.to(tl.int64)[:, None] * stride_weight_row
    s_rows = scale_ptr + cols.to(tl.int64)[:, None] * stride_scale_row
    k_words, k_groups = in_features // 8, in_features // 16
    tables = word_tables(zero, BLOCK_N, KW)
    residual = early_residual(residual_ptr, rows, cols, row_ok, col_ok, stride_residual_token,
                              EARLY, HAS_RESIDUAL, SPLIT)
    norm_scale = 1.0
    if NORM:
        norm_scale = row_scale(x_row, in_features, eps, NORM_BLOCK)
    normed_row = normed_ptr + token.to(tl.int64) * stride_normed_token
    k_start = tl.program_id(2) * split_features
    k_end = tl.minimum(k_start + split_features, in_features)
    acc = tl.full([BLOCK_N, G], 0, dtype=tl.float32)
    acc_up = tl.full([BLOCK_N, G], 0, dtype=tl.float32)
    for k0 in range(k_start, k_end, 8 * KW):
        xv, _ = row_input(x_row, k0 + tl.arange(0, 8 * KW), in_features, col_ok,
                          norm_weight_ptr, norm_scale, normed_row, EVEN_K, NORM, STORE_NORMED)
        x = _planes(xv.to(tl.float32), KW)
        word = k0 // 8 + tl.arange(0, KW)
        group = k0 // 16 + tl.arange(0, G)
        w_mask = col_ok[:, None] & (word < k_words)[None, :]
        s_mask = col_ok[:, None] & (group < k_groups)[None, :]
        acc = word_step(acc, tl.load(w_rows + word[None, :], mask=w_mask, other=0),
                        tl.load(s_rows + group[None, :], mask=s_mask, other=0), x, tables, ASM)
        if GATED:
            acc_up = word_step(
                acc_up, tl.load(w_rows + out_features * stride_weight_row + word[None, :],
                                mask=w_mask, other=0),
                tl.load(s_rows + out_features * stride_scale_row + group[None, :],
                        mask=s_mask, other=0), x, tables, ASM)
    out = ops.sum_(acc, axis=1) * unbias(ASM) * row_global(global_ptr, group_ptr, cols, col_ok,
                                                         RECIPROCAL)
    out_up = out
    if GATED:
        out_up = ops.sum_(acc_up, axis=1) * unbias(ASM) * row_global(
            global_ptr, group_ptr, out_features + cols, col_ok, RECIPROCAL)
    _finish(out, out_up, rows, cols, row_ok, col_ok, bias_ptr, residual_ptr, partial_ptr,
            out_ptr, out_features, stride_residual_token, stride_partial_split,
            stride_out_token, GATED, HAS_BIAS, HAS_RESIDUAL, SPLIT, residual)
