"""Triton kernels for NVFP4 weights with 16-bit (or fp32) activations, W4A16: weights are
dequantized in registers and every product is accumulated in float32.

Weight layout (ModelOpt): bytes [rows, K / 2] with element 2j in the low nibble of byte j;
block scales e4m3 [rows, K / 16], passed as their raw bytes (uint8) so that no kernel needs
Triton's fp8 types; one float32 global scale per (expert, part).

Decode (few tokens) reads weights as int32 words of 8 nibbles and never multiplies a weight by
its block scale: each word's 8 products with the inputs are summed in float32 and the sum is
scaled (two words share a 16-input block scale). The activations come in word order, float32
(`x[j * xs + w]` = input 8w + j), so the j-th weight of every word meets its input with no
shuffle. A word's weights as float32, two implementations:
- PTX (`ASM` 1, any CUDA GPU): `prmt` byte permutes used as 8-entry lookup tables give the
  upper 16 bits of each value (a float32 e2m1 value has zero lower bits) and the signs:
  about 3 instructions per weight, 4 with its multiply-add. Exact.
- portable (`ASM` 0: the interpreter; `FREETOKEN_NVFP4_PTX=0`): an e2m1 code `s e1 e0 m`
  placed at fp16 bits 15 and 11..9 is the fp16 number e2m1 * 2^-14 exactly (codes 0 and 1
  land on fp16 subnormals, which fp16 -> fp32 converts exactly); the power of two is undone
  once per output.
Block scales: an e4m3 byte `s eeee mmm` at fp16 bits 15 and 13..7 is e4m3 * 2^-8 the same
way. Prefill dequantizes tiles with the same bit arithmetic, in float32 (Triton's interpreter
mis-computes bf16 arithmetic), and casts them to the activations' dtype for `tl.dot` (exact:
e2m1 * e4m3 has at most 6 significant bits).

Kernels (the MoE ones take a flat list of (token, slot) pairs, pair p = token * top_k + slot):
- `gate_up_decode` / `down_decode` (few tokens): GEMVs on CUDA cores, weights loaded two
  K-steps ahead of their use. gate_up: one program per (pair, block of output rows); it
  applies the gate and up global scales separately, then SiLU(gate) * up, times the pair's
  routing weight and down's global scale, and writes h in word order. down: one program per
  (token, block of output rows) walks the token's slots as one long dot product, so the
  slots are added in order in one float32 sum (deterministic, no partial rows in memory).
- `gate_up_prefill` / `down_prefill` (many tokens): pairs sorted by expert into blocks of
  BLOCK_M rows, one program per (block, block of output rows), tensor-core `tl.dot` on
  dequantized tiles; down_prefill applies its global scale and the pair's routing weight.
A dense NVFP4 linear is `down_*` with one expert (decode: its activations times its global
scale, in word order; prefill: unit routing weights).
"""

from __future__ import annotations

import triton
import triton.language as tl

# e2m1 nibbles decode to e2m1 * 2^-14 and e4m3 scales (`_e4m3_low`) to e4m3 * 2^-8 in the
# portable bit arithmetic; these undo it.
_FP4_UNBIAS = tl.constexpr(16384.0)
_E4M3_UNBIAS = tl.constexpr(256.0)

# tl.sum and tl.zeros are @jit functions of triton.language, and whether a @jit function is
# interpreted is fixed when its module is imported: triton may have been imported (by
# transformers, say) before TRITON_INTERPRET=1 was set. So only builtins are called here:
# tl.full, and tl.reduce with triton's own combiners, which the interpreter recognises by
# identity and runs in numpy (a combiner of ours would run element by element in Python).


def _imm(value: int) -> str:
    """A 32-bit PTX immediate, written as a signed decimal."""
    return str(value - (1 << 32) if value >= 1 << 31 else value)


