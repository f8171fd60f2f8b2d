"""Triton kernels for NVFP4 weights with 16-bit (or fp32) activations, W4A16: weights are
dequantized in registers and every product is accumulated in float32.

Weight layout (ModelOpt): bytes [rows, K / 2] with element 2j in the low nibble of byte j;
block scales e4m3 [rows, K / 16], passed as their raw bytes (uint8) so that no kernel needs
Triton's fp8 types; one float32 global scale per (expert, part).

Decoding without a table: an e2m1 code `s e1 e0 m` placed at fp16 bits 15 and 11..9 is the
fp16 number e2m1 * 2^-14 exactly (codes 0 and 1 land on fp16 subnormals, which fp16 -> fp32
converts exactly, and no float32 subnormal ever appears, so flush-to-zero cannot bite). An
e4m3 byte `s eeee mmm` placed at fp16 bits 15 and 13..7 is e4m3 * 2^-8 the same way. All
arithmetic runs in float32: Triton's interpreter mis-computes bf16 arithmetic, and fp32 is
what the accumulation needs anyway.

Kernels (the MoE ones take a flat list of (token, slot) pairs, pair p = token * top_k + slot):
- `gate_up_decode` / `down_decode`: one program per (pair, block of output rows), resp.
  (token, block of output rows) looping over the token's slots, streaming each expert's weight
  rows once per pair: the few-token path, bound by weight bandwidth.
- `gate_up_prefill` / `down_prefill`: pairs sorted by expert into blocks of BLOCK_M rows, one
  program per (block, block of output rows), tensor-core `tl.dot` on dequantized tiles.
gate_up applies the gate and up global scales separately, then SiLU(gate) * up; down applies
its global scale and the pair's routing weight. A dense NVFP4 linear is `down_*` with one
expert and unit routing weights.
"""

from __future__ import annotations

import triton
import triton.language as tl

# e2m1 nibbles decode to e2m1 * 2^-14; this undoes it, folded into a per-row or per-group
# multiply instead of a per-weight one.
_FP4_UNBIAS = tl.constexpr(16384.0)

# tl.sum and tl.zeros are @jit functions of triton.language, and whether a @jit function is
# interpreted is fixed when its module is imported: triton may have been imported (by
# transformers, say) before TRITON_INTERPRET=1 was set. So only builtins are called here:
# tl.full, and tl.reduce with triton's own sum combiner, which the interpreter recognises by
# identity and runs in numpy (a combiner of ours would run element by element in Python).


