"""Warp-level pieces of the tensor-core NVFP4 decode (`nvfp4_mma_jit`): a lane's weight and
activation loads (`rows_tile`, `b_tile`), the mma itself (`mma`: the PTX of
`nvfp4_ptx.mma_asm`, or its emulation over the whole tensor in Triton's interpreter).

A program's tensors have one row per thread: tensor row r is lane r % 32 of warp r / 32, and
lane (g, t) = (lane / 4, lane % 4) of a warp holds weight rows g and g + 8 of its 16-row tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels.jit_ops import sum_
from freetoken.kernels.nvfp4_dequant_jit import e4m3_low, fp4_word
from freetoken.kernels.nvfp4_ptx import BF16_SCALE_EXP, mma_asm, mma_constraints

BF16_OUT = tl.constexpr(2.0 ** (126 - BF16_SCALE_EXP))
"""What the bf16 mma's sums are multiplied by."""
FP16_OUT = tl.constexpr(128.0)
"""What the fp16 mma's sums are multiplied by (its weights decode to e2m1 * e4m3 * 2^-7)."""

_MMA_ASM_1 = tl.constexpr(mma_asm(1))
_MMA_ASM_2 = tl.constexpr(mma_asm(2))
_MMA_ASM_4 = tl.constexpr(mma_asm(4))
_MMA_ASM_BF16_1 = tl.constexpr(mma_asm(1, bf16=True))
_MMA_ASM_BF16_2 = tl.constexpr(mma_asm(2, bf16=True))
_MMA_ASM_BF16_4 = tl.constexpr(mma_asm(4, bf16=True))
_MMA_CONSTRAINTS_1 = tl.constexpr(mma_constraints(1))
_MMA_CONSTRAINTS_2 = tl.constexpr(mma_constraints(2))
_MMA_CONSTRAINTS_4 = tl.constexpr(mma_constraints(4))


@triton.jit
def sum_factor(BF16: tl.constexpr):
    """What `mma`'s sums are multiplied by to undo the decoded weights' scale."""
    if BF16:
        f = BF16_OUT
    else:
        f = FP16_OUT
    return f


@triton.jit
def lanes(NW: tl.constexpr, S: tl.constexpr):
    """Per tensor row r (one per thread: lane r % 32 of warp r / 32): g, t, row tile, K split."""
    r = tl.arange(0, 32 * NW)
    lane = r % 32
    warp = r // 32
    return lane // 4, lane % 4, warp // S, warp % S