def _word_asm() -> str:
    """PTX: one int32 word of 8 packed e2m1 nibbles ($8) -> their 8 values as float32 ($0..$7,
    element order), exact. A float32 e2m1 value has its low 16 bits zero, so two `prmt` byte
    lookups give the high and low bytes of its upper half (tables in $9, $10 and $11, $12),
    a third the sign bytes (table $13); one more `prmt` pairs them up, and a shift or a mask
    places each in a float32. 25 instructions per 8 weights."""
    lines = [
        ".reg .b32 m, mh, sg, sl, sh, h0, h1, l0, l1, g0, g1, u;",
        f"and.b32 m, $8, {_imm(0x77777777)};",     # magnitude codes, one per nibble
        "shr.u32 mh, m, 16;",                       # codes of nibbles 4-7 at nibbles 0-3
        f"and.b32 sg, $8, {_imm(0x88888888)};",    # sign bits
        "shr.u32 sl, sg, 3;",                       # signs of nibbles 0-3 as selectors 0/1
        "shr.u32 sh, sg, 19;",                      # signs of nibbles 4-7
        "prmt.b32 h0, $9, $10, m;",
        "prmt.b32 h1, $9, $10, mh;",
        "prmt.b32 g0, $13, 0, sl;",                 # 0x80 where negative
        "prmt.b32 g1, $13, 0, sh;",
        "or.b32 h0, h0, g0;",
        "or.b32 h1, h1, g1;",
        "prmt.b32 l0, $11, $12, m;",
        "prmt.b32 l1, $11, $12, mh;",
    ]
    out = 0
    for lo, hi in (("l0", "h0"), ("l1", "h1")):
        # (low, high) bytes of nibbles (0, 1) and (2, 3) of this half: bytes (0, 4, 1, 5)
        # and (2, 6, 3, 7); the first of each pair goes to the upper half by a shift
        for sel in (0x5140, 0x7362):
            lines += [f"prmt.b32 u, {lo}, {hi}, {_imm(sel)};",
                      f"shl.b32 ${out}, u, 16;",
                      f"and.b32 ${out + 1}, u, {_imm(0xFFFF0000)};"]
            out += 2
    return "{\n" + "\n".join(lines) + "\n}"


# Bytes of the upper 16 bits of the e2m1 magnitudes 0-7 (0, 0.5, 1, 1.5, 2, 3, 4, 6) as prmt
# tables: byte k of the (codes 0-3, codes 4-7) words is the high (or low) byte for code k.
BF16_HIGH = (0x3F3F3F00, 0x40404040)   # 0x0000 0x3F00 0x3F80 0x3FC0 0x4000 0x4040 0x4080 0x40C0
BF16_LOW = (0xC0800000, 0xC0804000)
SIGN_TABLE = 0x8000                      # selector 1 (negative) -> 0x80
# the tables as signed int32 constants for `word_tables`
BF16_HIGH_0, BF16_HIGH_1 = (tl.constexpr(int(_imm(v))) for v in BF16_HIGH)
BF16_LOW_0, BF16_LOW_1 = (tl.constexpr(int(_imm(v))) for v in BF16_LOW)
SIGN_TABLE_C = tl.constexpr(SIGN_TABLE)
_WORD_ASM = tl.constexpr(_word_asm())
# The word path's block scales are e4m3 * 2^-8 (`_e4m3_low`), its portable nibbles e2m1 *
# 2^-14 (`_fp4_word`): `_unbias` undoes that at the end.
_PORTABLE_UNBIAS = tl.constexpr(_E4M3_UNBIAS.value * _FP4_UNBIAS.value)


@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _e4m3_low(s):
    """float32 value * 2^-8 of e4m3 bytes in int32 `s` (NaN encodings never occur in NVFP4
    scales)."""
    bits = ((s & 0x80) << 8) | ((s & 0x7F) << 7)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3(s):
    """float32 value of e4m3 bytes in int32 `s`."""
    return _e4m3_low(s) * _E4M3_UNBIAS


