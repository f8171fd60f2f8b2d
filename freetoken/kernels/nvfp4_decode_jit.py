"""CUDA-core NVFP4 decode kernels (few tokens; float32 activations, and every activation dtype
in Triton's interpreter): GEMVs whose weights are dequantized in registers, every product
accumulated in float32. The launchers are in `freetoken.kernels.nvfp4_launch`.

Weights are read as int32 words of 8 nibbles and never multiplied by their block scale: each
word's 8 products with the inputs are summed in float32 and the sum is scaled (two words share
a 16-input block scale). The activations come in word order, float32 (`x[j * stride_nibble +
w]` = input 8w + j), so the j-th weight of every word meets its input with no shuffle. A
word's weights as float32, two implementations (`ASM`):
- 1, PTX (any CUDA GPU): `prmt` byte lookups (`nvfp4_ptx.word_asm`), exact values.
- 0, portable (the interpreter; `FREETOKEN_NVFP4_PTX=0`): `nvfp4_dequant_jit.fp4_word`,
  values times 2^-14, undone once per output (`unbias`).

Weights are loaded two K-steps ahead of their use, into three buffers that the loop body
(three steps) names explicitly: a loop that rotated buffers would copy each one, and the copy
waits for its load, which leaves one step of latency hiding instead of two.
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels.jit_ops import sum_
from freetoken.kernels.nvfp4_dequant_jit import (
    E4M3_UNBIAS,
    FP4_UNBIAS,
    e4m3_low,
    fp4_word,
    silu_mul,
)
from freetoken.kernels.nvfp4_ptx import BF16_HIGH, BF16_LOW, SIGN_TABLE, imm, word_asm

# the prmt tables as signed int32 constants for `word_tables`
BF16_HIGH_0, BF16_HIGH_1 = (tl.constexpr(int(imm(v))) for v in BF16_HIGH)
BF16_LOW_0, BF16_LOW_1 = (tl.constexpr(int(imm(v))) for v in BF16_LOW)
SIGN_TABLE_C = tl.constexpr(SIGN_TABLE)
_WORD_ASM = tl.constexpr(word_asm())
# The word path's block scales are e4m3 * 2^-8 (`e4m3_low`), its portable nibbles e2m1 *
# 2^-14 (`fp4_word`): `unbias` undoes that at the end.
_PORTABLE_UNBIAS = tl.constexpr(E4M3_UNBIAS.value * FP4_UNBIAS.value)


@triton.jit
def word_values(words, tables, ASM: tl.constexpr):
    """The 8 weights packed in each int32 word of `words`, as 8 float32 tensors shaped like
    `words` (element 8w + j in the j-th); block scale and global scale not applied. ASM: the
    PTX lookups with the five `tables` (`word_tables`), exact values; else bit arithmetic,
    values times 2^-14."""
    if ASM:
        return tl.inline_asm_elementwise(
            _WORD_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r",
            [words, tables[0], tables[1], tables[2], tables[3], tables[4]],
            dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    return (fp4_word(words, 0), fp4_word(words, 4), fp4_word(words, 8), fp4_word(words, 12),
            fp4_word(words, 16), fp4_word(words, 20), fp4_word(words, 24), fp4_word(words, 28))


@triton.jit
def word_tables(zero, BLOCK_N: tl.constexpr, KW: tl.constexpr):
    """The five prmt tables of `_WORD_ASM` as [BLOCK_N, KW] int32 operands. `zero` is a
    kernel argument that is always 0: built from it the tables stay in registers across
    the loop, where immediates would be re-materialised before every use."""
    z = tl.full([BLOCK_N, KW], 0, tl.int32) + zero
    return (z + BF16_HIGH_0, z + BF16_HIGH_1, z + BF16_LOW_0, z + BF16_LOW_1, z + SIGN_TABLE_C)


@triton.jit
def _word_tile(w_ptr, w_scale_ptr, rows, rows_ok, first_word, k_words, stride_w_row,
               stride_scale_row, KW: tl.constexpr):
    """int32 words [rows, KW] (8 weights each) of weight `rows` from `first_word` (even), and
    their block-scale bytes [rows, KW / 2] (one per 16 inputs = 2 words); zeros past k_words
    (the prefetch runs two steps past the end)."""
    word = first_word + tl.arange(0, KW)
    ok = rows_ok[:, None] & (word < k_words)[None, :]
    words = tl.load(w_ptr + rows[:, None] * stride_w_row + word[None, :], mask=ok, other=0)
    group = first_word // 2 + tl.arange(0, KW // 2)
    scales = tl.load(w_scale_ptr + rows[:, None] * stride_scale_row + group[None, :],
                     mask=rows_ok[:, None] & (group < k_words // 2)[None, :], other=0)
    return words, scales


@triton.jit
def _x_words(x_row_ptr, stride_nibble, first_word, k_words, live, BLOCK_N: tl.constexpr,
             KW: tl.constexpr, EVEN: tl.constexpr):
    """Activations matching `_word_tile`'s words, from a row in word order
    (`x_row_ptr[j * stride_nibble + w]` = input 8w + j, float32): 8 tensors [BLOCK_N, KW],
    the j-th holding input 8w + j; zeros where the step is not `live` or (unless EVEN: every
    step whole) past k_words."""
    word = first_word + tl.arange(0, KW)
    ptr = x_row_ptr + (word[None, :] + tl.full([BLOCK_N, 1], 0, tl.int32))
    ok = tl.full([BLOCK_N, KW], 1, tl.int1) & live
    if not EVEN:
        ok = ok & (word < k_words)[None, :]
    s = stride_nibble
    return (tl.load(ptr, mask=ok, other=0.0), tl.load(ptr + s, mask=ok, other=0.0),
            tl.load(ptr + 2 * s, mask=ok, other=0.0), tl.load(ptr + 3 * s, mask=ok, other=0.0),
            tl.load(ptr + 4 * s, mask=ok, other=0.0), tl.load(ptr + 5 * s, mask=ok, other=0.0),
            tl.load(ptr + 6 * s, mask=ok, other=0.0), tl.load(ptr + 7 * s, mask=ok, other=0.0))


@triton.jit
def word_step(acc, words, scales, x, tables, ASM: tl.constexpr):
    """acc [rows, KW / 2] += block scale * (the group's 16 weights . their 16 inputs), float32:
    the block scale multiplies a group's sum (two words), not each weight."""
    f = word_values(words, tables, ASM)
    p = f[0] * x[0]
    p += f[1] * x[1]
    p += f[2] * x[2]
    p += f[3] * x[3]
    p += f[4] * x[4]
    p += f[5] * x[5]
    p += f[6] * x[6]
    p += f[7] * x[7]
    p = sum_(tl.reshape(p, (p.shape[0], p.shape[1] // 2, 2)), 2)
    return acc + p * e4m3_low(scales.to(tl.int32))


@triton.jit
def unbias(ASM: tl.constexpr):
    """What turns `word_step`'s scaled sums into values: e4m3's 2^-8, and with the portable
    decode also e2m1's 2^-14."""
    if ASM:
        return E4M3_UNBIAS
    return _PORTABLE_UNBIAS


@triton.jit
def _gate_up_tiles(expert, rows, rows_ok, intermediate, first_word, k_words, KW: tl.constexpr):
    """Gate and up `_word_tile`s of one step (up rows follow the `intermediate` gate rows);
    `expert` = (w_ptr, w_scale_ptr, stride_w_row, stride_scale_row) of the pair's expert."""
    w_ptr, w_scale_ptr, stride_w_row, stride_scale_row = expert
    gate_words, gate_scales = _word_tile(
        w_ptr, w_scale_ptr, rows=rows, rows_ok=rows_ok, first_word=first_word,
        k_words=k_words, stride_w_row=stride_w_row, stride_scale_row=stride_scale_row, KW=KW)
    up_words, up_scales = _word_tile(
        w_ptr, w_scale_ptr, rows=rows + intermediate, rows_ok=rows_ok, first_word=first_word,
        k_words=k_words, stride_w_row=stride_w_row, stride_scale_row=stride_scale_row, KW=KW)
    return gate_words, gate_scales, up_words, up_scales


@triton.jit
def _gate_up_step(acc_gate, acc_up, tiles, x_row, first_word, k_words, tables,
                  BLOCK_N: tl.constexpr, KW: tl.constexpr, ASM: tl.constexpr,
                  EVEN: tl.constexpr):
    """Gate and up `word_step`s of one step; `x_row` = (the token's activation row, its
    j-stride)."""
    x = _x_words(x_row[0], x_row[1], first_word=first_word, k_words=k_words,
                 live=first_word < k_words, BLOCK_N=BLOCK_N, KW=KW, EVEN=EVEN)
    return (word_step(acc_gate, tiles[0], tiles[1], x, tables, ASM),
            word_step(acc_up, tiles[2], tiles[3], x, tables, ASM))


@triton.jit
def gate_up_decode(
    # pointers
    x_ptr,                  # [tokens, 8 * stride_x_nibble] float32, word order
    topk_ids_ptr,           # [pairs] expert of pair p = token * top_k + slot
    topk_weights_ptr,       # [pairs] routing weights
    w_ptr,                  # [experts, 2 * intermediate, k_words] int32 words (gate, up rows)
    w_scale_ptr,            # [experts, 2 * intermediate, k_words / 2] e4m3 bytes
    gate_up_global_ptr,     # [experts, 2] float32 (gate, up)
    down_global_ptr,        # [experts] float32
    h_ptr,                  # [pairs, 8 * stride_h_nibble] float32, word order (out)
    # sizes
    zero,                   # always 0 (see `word_tables`)
    intermediate,
    k_words,
    top_k,
    # strides (w and its scales in int32 words and bytes)
    stride_x_token,
    stride_x_nibble,
    stride_w_expert,
    stride_w_row,
    stride_scale_expert,
    stride_scale_row,
    stride_h_pair,
    stride_h_nibble,
    # meta-parameters
    BLOCK_N: tl.constexpr,  # output rows per program
    KW: tl.constexpr,       # words per row and K-step
    ASM: tl.constexpr,      # 1: PTX word decode, 0: portable
    EVEN: tl.constexpr,     # every K-step whole (no K mask)
    VEC: tl.constexpr,      # words a row start is aligned to
):
    """Each program computes one (pair, block of BLOCK_N rows) of h:
    h[p, n] = silu(gate_e[n] . x_t) * (up_e[n] . x_t) * topk_weights[p] * down_global[e] for
    pair p = (token t, slot) routed to expert e. The routing weight and down's global scale
    are applied here, so that down is one dot product over all of a token's slots; h is
    written in word order (`down_decode` reads it)."""
    pair = tl.program_id(0)
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    x_row_ptr = x_ptr + (pair // top_k).to(tl.int64) * stride_x_token
    stride_w_row = tl.multiple_of(stride_w_row, VEC)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < intermediate
    w_expert_ptr = w_ptr.to(tl.pointer_type(tl.int32)) + expert * stride_w_expert
    scale_expert_ptr = w_scale_ptr + expert * stride_scale_expert
    expert_w = (w_expert_ptr, scale_expert_ptr, stride_w_row, stride_scale_row)
    x_row = (x_row_ptr, stride_x_nibble)
    tables = word_tables(zero, BLOCK_N, KW)
    acc_gate = tl.full([BLOCK_N, KW // 2], 0.0, tl.float32)
    acc_up = tl.full([BLOCK_N, KW // 2], 0.0, tl.float32)
    a = _gate_up_tiles(expert_w, rows, rows_ok, intermediate, first_word=0, k_words=k_words,
                       KW=KW)
    b = _gate_up_tiles(expert_w, rows, rows_ok, intermediate, first_word=KW, k_words=k_words,
                       KW=KW)
    for first_word in range(0, k_words, 3 * KW):
        first_word = tl.multiple_of(first_word, KW)
        c = _gate_up_tiles(expert_w, rows, rows_ok, intermediate,
                           first_word=first_word + 2 * KW, k_words=k_words, KW=KW)
        acc_gate, acc_up = _gate_up_step(acc_gate, acc_up, a, x_row, first_word=first_word,
                                         k_words=k_words, tables=tables, BLOCK_N=BLOCK_N,
                                         KW=KW, ASM=ASM, EVEN=EVEN)
        a = _gate_up_tiles(expert_w, rows, rows_ok, intermediate,
                           first_word=first_word + 3 * KW, k_words=k_words, KW=KW)
        acc_gate, acc_up = _gate_up_step(acc_gate, acc_up, b, x_row, first_word=first_word + KW,
                                         k_words=k_words, tables=tables, BLOCK_N=BLOCK_N,
                                         KW=KW, ASM=ASM, EVEN=EVEN)
        b = _gate_up_tiles(expert_w, rows, rows_ok, intermediate,
                           first_word=first_word + 4 * KW, k_words=k_words, KW=KW)
        acc_gate, acc_up = _gate_up_step(acc_gate, acc_up, c, x_row,
                                         first_word=first_word + 2 * KW, k_words=k_words,
                                         tables=tables, BLOCK_N=BLOCK_N, KW=KW, ASM=ASM,
                                         EVEN=EVEN)
    h = silu_mul(sum_(acc_gate, 1) * unbias(ASM), sum_(acc_up, 1) * unbias(ASM),
                 gate_up_global_ptr, expert)
    h = h * (tl.load(down_global_ptr + expert) * tl.load(topk_weights_ptr + pair).to(tl.float32))
    # word order: row n at (n % 8) * stride_h_nibble + n // 8
    h_row_ptr = h_ptr + pair.to(tl.int64) * stride_h_pair
    tl.store(h_row_ptr + (rows % 8) * stride_h_nibble + rows // 8, h, mask=rows_ok)


@triton.jit
def _next_step(slot, first_word, k_words, KW: tl.constexpr):
    """(slot, first word) of the step after (slot, first_word) in `down_decode`'s walk."""
    first_word += KW
    wrap = first_word >= k_words
    return tl.where(wrap, slot + 1, slot), tl.where(wrap, 0, first_word)


@triton.jit
def _slot_tile(experts, token, top_k, step, rows, rows_ok, k_words, KW: tl.constexpr):
    """`_word_tile` of walk step `step` = (slot, first word) of `token` (its expert's words;
    zeros once the slot is past the last one: the prefetch runs two steps past the end),
    and the step after. `experts` = (topk_ids_ptr, w_ptr, w_scale_ptr, stride_w_expert,
    stride_w_row, stride_scale_expert, stride_scale_row)."""
    topk_ids_ptr, w_ptr, w_scale_ptr = experts[0], experts[1], experts[2]
    stride_w_expert, stride_w_row = experts[3], experts[4]
    stride_scale_expert, stride_scale_row = experts[5], experts[6]
    slot, first_word = step
    expert = tl.load(topk_ids_ptr + token * top_k + tl.minimum(slot, top_k - 1)).to(tl.int64)
    tile = _word_tile(w_ptr + expert * stride_w_expert, w_scale_ptr + expert * stride_scale_expert,
                      rows=rows, rows_ok=rows_ok & (slot < top_k),
                      first_word=tl.multiple_of(first_word, KW), k_words=k_words,
                      stride_w_row=stride_w_row, stride_scale_row=stride_scale_row, KW=KW)
    return tile, _next_step(slot, first_word, k_words, KW)


@triton.jit
def _down_step(acc, tile, h_rows, token, top_k, step, k_words, tables, BLOCK_N: tl.constexpr,
               KW: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr):
    """`word_step` of walk step `step` = (slot, first word), and the step after; `h_rows` =
    (h_ptr, stride_h_pair, stride_h_nibble)."""
    h_ptr, stride_h_pair, stride_h_nibble = h_rows
    slot, first_word = step
    pair = token * top_k + tl.minimum(slot, top_k - 1)
    h_row_ptr = h_ptr + pair.to(tl.int64) * stride_h_pair
    x = _x_words(h_row_ptr, stride_h_nibble, first_word=tl.multiple_of(first_word, KW),
                 k_words=k_words, live=slot < top_k, BLOCK_N=BLOCK_N, KW=KW, EVEN=EVEN)
    return (word_step(acc, tile[0], tile[1], x, tables, ASM),
            _next_step(slot, first_word, k_words, KW))


@triton.jit
def down_decode(
    # pointers
    h_ptr,                  # [pairs, 8 * stride_h_nibble] float32, word order, scaled
    topk_ids_ptr,           # [pairs] expert of pair p = token * top_k + slot
    w_ptr,                  # [experts, n_rows, k_words] int32 words
    w_scale_ptr,            # [experts, n_rows, k_words / 2] e4m3 bytes
    out_ptr,                # [tokens, n_rows] (out)
    # sizes
    zero,                   # always 0 (see `word_tables`)
    n_rows,
    k_words,
    top_k,
    steps_per_slot,         # K-steps of one slot's row
    # strides (w and its scales in int32 words and bytes)
    stride_h_pair,
    stride_h_nibble,
    stride_w_expert,
    stride_w_row,
    stride_scale_expert,
    stride_scale_row,
    stride_out_token,
    # meta-parameters
    BLOCK_N: tl.constexpr,  # output rows per program
    KW: tl.constexpr,       # words per row and K-step
    ASM: tl.constexpr,      # 1: PTX word decode, 0: portable
    EVEN: tl.constexpr,     # every K-step whole (no K mask)
    VEC: tl.constexpr,      # words a row start is aligned to
):
    """Each program computes one (token, block of BLOCK_N rows) of out:
    out[t, n] = sum over t's slots p (routed to e) of w_e[n] . h[p], h already scaled by the
    routing weight and the global scale. The program walks all of the token's slots as one
    long dot product, so the slots are added in order in one float32 sum, with no partial
    rows in memory. `cur` is the walk step being computed, `ld` the step being loaded."""
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < n_rows
    stride_w_row = tl.multiple_of(stride_w_row, VEC)
    w_words_ptr = w_ptr.to(tl.pointer_type(tl.int32))
    tables = word_tables(zero, BLOCK_N, KW)
    acc = tl.full([BLOCK_N, KW // 2], 0.0, tl.float32)
    experts = (topk_ids_ptr, w_words_ptr, w_scale_ptr, stride_w_expert, stride_w_row,
               stride_scale_expert, stride_scale_row)
    h_rows = (h_ptr, stride_h_pair, stride_h_nibble)
    cur = (0, 0)
    a, ld = _slot_tile(experts, token, top_k, step=cur, rows=rows, rows_ok=rows_ok,
                       k_words=k_words, KW=KW)
    b, ld = _slot_tile(experts, token, top_k, step=ld, rows=rows, rows_ok=rows_ok,
                       k_words=k_words, KW=KW)
    for _ in range(0, top_k * steps_per_slot, 3):
        c, ld = _slot_tile(experts, token, top_k, step=ld, rows=rows, rows_ok=rows_ok,
                           k_words=k_words, KW=KW)
        acc, cur = _down_step(acc, a, h_rows, token, top_k, step=cur, k_words=k_words,
                              tables=tables, BLOCK_N=BLOCK_N, KW=KW, ASM=ASM, EVEN=EVEN)
        a, ld = _slot_tile(experts, token, top_k, step=ld, rows=rows, rows_ok=rows_ok,
                           k_words=k_words, KW=KW)
        acc, cur = _down_step(acc, b, h_rows, token, top_k, step=cur, k_words=k_words,
                              tables=tables, BLOCK_N=BLOCK_N, KW=KW, ASM=ASM, EVEN=EVEN)
        b, ld = _slot_tile(experts, token, top_k, step=ld, rows=rows, rows_ok=rows_ok,
                           k_words=k_words, KW=KW)
        acc, cur = _down_step(acc, c, h_rows, token, top_k, step=cur, k_words=k_words,
                              tables=tables, BLOCK_N=BLOCK_N, KW=KW, ASM=ASM, EVEN=EVEN)
    out = sum_(acc, 1) * unbias(ASM)
    tl.store(out_ptr + token.to(tl.int64) * stride_out_token + rows, out, mask=rows_ok)