@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _fp4_low(b):
    """e2m1 value * 2^-14 of the low nibble of each byte in int32 `b`, as float32."""
    bits = ((b & 0x8) << 12) | ((b & 0x7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _fp4_high(b):
    """e2m1 value * 2^-14 of the high nibble of each byte in int32 `b`, as float32."""
    bits = ((b & 0x80) << 8) | ((b & 0x70) << 5)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3(s):
    """float32 value of e4m3 bytes in int32 `s` (NaN encodings never occur in NVFP4 scales)."""
    bits = ((s & 0x80) << 8) | ((s & 0x7F) << 7)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


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
def _gemv_groups(acc, w_ptr, s_ptr, row, row_ok, grp, g_ok, xe, xo, stride_w, stride_s):
    """acc [rows, groups] += block_scale * (16-input partial dot of each row with x), where
    xe / xo [groups, 8] are x's even / odd inputs; still to be multiplied by 2^14 * global."""
    b, s = _load_tile(w_ptr, s_ptr, row, row_ok, grp, g_ok, stride_w, stride_s)
    part = _sum(_fp4_low(b) * xe[None, :, :] + _fp4_high(b) * xo[None, :, :], axis=2)
    return acc + part * s


@triton.jit
def _x_pairs(x_row, grp, g_ok):
    """Even and odd inputs [groups, 8] of one activation row, as float32."""
    elem = 2 * (grp[:, None] * 8 + tl.arange(0, 8)[None, :])
    xe = tl.load(x_row + elem, mask=g_ok[:, None], other=0.0).to(tl.float32)
    xo = tl.load(x_row + elem + 1, mask=g_ok[:, None], other=0.0).to(tl.float32)
    return xe, xo


@triton.jit
def gate_up_decode(x_ptr, ids_ptr, w_ptr, s_ptr, g_ptr, h_ptr, inter, k_groups, top_k,
                   stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h,
                   BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """h[p, n] = silu(gate_e[n] . x_t) * (up_e[n] . x_t) for pair p = (t, slot), e its expert;
    rows n of w13 are gate, rows inter + n are up."""
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // top_k).to(tl.int64) * stride_x
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    w, s = w_ptr + e * stride_we, s_ptr + e * stride_se
    acc_g = tl.full([BLOCK_N, GROUPS], 0.0, tl.float32)
    acc_u = tl.full([BLOCK_N, GROUPS], 0.0, tl.float32)
    for g0 in range(0, k_groups, GROUPS):
        grp = g0 + tl.arange(0, GROUPS)
        g_ok = grp < k_groups
        xe, xo = _x_pairs(x_row, grp, g_ok)
        acc_g = _gemv_groups(acc_g, w, s, n, n_ok, grp, g_ok, xe, xo, stride_wn, stride_sn)
        acc_u = _gemv_groups(acc_u, w, s, n + inter, n_ok, grp, g_ok, xe, xo, stride_wn,
                             stride_sn)
    gate = _sum(acc_g, axis=1) * (tl.load(g_ptr + 2 * e) * _FP4_UNBIAS)
    up = _sum(acc_u, axis=1) * (tl.load(g_ptr + 2 * e + 1) * _FP4_UNBIAS)
    h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(h_ptr + pair.to(tl.int64) * stride_h + n, h, mask=n_ok)


@triton.jit
def down_decode(h_ptr, ids_ptr, tw_ptr, w_ptr, s_ptr, g_ptr, out_ptr, n_rows, k_groups, top_k,
                stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_out,
                BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """out[t, n] = sum over t's slots of weight_p * global_e * (w2_e[n] . h[p]), p = (t, slot)
    routed to expert e: the top-k sum happens here, in float32, rounded once on store."""
    token = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_rows
    total = tl.full([BLOCK_N], 0.0, tl.float32)
    for slot in range(0, top_k):
        pair = token * top_k + slot
        e = tl.load(ids_ptr + pair).to(tl.int64)
        h_row = h_ptr + pair.to(tl.int64) * stride_h
        w, s = w_ptr + e * stride_we, s_ptr + e * stride_se
        acc = tl.full([BLOCK_N, GROUPS], 0.0, tl.float32)
        for g0 in range(0, k_groups, GROUPS):
            grp = g0 + tl.arange(0, GROUPS)
            g_ok = grp < k_groups
            he, ho = _x_pairs(h_row, grp, g_ok)
            acc = _gemv_groups(acc, w, s, n, n_ok, grp, g_ok, he, ho, stride_wn, stride_sn)
        scale = tl.load(g_ptr + e) * _FP4_UNBIAS * tl.load(tw_ptr + pair).to(tl.float32)
        total += _sum(acc, axis=1) * scale
    tl.store(out_ptr + token.to(tl.int64) * stride_out + n, total, mask=n_ok)


@triton.jit
def _dequant_tiles(w_ptr, s_ptr, row, row_ok, grp, g_ok, stride_w, stride_s,
                   BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, dtype: tl.constexpr):
    """True weight values (without the global scale) of the even and odd inputs,
    [rows, 8 * groups] each in `dtype`. e2m1 * e4m3 has at most 6 significant bits, so the
    cast to bf16 is exact."""
    b, s = _load_tile(w_ptr, s_ptr, row, row_ok, grp, g_ok, stride_w, stride_s)
    s = (s * _FP4_UNBIAS)[:, :, None]
    low = tl.reshape(_fp4_low(b) * s, (BLOCK_N, 8 * GROUPS))
    high = tl.reshape(_fp4_high(b) * s, (BLOCK_N, 8 * GROUPS))
    return low.to(dtype), high.to(dtype)


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
    blk = tl.program_id(0)
    e = tl.load(block_expert_ptr + blk).to(tl.int64)
    if e < 0:
        return
    m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(rows_ptr + m)
    p_ok = pair < num_pairs
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
    gate = acc_g * tl.load(g_ptr + 2 * e)
    up = acc_u * tl.load(g_ptr + 2 * e + 1)
    h = gate / (1.0 + tl.exp(-gate)) * up
    ptr = h_ptr + m[None, :].to(tl.int64) * stride_h + n[:, None]
    tl.store(ptr, h, mask=n_ok[:, None] & p_ok[None, :])


@triton.jit
def down_prefill(h_ptr, rows_ptr, block_expert_ptr, tw_ptr, w_ptr, s_ptr, g_ptr, out_ptr,
                 num_pairs, n_rows, k_groups, stride_h, stride_we, stride_wn, stride_se,
                 stride_sn, stride_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 GROUPS: tl.constexpr, PRECISION: tl.constexpr):
    """Like `down_decode` for BLOCK_M sorted rows of one expert; h row r belongs to pair
    rows[r], and out is written by pair."""
    blk = tl.program_id(0)
    e = tl.load(block_expert_ptr + blk).to(tl.int64)
    if e < 0:
        return
    m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(rows_ptr + m)
    p_ok = pair < num_pairs
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
