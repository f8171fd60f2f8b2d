"""Triton kernels for the weight-only quantized linear layers (`freetoken.kernels.quant_gemm`):
`y = x W^T` with W stored as block FP8, FP8 per tensor or NVFP4, dequantized tile by tile in
registers, multiplied on the tensor cores in the activations' dtype (`tl.dot`), accumulated
in float32. One kernel per storage format serves every token count: a decode launch takes
16 tokens per program (the smallest tensor-core tile) and splits the inputs over programs
when the weight has few rows; a prefill launch takes 64 or more tokens per program, so each
dequantized tile is reused across them.

- `fp8_gemm_kernel`: e4m3 weights [N, K] (exact in bf16 / fp16 / fp32). The scale of weight
  element (n, k) is `scale[scale_row[n], (k + col_offset) // BLOCK_COLS]`: `scale_row` maps
  each local row to its scale row (segments of a fused layer, the shard's offset inside its
  first block, per-row scales), `col_offset` is the shard's offset inside its first column
  block. SCALE says where the scale is applied: 0, once per output (the scale depends on the
  row only: FP8 per tensor); 1, once per K step (the step lies inside one column block:
  BLOCK_K divides BLOCK_COLS and col_offset); 2, to every weight element before the dot
  (any block size, any offset).
- `nvfp4_gemm_kernel`: packed e2m1 words [N, K / 8] (8 nibbles each, element 8w + j in the
  j-th), e4m3 block scales [N, K / 16], one float32 global per output row (`group[n]` into
  `global`; RECIPROCAL: the stored global divides, compressed-tensors). A step's words are
  decoded into 8 planes (plane j holds inputs 8w + j: PTX lookups on a GPU,
  `nvfp4_decode_jit.word_values`), joined back into input order in registers, times their
  16-input block scale (exact in the activations' dtype) and multiplied with the inputs in
  one dot; the global multiplies the finished sum.

With SPLIT a program takes inputs [s * split_features, (s + 1) * split_features) only
(program_id(2) = s) and stores its float32 partial sum, scales applied, for
`gemv_jit.gemv_reduce_kernel` to add in split order (bias there). Every program's reduction
order is fixed, so a launch gives the same bits each time (graph replay equals eager).
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels.nvfp4_decode_jit import word_tables, word_values
from freetoken.kernels.nvfp4_dequant_jit import FP4_UNBIAS, e4m3


@triton.jit
def store_block(acc, rows, cols, row_ok, col_ok, bias_ptr, partial_ptr, out_ptr,
                out_features, stride_partial_split, stride_out_token, HAS_BIAS: tl.constexpr,
                SPLIT: tl.constexpr):
    """A finished [M, N] block: float32 partial sums (SPLIT), or bias added and one rounding
    to the output's dtype."""
    ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT:
        partial = (partial_ptr + tl.program_id(2) * stride_partial_split
                   + rows.to(tl.int64)[:, None] * out_features + cols[None, :])
        tl.store(partial, acc, mask=ok)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out_token + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def row_global(global_ptr, group_ptr, cols, col_ok, RECIPROCAL: tl.constexpr):
    """The global scale of weight rows `cols` (RECIPROCAL: the stored one divides)."""
    g = tl.load(global_ptr + tl.load(group_ptr + cols, mask=col_ok, other=0), mask=col_ok,
                other=1.0)
    if RECIPROCAL:
        g = 1.0 / g
    return g


@triton.jit
def _interleave(planes, BLOCK_N: tl.constexpr, KW: tl.constexpr):
    """The 8 planes of `word_values` ([BLOCK_N, KW] each, plane j holding input 8w + j of
    word w) as one [BLOCK_N, 8 KW] tile in input order. Joins add a trailing dim inside
    each thread's registers; joining planes that differ in bit 2 of j first, then bit 1,
    then bit 0, leaves j's bits in row-major order, so the reshape moves nothing."""
    p0, p1, p2, p3, p4, p5, p6, p7 = planes
    b0, b1, b2, b3 = tl.join(p0, p4), tl.join(p1, p5), tl.join(p2, p6), tl.join(p3, p7)
    c0, c1 = tl.join(b0, b2), tl.join(b1, b3)
    return tl.reshape(tl.join(c0, c1), [BLOCK_N, 8 * KW])