@triton.jit
def rows_tile(w_ptr, w_scale_ptr, expert_words, expert_bytes, rows, rows_end, live, chunk,
              lane_t, k_words, stride_w_row, stride_scale_row, V: tl.constexpr,
              FULL: tl.constexpr):
    """int32 words [R, V] of weight `rows` and `rows + 8` (valid below `rows_end`, where
    `live`) of the expert at word offset `expert_words` from `w_ptr` (scale byte offset
    `expert_bytes` from `w_scale_ptr`; pointers and offsets scalars or per row) for `chunk`
    (lane t's words chunk 4V + t V + i), and the block scale bytes [R, max(1, V / 2)] of the
    groups they span in both rows, packed as (row) | (row + 8) << 8 (word i in group i / 2;
    a row's are one load). FULL: every row and word exists and is live, nothing masked."""
    i = tl.arange(0, V)
    first_word = chunk * (4 * V) + lane_t * V
    word = first_word[:, None] + i[None, :]
    # [R]: rows g and g + 8 and the lane's first word
    ok_g1 = (rows < rows_end) & live & (first_word < k_words)
    ok_h1 = (rows + 8 < rows_end) & live & (first_word < k_words)
    ok_g = ok_g1[:, None] & (word < k_words)
    ok_h = ok_h1[:, None] & (word < k_words)
    words_ptr = (w_ptr + expert_words + rows.to(tl.int64) * stride_w_row)[:, None] + word
    if V >= 4:
        j = tl.arange(0, V // 2)
        group = tl.multiple_of(first_word // 2, V // 2)[:, None] + j[None, :]
        scales_ptr = ((w_scale_ptr + expert_bytes + rows.to(tl.int64) * stride_scale_row)[:, None]
                      + group)
        ok_sg = ok_g1[:, None]
        ok_sh = ok_h1[:, None]
    else:
        scales_ptr = (w_scale_ptr + expert_bytes + rows.to(tl.int64) * stride_scale_row
                      + first_word // 2)
        ok_sg = ok_g1
        ok_sh = ok_h1
    if FULL:
        words_g = tl.load(words_ptr)
        words_h = tl.load(words_ptr + 8 * stride_w_row)
        scales_g = tl.load(scales_ptr).to(tl.int32)
        scales_h = tl.load(scales_ptr + 8 * stride_scale_row).to(tl.int32)
    else:
        words_g = tl.load(words_ptr, mask=ok_g, other=0)
        words_h = tl.load(words_ptr + 8 * stride_w_row, mask=ok_h, other=0)
        scales_g = tl.load(scales_ptr, mask=ok_sg, other=0).to(tl.int32)
        scales_h = tl.load(scales_ptr + 8 * stride_scale_row, mask=ok_sh, other=0).to(tl.int32)
    scales = scales_g | (scales_h << 8)
    if V < 4:
        scales = scales[:, None]
    return words_g, words_h, scales


@triton.jit
def b_tile(b_ptr, chunk, lane_t, live, k_words, V: tl.constexpr, FULL: tl.constexpr):
    """Activations of `chunk` for lane t from the 16-bit row `b_ptr` (as int64, input order):
    each of the lane's V words' 8 inputs as two int64s, inputs 0..3 and 4..7 (the mma's PTX
    pairs them as its steps take them); (first halves, second halves) [R, V] each, loaded
    apart (one load of the 16 V bytes split in two costs a layout conversion through shared
    memory, and a barrier, every step). Every lane loads its column's row (lanes of other
    columns only feed mma columns that are never read); zeros past k_words or where not
    `live` [R] (unless FULL)."""
    i = tl.arange(0, V)
    offset = ((chunk * 4 + lane_t) * (2 * V))[:, None] + 2 * i[None, :]
    if FULL:
        return tl.load(b_ptr + offset), tl.load(b_ptr + offset + 1)
    ok = live[:, None] & (((chunk * (4 * V) + lane_t * V)[:, None] + i[None, :]) < k_words)
    return (tl.load(b_ptr + offset, mask=ok, other=0),
            tl.load(b_ptr + offset + 1, mask=ok, other=0))


@triton.jit
def _columns(x, N: tl.constexpr):
    """The N columns of x [R, N] (N in 1, 2, 4) as a tuple of [R] tensors."""
    if N == 1:
        return (tl.reshape(x, (x.shape[0],)),)
    elif N == 2:
        a, b = tl.split(x)
        return (a, b)
    else:
        even, odd = tl.split(tl.reshape(x, (x.shape[0], 2, 2)))    # (x0, x2), (x1, x3)
        a, c = tl.split(even)
        b, d = tl.split(odd)
        return (a, b, c, d)


@triton.jit
def mma(acc, w, b, NW: tl.constexpr, ASM: tl.constexpr, BF16: tl.constexpr = 0):
    """acc (4 float32 [R]) += the mma of weight words w = (wg [R, V], wh [R, V], scales
    [R, G]) and activations b (`b_tile`'s 2 int64 [R, V]; fp16, or bf16 with BF16): the PTX
    (ASM 1), or its emulation over the whole tensor (ASM 0: Triton's interpreter, which runs
    a program's NW warps as one tensor and cannot run PTX)."""
    V: tl.constexpr = w[0].shape[1]
    if ASM:
        args = (_columns(w[0], V) + _columns(w[1], V) + _columns(w[2], w[2].shape[1])
                + _columns(b[0], V) + _columns(b[1], V) + acc)
        if BF16:
            if V == 4:
                return _mma_call(args, _MMA_ASM_BF16_4, _MMA_CONSTRAINTS_4)
            elif V == 2:
                return _mma_call(args, _MMA_ASM_BF16_2, _MMA_CONSTRAINTS_2)
            return _mma_call(args, _MMA_ASM_BF16_1, _MMA_CONSTRAINTS_1)
        elif V == 4:
            return _mma_call(args, _MMA_ASM_4, _MMA_CONSTRAINTS_4)
        elif V == 2:
            return _mma_call(args, _MMA_ASM_2, _MMA_CONSTRAINTS_2)
        return _mma_call(args, _MMA_ASM_1, _MMA_CONSTRAINTS_1)
    return _mma_portable(acc, w, b, NW, BF16)


@triton.jit
def _mma_call(args, ASM_TEXT: tl.constexpr, CONSTRAINTS: tl.constexpr):
    return tl.inline_asm_elementwise(ASM_TEXT, CONSTRAINTS, args, dtype=(tl.float32,) * 4,
                                     is_pure=True, pack=1)


@triton.jit
def _half(x, shift: tl.constexpr, BF16: tl.constexpr):
    """float32 value of the fp16 (or bf16) at bit `shift` of int64 x."""
    bits = (x >> shift) & 0xFFFF
    if BF16:
        return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _word_weights(word, scale):
    """[R, V, 8] float32 e2m1 * e4m3 * 2^-7 of int32 words [R, V] (input j at nibble j) and
    their scale bytes [R, V] (the PTX's values, by the CUDA-core kernels' bit arithmetic)."""
    e2m1 = fp4_word(word[:, :, None] >> (4 * tl.arange(0, 8))[None, None, :], 0)
    # e2m1 * 2^-14 times e4m3 * 2^-8, times 2^15: e2m1 * e4m3 * 2^-7, exact in float32
    return e2m1 * e4m3_low(scale[:, :, None]) * 32768.0


@triton.jit
def _mma_portable(acc, w, b, NW: tl.constexpr, BF16: tl.constexpr):
    """`mma_asm` as tensor arithmetic: lane (g, t) of warp W is tensor row 32 W + 4 g + t;
    D[row, n] of a warp = sum over its lanes t and their 8 inputs q of the row's weights
    (lanes (row % 8, t)) times column n's activations (lanes (n, t)); with BF16 the
    weights are e2m1 * e4m3 * 2^(BF16_SCALE_EXP - 126) and the activations bf16."""
    R: tl.constexpr = w[0].shape[0]
    V: tl.constexpr = w[0].shape[1]
    G: tl.constexpr = w[2].shape[1]
    # word i's scales: group i / 2 of the lane's
    sc = tl.reshape(tl.broadcast_to(w[2][:, :, None], (R, G, V // G)), (R, V))
    wg = _word_weights(w[0], sc & 0xFF)
    wh = _word_weights(w[1], (sc >> 8) & 0xFF)
    if BF16:    # 2^-7 -> 2^(BF16_SCALE_EXP - 126), exact in float32
        wg = wg * (FP16_OUT / BF16_OUT)
        wh = wh * (FP16_OUT / BF16_OUT)
    # b[h] holds inputs 4 h + s at bits 16 s: input q = 4 h + 2 s1 + s0 (each join adds a
    # last axis, and the innermost join's ends up first: h, then s1, then s0)
    x = tl.join(tl.join(tl.join(_half(b[0], 0, BF16), _half(b[1], 0, BF16)),
                        tl.join(_half(b[0], 32, BF16), _half(b[1], 32, BF16))),
                tl.join(tl.join(_half(b[0], 16, BF16), _half(b[1], 16, BF16)),
                        tl.join(_half(b[0], 48, BF16), _half(b[1], 48, BF16))))
    x = tl.reshape(x, (NW, 1, 8, 4, V, 8))
    out = ()
    for rows in tl.static_range(2):
        a = tl.reshape(wh if rows else wg, (NW, 8, 1, 4, V, 8))
        d = sum_(sum_(a * x, 5), 3)                         # [NW, g, n, V]
        d = tl.permute(tl.reshape(d, (NW, 8, 4, 2, V)), (0, 1, 2, 4, 3))
        even, odd = tl.split(d)                             # columns 2t, 2t + 1
        out = out + (sum_(tl.reshape(even, (R, V)), 1), sum_(tl.reshape(odd, (R, V)), 1))
    return (acc[0] + out[0], acc[1] + out[1], acc[2] + out[2], acc[3] + out[3])


@triton.jit
def tile_sum(d, TILES: tl.constexpr, S: tl.constexpr):
    """[R] accumulator -> [TILES, 32]: summed over the K splits."""
    return sum_(tl.reshape(d, (TILES, S, 32)), 1)


@triton.jit
def bf16_bits(x):
    """float32 x rounded to bf16 (to nearest, ties to even; NaN stays NaN), as int16 bits:
    the rounding spelled out, since Triton's interpreter truncates `.to(tl.bfloat16)`."""
    b = x.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, r).to(tl.int16)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """float32 x rounded to DTYPE (bf16 or fp16 to nearest even; float32 kept), as float32."""
    if DTYPE == tl.bfloat16:
        x = (bf16_bits(x).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif DTYPE == tl.float16:
        x = x.to(tl.float16).to(tl.float32)
    return x
