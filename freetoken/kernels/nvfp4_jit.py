"""Triton kernels for NVFP4 weights with 16-bit (or fp32) activations, W4A16: weights are
dequantized in registers and every product is accumulated in float32.

Weight layout (ModelOpt): bytes [rows, K / 2] with element 2j in the low nibble of byte j;
block scales e4m3 [rows, K / 16], passed as their raw bytes (uint8) so that no kernel needs
Triton's fp8 types; one float32 global scale per (expert, part).

Decode dequantization (`_dequant`, on 2-D tiles [rows, KB bytes]), two implementations with
identical results (an e2m1 value times an e4m3 block scale has at most 6 significant bits,
so it is exact in bf16 and fp16):
- PTX (`ASM` 1: bf16, 2: fp16; compute capability 8.9+): per 4 bytes, `prmt` byte permutes
  used as 8-entry lookup tables give the 16-bit magnitudes of all 8 nibbles, a third `prmt`
  the sign bytes, `cvt.rn.f16x2.e4m3x2` the block scales, and one packed multiply per 2
  weights applies them: about 3.5 instructions per weight.
- portable (`ASM` 0: the interpreter, fp32 activations, older GPUs; also the prefill path):
  an e2m1 code `s e1 e0 m` placed at fp16 bits 15 and 11..9 is the fp16 number e2m1 * 2^-14
  exactly (codes 0 and 1 land on fp16 subnormals, which fp16 -> fp32 converts exactly, and
  no float32 subnormal ever appears, so flush-to-zero cannot bite); an e4m3 byte `s eeee
  mmm` at fp16 bits 15 and 13..7 is e4m3 * 2^-8 the same way. All arithmetic runs in float32:
  Triton's interpreter mis-computes bf16 arithmetic.

Kernels (the MoE ones take a flat list of (token, slot) pairs, pair p = token * top_k + slot):
- `gate_up_decode` / `down_decode` (few tokens): GEMVs on CUDA cores, one program per (pair,
  block of output rows), weights loaded two K-steps ahead of their use. gate_up splits K
  over programs when there are too few of them (small TP-local experts, one or two tokens);
  `silu_mul_splits` then adds the splits in order. down writes a float32 partial row per
  pair and `sum_slots` adds a token's slots in slot order (with top_k 1 down writes the
  output directly): deterministic, and no program walks a token's slots one after another.
- `gate_up_prefill` / `down_prefill` (many tokens): pairs sorted by expert into blocks of
  BLOCK_M rows, one program per (block, block of output rows), tensor-core `tl.dot` on
  dequantized tiles.
gate_up applies the gate and up global scales separately, then SiLU(gate) * up; down applies
its global scale and the pair's routing weight. A dense NVFP4 linear is `down_*` with one
expert and unit routing weights.
"""

from __future__ import annotations

import triton
import triton.language as tl

# e2m1 nibbles decode to e2m1 * 2^-14 (portable path); this undoes it in the block scale.
_FP4_UNBIAS = tl.constexpr(16384.0)

# tl.sum and tl.zeros are @jit functions of triton.language, and whether a @jit function is
# interpreted is fixed when its module is imported: triton may have been imported (by
# transformers, say) before TRITON_INTERPRET=1 was set. So only builtins are called here:
# tl.full, and tl.reduce with triton's own combiners, which the interpreter recognises by
# identity and runs in numpy (a combiner of ours would run element by element in Python).


def _imm(value: int) -> str:
    """A 32-bit PTX immediate, written as a signed decimal."""
    return str(value - (1 << 32) if value >= 1 << 31 else value)