@triton.jit
def _fp4_word(b, shift: tl.constexpr):
    """e2m1 value * 2^-14 of the nibble at bit `shift` of int32 `b` (a word, or a byte: shift
    0 its low nibble, 4 its high one), as float32."""
    n = b >> shift
    bits = ((n & 0x8) << 12) | ((n & 0x7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _word_values(b, t0, t1, t2, t3, t4, ASM: tl.constexpr):
    """The 8 weights packed in each int32 word of `b`, as 8 float32 tensors shaped like `b`
    (element 8w + j in the j-th); block scale and global scale not applied. ASM: the PTX
    lookup tables (t0..t4, see `word_tables`), exact values; else bit arithmetic, values
    times 2^-14."""
    if ASM:
        return tl.inline_asm_elementwise(_WORD_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r",
                                         [b, t0, t1, t2, t3, t4], dtype=(tl.float32,) * 8,
                                         is_pure=True, pack=1)
    return (_fp4_word(b, 0), _fp4_word(b, 4), _fp4_word(b, 8), _fp4_word(b, 12),
            _fp4_word(b, 16), _fp4_word(b, 20), _fp4_word(b, 24), _fp4_word(b, 28))


@triton.jit
def _load_tile(w_ptr, s_ptr, row, row_ok, grp, g_ok, stride_w, stride_s):
    """Bytes [rows, groups, 8] (int32) and block scales [rows, groups] (float32) of weight
    rows `row` for K-groups `grp` (16 inputs = 8 bytes each)."""
    byte = grp[:, None] * 8 + tl.arange(0, 8)[None, :]
    mask = row_ok[:, None, None] & g_ok[None, :, None]
    b = tl.load(w_ptr + row[:, None, None] * stride_w + byte[None, :, :], mask=mask, other=0)
    s_mask = row_ok[:, None] & g_ok[None, :]
    s = tl.load(s_ptr + row[:, None] * stride_s + grp[None, :], mask=s_mask, other=0)
    return b.to(tl.int32), _e4m3(s.to(tl.int32))


@triton.jit
def _dequant_tiles(w_ptr, s_ptr, row, row_ok, grp, g_ok, stride_w, stride_s,
                   BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, dtype: tl.constexpr):
    """True weight values (without the global scale) of the even and odd inputs,
    [rows, 8 * groups] each in `dtype`. e2m1 * e4m3 has at most 6 significant bits, so the
    cast to bf16 is exact."""
    b, s = _load_tile(w_ptr, s_ptr, row, row_ok, grp, g_ok, stride_w, stride_s)
    s = (s * _FP4_UNBIAS)[:, :, None]
    low = tl.reshape(_fp4_word(b, 0) * s, (BLOCK_N, 8 * GROUPS))
    high = tl.reshape(_fp4_word(b, 4) * s, (BLOCK_N, 8 * GROUPS))
    return low.to(dtype), high.to(dtype)


@triton.jit
def _silu_mul(gate, up, g_ptr, e):
    """SiLU(gate * g_gate) * (up * g_up), with expert e's gate and up global scales."""
    gate = gate * tl.load(g_ptr + 2 * e)
    return gate / (1.0 + tl.exp(-gate)) * (up * tl.load(g_ptr + 2 * e + 1))


@triton.jit
def _sorted_block(block_expert_ptr, rows_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """This program's block of the expert-sorted layout: its expert (-1: unused block), its
    sorted rows, the pair each holds and which hold one."""
    blk = tl.program_id(0)
    e = tl.load(block_expert_ptr + blk).to(tl.int64)
    m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(rows_ptr + m)
    return e, m, pair, pair < num_pairs


@triton.jit
def word_tables(zero, BLOCK_N: tl.constexpr, KW: tl.constexpr):
    """The five prmt tables of `_WORD_ASM` as [BLOCK_N, KW] int32 operands. `zero` is a
    kernel argument that is always 0: built from it the tables stay in registers across
    the loop, where immediates would be re-materialised before every use."""
    z = tl.full([BLOCK_N, KW], 0, tl.int32) + zero
    return (z + BF16_HIGH_0, z + BF16_HIGH_1, z + BF16_LOW_0, z + BF16_LOW_1, z + SIGN_TABLE_C)


@triton.jit
def _word_tile(w_ptr, s_ptr, row, row_ok, w0, k_words, stride_w, stride_s, KW: tl.constexpr):
    """int32 words [rows, KW] (8 weights each) of rows `row` from word w0 (even), and their
    block-scale bytes [rows, KW / 2] (one per 16 inputs = 2 words); zeros past k_words (the
    prefetch runs two steps past the end)."""
    kw = w0 + tl.arange(0, KW)
    ok = row_ok[:, None] & (kw < k_words)[None, :]
    b = tl.load(w_ptr + row[:, None] * stride_w + kw[None, :], mask=ok, other=0)
    g = w0 // 2 + tl.arange(0, KW // 2)
    s = tl.load(s_ptr + row[:, None] * stride_s + g[None, :],
                mask=row_ok[:, None] & (g < k_words // 2)[None, :], other=0)
    return b, s


@triton.jit
def _x_words(x_row, xs, w0, k_words, live, BLOCK_N: tl.constexpr, KW: tl.constexpr,
             EVEN: tl.constexpr):
    """Activations matching `_word_tile`'s words, from a row in word order (`x_row[j * xs +
    w]` = input 8w + j, float32): 8 tensors [BLOCK_N, KW], the j-th holding input 8w + j;
    zeros where the step is not `live` or (unless EVEN: every step whole) past k_words."""
    kw = w0 + tl.arange(0, KW)
    ptr = x_row + (kw[None, :] + tl.full([BLOCK_N, 1], 0, tl.int32))
    ok = tl.full([BLOCK_N, KW], 1, tl.int1) & live
    if not EVEN:
        ok = ok & (kw < k_words)[None, :]
    return (tl.load(ptr, mask=ok, other=0.0), tl.load(ptr + xs, mask=ok, other=0.0),
            tl.load(ptr + 2 * xs, mask=ok, other=0.0), tl.load(ptr + 3 * xs, mask=ok, other=0.0),
            tl.load(ptr + 4 * xs, mask=ok, other=0.0), tl.load(ptr + 5 * xs, mask=ok, other=0.0),
            tl.load(ptr + 6 * xs, mask=ok, other=0.0), tl.load(ptr + 7 * xs, mask=ok, other=0.0))


@triton.jit
def _word_step(acc, b, s, x, t, ASM: tl.constexpr):
    """acc [rows, KW / 2] += block scale * (the group's 16 weights . their 16 inputs), float32:
    the block scale multiplies a group's sum (two words), not each weight."""
    f = _word_values(b, t[0], t[1], t[2], t[3], t[4], ASM)
    p = f[0] * x[0]
    p += f[1] * x[1]
    p += f[2] * x[2]
    p += f[3] * x[3]
    p += f[4] * x[4]
    p += f[5] * x[5]
    p += f[6] * x[6]
    p += f[7] * x[7]
    p = _sum(tl.reshape(p, (p.shape[0], p.shape[1] // 2, 2)), 2)
    return acc + p * _e4m3_low(s.to(tl.int32))


@triton.jit
def _unbias(ASM: tl.constexpr):
    if ASM:
        return _E4M3_UNBIAS
    return _PORTABLE_UNBIAS


@triton.jit
def _store_words(h_ptr, pair, stride_h, hs, n, n_ok, h):
    """Store h[n] of row `pair` in word order (position (n % 8) * hs + n // 8), the layout
    `down_decode` reads."""
    tl.store(h_ptr + pair.to(tl.int64) * stride_h + (n % 8) * hs + n // 8, h, mask=n_ok)


@triton.jit
def _gate_up_tiles(w, s, n, n_ok, inter, w0, k_words, stride_wn, stride_sn, KW: tl.constexpr):
    """Gate and up `_word_tile`s of one step."""
    bg, sg = _word_tile(w, s, n, n_ok, w0, k_words, stride_wn, stride_sn, KW)
    bu, su = _word_tile(w, s, n + inter, n_ok, w0, k_words, stride_wn, stride_sn, KW)
    return bg, sg, bu, su


@triton.jit
def _gate_up_step(acc_g, acc_u, tiles, x_row, xs, w0, k_words, tab, BLOCK_N: tl.constexpr,
                  KW: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr):
    x = _x_words(x_row, xs, w0, k_words, w0 < k_words, BLOCK_N, KW, EVEN)
    return (_word_step(acc_g, tiles[0], tiles[1], x, tab, ASM),
            _word_step(acc_u, tiles[2], tiles[3], x, tab, ASM))


@triton.jit
def gate_up_decode(x_ptr, ids_ptr, tw_ptr, w_ptr, s_ptr, g_ptr, g2_ptr, h_ptr, zero, inter,
                   k_words, top_k, stride_x, xs, stride_we, stride_wn, stride_se, stride_sn,
                   stride_h, hs, BLOCK_N: tl.constexpr, KW: tl.constexpr, ASM: tl.constexpr,
                   EVEN: tl.constexpr, VEC: tl.constexpr):
    """h[p, n] = silu(gate_e[n] . x_t) * (up_e[n] . x_t) * tw[p] * g2[e] for pair p = (t,
    slot) routed to e (the routing weight and down's global scale are applied here, so that
    down is one dot product over all of a token's slots), one program per (pair, block of
    rows), on CUDA cores. x in word order (float32, j-stride xs), weights as int32 words
    (strides in words); h written in word order (j-stride hs).

    Weights are loaded two steps before their use, into three buffers that the loop body
    (three steps) names explicitly: a loop that rotated buffers would copy each one, and the
    copy waits for its load, which leaves one step of latency hiding instead of two."""
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // top_k).to(tl.int64) * stride_x
    stride_wn = tl.multiple_of(stride_wn, VEC)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    w = w_ptr.to(tl.pointer_type(tl.int32)) + e * stride_we
    s = s_ptr + e * stride_se
    tab = word_tables(zero, BLOCK_N, KW)
    acc_g = tl.full([BLOCK_N, KW // 2], 0.0, tl.float32)
    acc_u = tl.full([BLOCK_N, KW // 2], 0.0, tl.float32)
    a = _gate_up_tiles(w, s, n, n_ok, inter, 0, k_words, stride_wn, stride_sn, KW)
    b = _gate_up_tiles(w, s, n, n_ok, inter, KW, k_words, stride_wn, stride_sn, KW)
    for w0 in range(0, k_words, 3 * KW):
        w0 = tl.multiple_of(w0, KW)
        c = _gate_up_tiles(w, s, n, n_ok, inter, w0 + 2 * KW, k_words, stride_wn, stride_sn,
                           KW)
        acc_g, acc_u = _gate_up_step(acc_g, acc_u, a, x_row, xs, w0, k_words, tab, BLOCK_N,
                                     KW, ASM, EVEN)
        a = _gate_up_tiles(w, s, n, n_ok, inter, w0 + 3 * KW, k_words, stride_wn, stride_sn,
                           KW)
        acc_g, acc_u = _gate_up_step(acc_g, acc_u, b, x_row, xs, w0 + KW, k_words, tab,
                                     BLOCK_N, KW, ASM, EVEN)
        b = _gate_up_tiles(w, s, n, n_ok, inter, w0 + 4 * KW, k_words, stride_wn, stride_sn,
                           KW)
        acc_g, acc_u = _gate_up_step(acc_g, acc_u, c, x_row, xs, w0 + 2 * KW, k_words, tab,
                                     BLOCK_N, KW, ASM, EVEN)
    h = _silu_mul(_sum(acc_g, 1) * _unbias(ASM), _sum(acc_u, 1) * _unbias(ASM), g_ptr, e)
    h = h * (tl.load(g2_ptr + e) * tl.load(tw_ptr + pair).to(tl.float32))
    _store_words(h_ptr, pair, stride_h, hs, n, n_ok, h)


@triton.jit
def _next_step(slot, w0, k_words, KW: tl.constexpr):
    """(slot, first word) of the step after (slot, w0) in `down_decode`'s walk."""
    w0 += KW
    wrap = w0 >= k_words
    return tl.where(wrap, slot + 1, slot), tl.where(wrap, 0, w0)


@triton.jit
def _slot_tile(ids_ptr, w_ptr, s_ptr, t, top_k, slot, w0, n, n_ok, k_words, stride_we,
               stride_wn, stride_se, stride_sn, KW: tl.constexpr):
    """`_word_tile` of token t's slot `slot` (its expert's words from w0; zeros once `slot`
    is past the last one: the prefetch runs two steps past the end), and the step after."""
    e = tl.load(ids_ptr + t * top_k + tl.minimum(slot, top_k - 1)).to(tl.int64)
    tile = _word_tile(w_ptr + e * stride_we, s_ptr + e * stride_se, n, n_ok & (slot < top_k),
                      tl.multiple_of(w0, KW), k_words, stride_wn, stride_sn, KW)
    return tile, _next_step(slot, w0, k_words, KW)


@triton.jit
def _down_step(acc, tile, h_ptr, t, top_k, slot, w0, stride_h, hs, k_words, tab,
               BLOCK_N: tl.constexpr, KW: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr):
    """`_word_step` of the walk's step (slot, w0), and the step after."""
    h_row = h_ptr + (t * top_k + tl.minimum(slot, top_k - 1)).to(tl.int64) * stride_h
    x = _x_words(h_row, hs, tl.multiple_of(w0, KW), k_words, slot < top_k, BLOCK_N, KW, EVEN)
    return _word_step(acc, tile[0], tile[1], x, tab, ASM), _next_step(slot, w0, k_words, KW)


@triton.jit
def down_decode(h_ptr, ids_ptr, w_ptr, s_ptr, out_ptr, zero, n_rows, k_words, top_k, steps,
                stride_h, hs, stride_we, stride_wn, stride_se, stride_sn, stride_out,
                BLOCK_N: tl.constexpr, KW: tl.constexpr, ASM: tl.constexpr,
                EVEN: tl.constexpr, VEC: tl.constexpr):
    """out[t, n] = sum over t's slots p (routed to e) of w2_e[n] . h[p], h already scaled by
    the routing weight and global scale, in word order (float32, j-stride hs). One program
    per (token, block of rows) walks all of the token's slots as one long dot product
    (`steps` K-steps per slot), so the slots are added in order in one float32 sum, with no
    partial rows in memory. Loads run two steps ahead in three named buffers, as in
    `gate_up_decode`; `cur` is the step being computed, `ld` the step being loaded."""
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_rows
    stride_wn = tl.multiple_of(stride_wn, VEC)
    w = w_ptr.to(tl.pointer_type(tl.int32))
    tab = word_tables(zero, BLOCK_N, KW)
    acc = tl.full([BLOCK_N, KW // 2], 0.0, tl.float32)
    cur = (0, 0)
    a, ld = _slot_tile(ids_ptr, w, s_ptr, t, top_k, cur[0], cur[1], n, n_ok, k_words,
                       stride_we, stride_wn, stride_se, stride_sn, KW)
    b, ld = _slot_tile(ids_ptr, w, s_ptr, t, top_k, ld[0], ld[1], n, n_ok, k_words,
                       stride_we, stride_wn, stride_se, stride_sn, KW)
    for _ in range(0, top_k * steps, 3):
        c, ld = _slot_tile(ids_ptr, w, s_ptr, t, top_k, ld[0], ld[1], n, n_ok, k_words,
                           stride_we, stride_wn, stride_se, stride_sn, KW)
        acc, cur = _down_step(acc, a, h_ptr, t, top_k, cur[0], cur[1], stride_h, hs, k_words,
                              tab, BLOCK_N, KW, ASM, EVEN)
        a, ld = _slot_tile(ids_ptr, w, s_ptr, t, top_k, ld[0], ld[1], n, n_ok, k_words,
                           stride_we, stride_wn, stride_se, stride_sn, KW)
        acc, cur = _down_step(acc, b, h_ptr, t, top_k, cur[0], cur[1], stride_h, hs, k_words,
                              tab, BLOCK_N, KW, ASM, EVEN)
        b, ld = _slot_tile(ids_ptr, w, s_ptr, t, top_k, ld[0], ld[1], n, n_ok, k_words,
                           stride_we, stride_wn, stride_se, stride_sn, KW)
        acc, cur = _down_step(acc, c, h_ptr, t, top_k, cur[0], cur[1], stride_h, hs, k_words,
                              tab, BLOCK_N, KW, ASM, EVEN)
    out = _sum(acc, 1) * _unbias(ASM)
    tl.store(out_ptr + t.to(tl.int64) * stride_out + n, out, mask=n_ok)


@triton.jit
def _x_cols(x_ptr, row, row_ok, g0, k_groups, stride_x, GROUPS: tl.constexpr):
    """Even and odd inputs of activation rows `row` for K-groups g0.., transposed:
    [8 * groups, rows] each, in the activations' dtype (the tensor-core operand)."""
    byte = g0 * 8 + tl.arange(0, 8 * GROUPS)
    mask = (byte < k_groups * 8)[:, None] & row_ok[None, :]
    ptr = x_ptr + row[None, :] * stride_x + 2 * byte[:, None]
    return tl.load(ptr, mask=mask, other=0.0), tl.load(ptr + 1, mask=mask, other=0.0)


@triton.jit
def gate_up_prefill(x_ptr, rows_ptr, block_expert_ptr, w_ptr, s_ptr, g_ptr, h_ptr, num_pairs,
                    inter, k_groups, top_k, stride_x, stride_we, stride_wn, stride_se,
                    stride_sn, stride_h, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    GROUPS: tl.constexpr, PRECISION: tl.constexpr):
    """Like `gate_up_decode` for BLOCK_M pairs of one expert at a time (sorted row r of the
    aligned layout holds pair rows[r]); h is written in that sorted order."""
    e, m, pair, p_ok = _sorted_block(block_expert_ptr, rows_ptr, num_pairs, BLOCK_M)
    if e < 0:
        return
    token = tl.where(p_ok, pair // top_k, 0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    w, s = w_ptr + e * stride_we, s_ptr + e * stride_se
    acc_g = tl.full([BLOCK_N, BLOCK_M], 0.0, tl.float32)
    acc_u = tl.full([BLOCK_N, BLOCK_M], 0.0, tl.float32)
    for g0 in range(0, k_groups, GROUPS):
        grp = g0 + tl.arange(0, GROUPS)
        g_ok = grp < k_groups
        xe, xo = _x_cols(x_ptr, token, p_ok, g0, k_groups, stride_x, GROUPS)
        lo, hi = _dequant_tiles(w, s, n, n_ok, grp, g_ok, stride_wn, stride_sn, BLOCK_N,
                                GROUPS, xe.dtype)
        acc_g = tl.dot(lo, xe, acc_g, input_precision=PRECISION)
        acc_g = tl.dot(hi, xo, acc_g, input_precision=PRECISION)
        lo, hi = _dequant_tiles(w, s, n + inter, n_ok, grp, g_ok, stride_wn, stride_sn,
                                BLOCK_N, GROUPS, xe.dtype)
        acc_u = tl.dot(lo, xe, acc_u, input_precision=PRECISION)
        acc_u = tl.dot(hi, xo, acc_u, input_precision=PRECISION)
    h = _silu_mul(acc_g, acc_u, g_ptr, e)
    ptr = h_ptr + m[None, :].to(tl.int64) * stride_h + n[:, None]
    tl.store(ptr, h, mask=n_ok[:, None] & p_ok[None, :])


@triton.jit
def down_prefill(h_ptr, rows_ptr, block_expert_ptr, tw_ptr, w_ptr, s_ptr, g_ptr, out_ptr,
                 num_pairs, n_rows, k_groups, stride_h, stride_we, stride_wn, stride_se,
                 stride_sn, stride_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 GROUPS: tl.constexpr, PRECISION: tl.constexpr):
    """Like `down_decode` for BLOCK_M sorted rows of one expert; h row r belongs to pair
    rows[r], and out is written by pair."""
    e, m, pair, p_ok = _sorted_block(block_expert_ptr, rows_ptr, num_pairs, BLOCK_M)
    if e < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_rows
    w, s = w_ptr + e * stride_we, s_ptr + e * stride_se
    acc = tl.full([BLOCK_N, BLOCK_M], 0.0, tl.float32)
    for g0 in range(0, k_groups, GROUPS):
        grp = g0 + tl.arange(0, GROUPS)
        g_ok = grp < k_groups
        he, ho = _x_cols(h_ptr, m.to(tl.int64), p_ok, g0, k_groups, stride_h, GROUPS)
        lo, hi = _dequant_tiles(w, s, n, n_ok, grp, g_ok, stride_wn, stride_sn, BLOCK_N,
                                GROUPS, he.dtype)
        acc = tl.dot(lo, he, acc, input_precision=PRECISION)
        acc = tl.dot(hi, ho, acc, input_precision=PRECISION)
    tw = tl.load(tw_ptr + pair, mask=p_ok, other=0.0).to(tl.float32)
    out = acc * tl.load(g_ptr + e) * tw[None, :]
    ptr = out_ptr + tl.where(p_ok, pair, 0)[None, :].to(tl.int64) * stride_out + n[:, None]
    tl.store(ptr, out, mask=n_ok[:, None] & p_ok[None, :])