@triton.jit
def fp8_gemm_kernel(
    # pointers
    x_ptr,                  # [tokens, in_features] activations
    weight_ptr,             # [out_features, in_features] float8_e4m3fn
    scale_ptr,              # [scale rows, scale columns] float32
    scale_row_ptr,          # [out_features] int32: each weight row's scale row
    bias_ptr,
    partial_ptr,            # [splits, tokens, out_features] float32 (SPLIT)
    out_ptr,                # [tokens, out_features]
    # sizes
    tokens,
    out_features,
    in_features,
    split_features,
    col_offset,
    # strides
    stride_x_token,
    stride_weight_row,
    stride_scale_row,
    stride_partial_split,
    stride_out_token,
    # meta
    SCALE: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[m, n] for the tokens of block program_id(1) and the rows of block program_id(0)
    (see the module docstring)."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < tokens
    col_ok = cols < out_features
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x_token
    w_rows = weight_ptr + cols.to(tl.int64)[:, None] * stride_weight_row
    s_rows = scale_ptr + tl.load(scale_row_ptr + cols, mask=col_ok, other=0) * stride_scale_row
    dtype = x_ptr.dtype.element_ty
    k_start = tl.program_id(2) * split_features
    k_end = tl.minimum(k_start + split_features, in_features)
    acc = tl.full([BLOCK_M, BLOCK_N], 0, dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x_mask = row_ok[:, None]
            w_mask = col_ok[:, None]
        else:
            x_mask = row_ok[:, None] & (ks < in_features)[None, :]
            w_mask = col_ok[:, None] & (ks < in_features)[None, :]
        xv = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0)
        if SCALE == 2:
            s = tl.load(s_rows[:, None] + ((ks + col_offset) // BLOCK_COLS)[None, :],
                        mask=w_mask, other=0.0)
            acc = tl.dot(xv, tl.trans((w.to(tl.float32) * s).to(dtype)), acc,
                         input_precision=PRECISION)
        elif SCALE == 1:
            s = tl.load(s_rows + (k0 + col_offset) // BLOCK_COLS, mask=col_ok, other=0.0)
            part = tl.dot(xv, tl.trans(w.to(dtype)), input_precision=PRECISION)
            acc += part * s[None, :]
        else:
            acc = tl.dot(xv, tl.trans(w.to(dtype)), acc, input_precision=PRECISION)
    if SCALE == 0:
        acc = acc * tl.load(s_rows, mask=col_ok, other=0.0)[None, :]
    store_block(acc, rows, cols, row_ok, col_ok, bias_ptr, partial_ptr, out_ptr, out_features,
                stride_partial_split, stride_out_token, HAS_BIAS, SPLIT)


@triton.jit
def nvfp4_gemm_kernel(
    # pointers
    x_ptr,                  # [tokens, in_features] activations
    weight_ptr,             # [out_features, in_features / 8] int32 words of 8 nibbles
    scale_ptr,              # [out_features, in_features / 16] e4m3 bytes (uint8)
    global_ptr,             # [groups] float32 global scales
    group_ptr,              # [out_features] int32: each row's global
    bias_ptr,
    partial_ptr,            # [splits, tokens, out_features] float32 (SPLIT)
    out_ptr,                # [tokens, out_features]
    # sizes
    tokens,
    out_features,
    in_features,
    split_features,
    zero,                   # always 0 (see `nvfp4_decode_jit.word_tables`)
    # strides (weights in words, scales in bytes)
    stride_x_token,
    stride_weight_row,
    stride_scale_row,
    stride_partial_split,
    stride_out_token,
    # meta
    RECIPROCAL: tl.constexpr,
    ASM: tl.constexpr,      # 1: PTX word decode (GPU), 0: bit arithmetic (interpreter)
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KW: tl.constexpr,       # words per step (8 KW inputs)
):
    """out[m, n] for the tokens of block program_id(1) and the rows of block program_id(0)
    (see the module docstring); `split_features` is a whole number of steps."""
    G: tl.constexpr = KW // 2
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < tokens
    col_ok = cols < out_features
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x_token
    w_rows = weight_ptr + cols.to(tl.int64)[:, None] * stride_weight_row
    s_rows = scale_ptr + cols.to(tl.int64)[:, None] * stride_scale_row
    dtype = x_ptr.dtype.element_ty
    k_words, k_groups = in_features // 8, in_features // 16
    tables = word_tables(zero, BLOCK_N, KW)
    k_start = tl.program_id(2) * split_features
    k_end = tl.minimum(k_start + split_features, in_features)
    acc = tl.full([BLOCK_M, BLOCK_N], 0, dtype=tl.float32)
    for k0 in range(k_start, k_end, 8 * KW):
        word = k0 // 8 + tl.arange(0, KW)
        words = tl.load(w_rows + word[None, :], mask=col_ok[:, None] & (word < k_words)[None, :],
                        other=0)
        group = k0 // 16 + tl.arange(0, G)
        s = tl.load(s_rows + group[None, :], mask=col_ok[:, None] & (group < k_groups)[None, :],
                    other=0)
        # The block scale of each word pair, with the portable decode's 2^-14 undone.
        s = e4m3(s.to(tl.int32))
        if not ASM:
            s = s * FP4_UNBIAS
        w = _interleave(word_values(words, tables, ASM), BLOCK_N, KW)
        w = tl.reshape(tl.reshape(w, [BLOCK_N, G, 16]) * s[:, :, None], [BLOCK_N, 8 * KW])
        ks = k0 + tl.arange(0, 8 * KW)
        xv = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < in_features)[None, :],
                     other=0.0)
        acc = tl.dot(xv, tl.trans(w.to(dtype)), acc, input_precision=PRECISION)
    g = row_global(global_ptr, group_ptr, cols, col_ok, RECIPROCAL)
    store_block(acc * g[None, :], rows, cols, row_ok, col_ok, bias_ptr, partial_ptr, out_ptr,
                out_features, stride_partial_split, stride_out_token, HAS_BIAS, SPLIT)