def _lut_asm(high_a: int, high_b: int, low: tuple[int, int] | None, scale: list[str],
             mul: str) -> str:
    """PTX for 4 packed bytes ($4) and their 4 block-scale bytes ($5) -> the 4 low-nibble
    weights ($0, $1) and the 4 high-nibble weights ($2, $3), 16-bit pairs in byte order.
    `high_a`/`high_b`: high bytes of the 16-bit magnitudes of codes 0-3 / 4-7 (byte k of
    the word = code k); `low`: the same for the low bytes (None: all zero); `scale`: PTX
    leaving the scales of bytes (0, 1) in `sa` and of bytes (2, 3) in `sb`; `mul` the packed
    multiply-add (with -0 added: exact)."""
    lines = [
        ".reg .b32 m, mh, sg, sl, sh, h0, h1, l0, l1, g0, g1, sa, sb, nz, t;",
        ".reg .b16 q01, q23, f0, f1, f2, f3;",
        ".reg .f32 c0, c1, c2, c3;",
        f"and.b32 m, $4, {_imm(0x77777777)};",     # magnitude codes, one per nibble
        "shr.u32 mh, m, 16;",                       # codes of nibbles 4-7 at nibbles 0-3
        f"and.b32 sg, $4, {_imm(0x88888888)};",    # sign bits
        "shr.u32 sl, sg, 3;",                       # signs of nibbles 0-3 as selectors 0/1
        "shr.u32 sh, sg, 19;",                      # signs of nibbles 4-7
        f"prmt.b32 h0, {_imm(high_a)}, {_imm(high_b)}, m;",
        f"prmt.b32 h1, {_imm(high_a)}, {_imm(high_b)}, mh;",
        f"prmt.b32 g0, {_imm(0x8000)}, 0, sl;",    # 0x80 where negative
        f"prmt.b32 g1, {_imm(0x8000)}, 0, sh;",
        "or.b32 h0, h0, g0;",
        "or.b32 h1, h1, g1;",
    ]
    if low is None:
        lines += ["mov.b32 l0, 0;", "mov.b32 l1, 0;"]
    else:
        lines += [f"prmt.b32 l0, {_imm(low[0])}, {_imm(low[1])}, m;",
                  f"prmt.b32 l1, {_imm(low[0])}, {_imm(low[1])}, mh;"]
    lines += ["mov.b32 {q01, q23}, $5;", *scale, f"mov.b32 nz, {_imm(0x80008000)};"]
    # nibbles (0, 2) of l/h pair up as bytes (0, 4, 2, 6); nibbles (1, 3) as (1, 5, 3, 7)
    pairs = (("l0", "h0", 0x6240, "sa"), ("l1", "h1", 0x6240, "sb"),
             ("l0", "h0", 0x7351, "sa"), ("l1", "h1", 0x7351, "sb"))
    for out, (lo, hi, sel, s) in enumerate(pairs):
        lines += [f"prmt.b32 t, {lo}, {hi}, {sel};", f"{mul} ${out}, t, {s}, nz;"]
    return "{\n" + "\n".join(lines) + "\n}"


# 16-bit magnitudes of e2m1 codes 0-7 (0, 0.5, 1, 1.5, 2, 3, 4, 6) as prmt tables: byte k of
# the (codes 0-3, codes 4-7) words is the high (or low) byte for code k.
BF16_HIGH = (0x3F3F3F00, 0x40404040)   # 0x0000 0x3F00 0x3F80 0x3FC0 0x4000 0x4040 0x4080 0x40C0
BF16_LOW = (0xC0800000, 0xC0804000)
FP16_HIGH = (0x3E3C3800, 0x46444240)   # 0x0000 0x3800 0x3C00 0x3E00 0x4000 0x4200 0x4400 0x4600
# bf16 scales: e4m3 -> f16 (exact) -> f32 -> bf16 (exact).
_BF16_ASM = tl.constexpr(_lut_asm(
    *BF16_HIGH, BF16_LOW,
    ["cvt.rn.f16x2.e4m3x2 sa, q01;", "cvt.rn.f16x2.e4m3x2 sb, q23;",
     "mov.b32 {f0, f1}, sa;", "mov.b32 {f2, f3}, sb;",
     "cvt.f32.f16 c0, f0;", "cvt.f32.f16 c1, f1;", "cvt.f32.f16 c2, f2;", "cvt.f32.f16 c3, f3;",
     "cvt.rn.bf16x2.f32 sa, c1, c0;", "cvt.rn.bf16x2.f32 sb, c3, c2;"],
    "fma.rn.bf16x2"))
_FP16_ASM = tl.constexpr(_lut_asm(
    *FP16_HIGH, None, ["cvt.rn.f16x2.e4m3x2 sa, q01;", "cvt.rn.f16x2.e4m3x2 sb, q23;"],
    "fma.rn.f16x2"))


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
def _load_w(w_ptr, s_ptr, row, row_ok, kb0, k_bytes, stride_w, stride_s, BLOCK_N: tl.constexpr,
            KB: tl.constexpr):
    """Packed bytes [rows, KB] of rows `row` from byte kb0, and their block-scale bytes
    broadcast to the same shape (one load per 16-input group; zeros past k_bytes)."""
    kb = kb0 + tl.arange(0, KB)
    b = tl.load(w_ptr + row[:, None] * stride_w + kb[None, :],
                mask=row_ok[:, None] & (kb < k_bytes)[None, :], other=0)
    g = kb0 // 8 + tl.arange(0, KB // 8)
    s8 = tl.load(s_ptr + row[:, None] * stride_s + g[None, :],
                 mask=row_ok[:, None] & (g < k_bytes // 8)[None, :], other=0)
    s = tl.reshape(tl.broadcast_to(s8[:, :, None], (BLOCK_N, KB // 8, 8)), (BLOCK_N, KB))
    return b, s


@triton.jit
def _dequant(b, s, BLOCK_N: tl.constexpr, KB: tl.constexpr, DTYPE: tl.constexpr,
             ASM: tl.constexpr):
    """Weights (block scale applied, global scale not) of packed bytes `b` [rows, KB] with
    block-scale bytes `s`, as [rows, 2 * KB] in `DTYPE`, in input order."""
    if ASM == 1:
        lo, hi = tl.inline_asm_elementwise(_BF16_ASM, "=r,=r,=r,=r,r,r", [b, s],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                           pack=4)
    elif ASM == 2:
        lo, hi = tl.inline_asm_elementwise(_FP16_ASM, "=r,=r,=r,=r,r,r", [b, s],
                                           dtype=(tl.float16, tl.float16), is_pure=True,
                                           pack=4)
    else:
        bi = b.to(tl.int32)
        scale = _e4m3(s.to(tl.int32)) * _FP4_UNBIAS
        lo = (_fp4_low(bi) * scale).to(DTYPE)
        hi = (_fp4_high(bi) * scale).to(DTYPE)
    return tl.reshape(tl.join(lo, hi), (BLOCK_N, 2 * KB))


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
    low = tl.reshape(_fp4_low(b) * s, (BLOCK_N, 8 * GROUPS))
    high = tl.reshape(_fp4_high(b) * s, (BLOCK_N, 8 * GROUPS))
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
def _gemv_step(acc, b, s, x_row, kb0, k_bytes, BLOCK_N: tl.constexpr, KB: tl.constexpr,
               ASM: tl.constexpr):
    """acc [rows, 2 * KB] += dequantized weights * the matching inputs of one activation row
    (float32 products and sums)."""
    k = 2 * kb0 + tl.arange(0, 2 * KB)
    x = tl.load(x_row + k, mask=k < 2 * k_bytes, other=0.0)
    w = _dequant(b, s, BLOCK_N, KB, x.dtype, ASM)
    return acc + w.to(tl.float32) * x.to(tl.float32)[None, :]


@triton.jit
def gate_up_decode(x_ptr, ids_ptr, w_ptr, s_ptr, g_ptr, h_ptr, gu_ptr, inter, k_bytes, k_split,
                   top_k, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h,
                   stride_gs, stride_gp, BLOCK_N: tl.constexpr, KB: tl.constexpr,
                   ASM: tl.constexpr, SPLIT: tl.constexpr):
    """h[p, n] = silu(gate_e[n] . x_t) * (up_e[n] . x_t) for pair p = (t, slot) routed to e,
    one program per (pair, block of rows, K split), on CUDA cores. SPLIT: the program covers
    packed bytes [k_split * split, ...) only and writes its raw gate and up sums to
    gu[split, p] (columns n and inter + n) for `silu_mul_splits`."""
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // top_k).to(tl.int64) * stride_x
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    k_lo = tl.program_id(2) * k_split
    k_hi = tl.minimum(k_lo + k_split, k_bytes)
    w, s = w_ptr + e * stride_we, s_ptr + e * stride_se
    acc_g = tl.full([BLOCK_N, 2 * KB], 0.0, tl.float32)
    acc_u = tl.full([BLOCK_N, 2 * KB], 0.0, tl.float32)
    # weights are loaded two steps before they are used: their latency hides behind the
    # two steps in between (a GEMV keeps few bytes in flight per SM otherwise)
    bg, sg = _load_w(w, s, n, n_ok, k_lo, k_hi, stride_wn, stride_sn, BLOCK_N, KB)
    bu, su = _load_w(w, s, n + inter, n_ok, k_lo, k_hi, stride_wn, stride_sn, BLOCK_N, KB)
    bg1, sg1 = _load_w(w, s, n, n_ok, k_lo + KB, k_hi, stride_wn, stride_sn, BLOCK_N, KB)
    bu1, su1 = _load_w(w, s, n + inter, n_ok, k_lo + KB, k_hi, stride_wn, stride_sn, BLOCK_N,
                       KB)
    for kb0 in range(k_lo, k_hi, KB):
        bg2, sg2 = _load_w(w, s, n, n_ok, kb0 + 2 * KB, k_hi, stride_wn, stride_sn, BLOCK_N,
                           KB)
        bu2, su2 = _load_w(w, s, n + inter, n_ok, kb0 + 2 * KB, k_hi, stride_wn, stride_sn,
                           BLOCK_N, KB)
        acc_g = _gemv_step(acc_g, bg, sg, x_row, kb0, k_hi, BLOCK_N, KB, ASM)
        acc_u = _gemv_step(acc_u, bu, su, x_row, kb0, k_hi, BLOCK_N, KB, ASM)
        bg, sg, bu, su, bg1, sg1, bu1, su1 = bg1, sg1, bu1, su1, bg2, sg2, bu2, su2
    if SPLIT:
        part = gu_ptr + tl.program_id(2).to(tl.int64) * stride_gs + pair.to(tl.int64) * stride_gp
        tl.store(part + n, _sum(acc_g, 1), mask=n_ok)
        tl.store(part + inter + n, _sum(acc_u, 1), mask=n_ok)
    else:
        h = _silu_mul(_sum(acc_g, 1), _sum(acc_u, 1), g_ptr, e)
        tl.store(h_ptr + pair.to(tl.int64) * stride_h + n, h, mask=n_ok)


@triton.jit
def silu_mul_splits(gu_ptr, ids_ptr, g_ptr, h_ptr, inter, splits, stride_gs, stride_gp,
                    stride_h, BLOCK: tl.constexpr):
    """h[p, n] = silu(g_gate * sum of gate partials) * (g_up * sum of up partials), the
    splits added in order (deterministic)."""
    pair = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_ok = n < inter
    e = tl.load(ids_ptr + pair).to(tl.int64)
    gate = tl.full([BLOCK], 0.0, tl.float32)
    up = tl.full([BLOCK], 0.0, tl.float32)
    for sp in range(0, splits):
        part = gu_ptr + sp * stride_gs + pair.to(tl.int64) * stride_gp
        gate += tl.load(part + n, mask=n_ok, other=0.0)
        up += tl.load(part + inter + n, mask=n_ok, other=0.0)
    h = _silu_mul(gate, up, g_ptr, e)
    tl.store(h_ptr + pair.to(tl.int64) * stride_h + n, h, mask=n_ok)


@triton.jit
def down_decode(h_ptr, ids_ptr, tw_ptr, w_ptr, s_ptr, g_ptr, out_ptr, n_rows, k_bytes, top_k,
                stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_out,
                BLOCK_N: tl.constexpr, KB: tl.constexpr, ASM: tl.constexpr,
                BY_PAIR: tl.constexpr):
    """tw[p] * global_e * (w2_e[n] . h[p]) for pair p routed to e, one program per (pair,
    block of rows), written to out row p (BY_PAIR: float32 partials) or row p // top_k."""
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    h_row = h_ptr + pair.to(tl.int64) * stride_h
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_rows
    w, s = w_ptr + e * stride_we, s_ptr + e * stride_se
    acc = tl.full([BLOCK_N, 2 * KB], 0.0, tl.float32)
    bw, sw = _load_w(w, s, n, n_ok, 0, k_bytes, stride_wn, stride_sn, BLOCK_N, KB)
    bw1, sw1 = _load_w(w, s, n, n_ok, KB, k_bytes, stride_wn, stride_sn, BLOCK_N, KB)
    for kb0 in range(0, k_bytes, KB):
        bw2, sw2 = _load_w(w, s, n, n_ok, kb0 + 2 * KB, k_bytes, stride_wn, stride_sn,
                           BLOCK_N, KB)
        acc = _gemv_step(acc, bw, sw, h_row, kb0, k_bytes, BLOCK_N, KB, ASM)
        bw, sw, bw1, sw1 = bw1, sw1, bw2, sw2
    out = _sum(acc, 1) * (tl.load(g_ptr + e) * tl.load(tw_ptr + pair).to(tl.float32))
    row = pair if BY_PAIR else pair // top_k
    tl.store(out_ptr + row.to(tl.int64) * stride_out + n, out, mask=n_ok)


@triton.jit
def sum_slots(part_ptr, out_ptr, n_rows, top_k, stride_part, stride_out,
              BLOCK: tl.constexpr, TOPK: tl.constexpr):
    """out[t] = the sum of t's top_k partial rows, in slot order (deterministic)."""
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_ok = n < n_rows
    slot = tl.arange(0, TOPK)
    s_ok = slot < top_k
    pair = (t * top_k + slot).to(tl.int64)
    part = tl.load(part_ptr + pair[:, None] * stride_part + n[None, :],
                   mask=s_ok[:, None] & n_ok[None, :], other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_out + n, _sum(part, 0), mask=n_ok)


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
