"""Tensor-core NVFP4 decode kernels for 16-bit activations on CUDA GPUs (W4A16: weights
decoded in registers, fp16 or bf16 products accumulated in float32 by `mma.m16n8k16`).

Why: the CUDA-core decode (`nvfp4_jit.gate_up_decode`) issues ~5.5 instructions per weight,
of which the multiply-add is one and turning a nibble into a float32 three. Here a warp's
`mma` consumes 256 weights per instruction and a weight becomes an fp16 value in ~1.4
instructions: gate_up's loop issues 2.4 instructions per weight, down's 3-3.5
(`bench/nvfp4_sass.py`). float32 activations keep the CUDA-core kernels (products exact in
float32); these serve bf16 and fp16 ones.

Fragments. A warp computes a 16-row tile of the output; lane (g, t) = (lane / 4, lane % 4)
holds rows g and g + 8. The mma's K order within a 16-input step is free as long as A
(weights) and B (activations) agree, so each lane takes 8 *consecutive* inputs of its two
rows per int32 word, straight from the checkpoint's bytes (no repacked copy of the weights):
a chunk of 32 V inputs gives lane t the words t V .. t V + V - 1 of each row, and every word
is one inside one 16-input scale group. Of a word's bytes b0..b3 (element 2j in the low
nibble of b_j) the decoder builds four fp16 pairs, inputs (0, 4), (2, 6), (1, 5) and
(3, 7): two mma steps per word. The activations are stored in that order by
`to_fragments`, fp16, scaled per token by a power of two that keeps them in fp16's range:
exact for bf16 inputs down to 2^-29 of the row's largest magnitude (fp16 keeps 11
significant bits, bf16 has 8; smaller ones lose bits as fp16 subnormals).

Decode. An e2m1 code `s e1 e0 m` at fp16 bits 15 and 11..9 is the fp16 number e2m1 * 2^-14
exactly (codes 0 and 1 on subnormals). A word's high nibbles are placed for both pairs they
feed by one bit-select of the word and the word shifted right by 3 (signs from the first,
magnitudes from the second), then a mask (and a shift by 8 for the even bytes); the low
nibbles likewise after a shift by 4: 11 instructions per 8 weights. The block scale pair of
rows (g, g + 8) converts with `cvt.rn.f16x2.e4m3x2` and is multiplied by 2^7, so that
e2m1 * 2^-14 * e4m3 * 2^7 (at most 6 significant bits, between 2^-17 and 21) is exact in fp16.
bf16 operands (down on gate_up's h): the code at bf16 bits 15 and 8..6 is e2m1 * 2^-126
exactly (codes 0 and 1 on subnormals); sign and magnitude are 6 bits apart for every
nibble, so one bit-select of the word and the word shifted right by 6 places the odd
bytes' nibbles (the low ones after a shift by 4), and one of the word shifted left by 8
and by 2 the even bytes': 11 instructions per 8 weights again. The scales become
e4m3 * 2^100 in bf16 (through fp16 and float32, exact), so that the products are normal
bf16 numbers (2^-36 .. 2^-15), exact, and the sums are multiplied by 2^26.

h between gate_up and down: gate_up stores h (already times the routing weight and down's
global scale) as bf16 fragments, rounded to nearest even (8 significant bits, as the
model's own h and the prefill kernels'; bf16 needs no scale, so no program waits for
another), and down, whose weights then decode to bf16, walks all of a token's slots as one
float32 dot product. An earlier design kept h in fp16 with one power-of-two scale per token,
set by the last of the token's gate_up programs (an atomic count per token): the count's
fences and that program's conversion cost 6 us of 79 at TP 1 / 16 tokens on an H200.

Registers. The weight bytes in flight, what a decode launch is bound by, are the warps an SM
runs times the two steps each loads ahead, and registers bound the warps. So a lane's V word
positions of a chunk are one PTX block chained through one accumulator (4 float32 per gate
or up, not 4 V), the token's fragments load in the step that uses them (every warp reads
the same row: L1 hits; only the weights run ahead), and launches with whole row tiles,
whole chunks and an even K split load without masks. On sm_90 gate_up holds 102-104
registers with triton 3.6 and 3.8 (16 warps per SM), down 56-96 (`bench/nvfp4_sass.py`).

Launches (PDL). On sm_90+ gate_up and down are launched with programmatic dependent launch
and every kernel here lets the next one launch as it starts (`_launch_next`): a kernel's
programs then start while the previous kernel finishes, load their first two steps of
weights, and wait (`_grid_wait`) before they read the activations or h or write anything.
"""

from __future__ import annotations

import triton
import triton.language as tl

# `use_interpreter` reloads nvfp4_jit before this module, so these are interpreted with it
from freetoken.kernels.nvfp4_jit import _e4m3_low, _fp4_word, _sum

FP16_MAX_EXP = tl.constexpr(15)
"""Activations are scaled by 2^-e so that their largest magnitude is below 2^15."""
W_BIAS_EXP = tl.constexpr(7)
"""Decoded weights are e2m1 * e4m3 * 2^-7: outputs are multiplied by 2^(7 + e)."""

BF16_SCALE_EXP = 100
"""bf16 decode: block scales are e4m3 * 2^100, so that e2m1 * 2^-126 (the decoded nibble)
times a scale is a normal bf16 (2^-36 .. 2^-15) and exact; outputs are multiplied by 2^26."""
BF16_OUT = tl.constexpr(2.0 ** (126 - BF16_SCALE_EXP))
"""What the bf16 mma's sums are multiplied by."""

_M = 0x8E008E00     # fp16 sign bit and e2m1 magnitude bits (15, 11..9) of both halves
_MB = 0x81C081C0    # bf16 sign bit and e2m1 magnitude bits (15, 8..6) of both halves
_SEL = 0xE4         # lop3 table of (a & c) | (b & ~c)


def mma_operands(v: int) -> dict[str, list[int]]:
    """Operand numbers of `_mma_asm(v)`: out (the accumulator out, 4 float32), wg / wh (the
    v int32 words of rows g / g + 8), scales (one per 16-input group of the lane's words:
    rows g and g + 8's scale bytes in bits 0..7 and 8..15), b0 / b1 (per word, the int64
    activation pairs of inputs (0, 4), (2, 6) and of (1, 5), (3, 7)), acc (4 float32 in)."""
    groups = max(1, v // 2)
    first = {"wg": 4, "wh": 4 + v, "scales": 4 + 2 * v, "b0": 4 + 2 * v + groups,
             "b1": 4 + 3 * v + groups, "acc": 4 + 4 * v + groups}
    sizes = {"wg": v, "wh": v, "scales": groups, "b0": v, "b1": v, "acc": 4}
    return {"out": [0, 1, 2, 3], **{k: list(range(first[k], first[k] + sizes[k]))
                                    for k in first}}


def _mma_asm(v: int = 1, bf16: bool = False) -> str:
    """PTX for a lane's v word positions of one chunk (operands: `mma_operands`): each word
    position's two mma steps, chained through one accumulator (word i takes scale i / 2).
    fp16 operands (weights e2m1 * e4m3 * 2^-7), or with `bf16` bf16 ones (weights
    e2m1 * e4m3 * 2^(BF16_SCALE_EXP - 126))."""
    ops = mma_operands(v)

    def decode_fp16(word: str, r02h: str, r13h: str, r02l: str, r13l: str) -> list[str]:
        return [
            f"shr.b32 t, {word}, 3;",
            f"lop3.b32 u, {word}, t, {0x80808080 - (1 << 32)}, {_SEL};",
            f"and.b32 {r13h}, u, {_M - (1 << 32)};",
            "shl.b32 u, u, 8;",
            f"and.b32 {r02h}, u, {_M - (1 << 32)};",
            f"shl.b32 v, {word}, 4;",
            f"shl.b32 t, {word}, 1;",
            f"lop3.b32 u, v, t, {0x80808080 - (1 << 32)}, {_SEL};",
            f"and.b32 {r13l}, u, {_M - (1 << 32)};",
            "shl.b32 u, u, 8;",
            f"and.b32 {r02l}, u, {_M - (1 << 32)};",
        ]

    def decode_bf16(word: str, r02h: str, r13h: str, r02l: str, r13l: str) -> list[str]:
        # a nibble's sign goes to bit 15 of its half and its magnitude to bits 8..6: 6 bits
        # apart for every nibble, so one select of (word, word >> 6) places the odd bytes'
        # nibbles (the low ones 4 bits down), and one of (word << 8, word << 2) the even ones'
        sel = f"{0x88008800 - (1 << 32)}, {_SEL}"
        m = f"{_MB - (1 << 32)}"
        return [
            f"shr.b32 t, {word}, 6;",
            f"lop3.b32 u, {word}, t, {sel};",
            f"and.b32 {r13h}, u, {m};",
            "shl.b32 u, u, 4;",
            f"and.b32 {r13l}, u, {m};",
            f"shl.b32 v, {word}, 8;",
            f"shl.b32 t, {word}, 2;",
            f"lop3.b32 u, v, t, {sel};",
            f"and.b32 {r02h}, u, {m};",
            "shl.b32 u, u, 4;",
            f"and.b32 {r02l}, u, {m};",
        ]

    decode = decode_bf16 if bf16 else decode_fp16
    kind = "bf16" if bf16 else "f16"
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32"
    out = "{" + ", ".join(f"${n}" for n in ops["out"]) + "}"
    acc = "{" + ", ".join(f"${n}" for n in ops["acc"]) + "}"
    scales = range(len(ops["scales"]))
    lines = [
        ".reg .b32 t, u, v, ga, gb, gc, gd, ha, hb, hc, hd, sf, k;",
        ".reg .b32 " + ", ".join(f"sg{j}, sh{j}" for j in scales) + ";",
        ".reg .b16 q, lo, hi;",
        ".reg .f32 fa, fb;",
        ".reg .b32 b0, b1, b2, b3;",
        # fp16: (2^7, 2^7), the scales' factor; bf16: (-0, -0), the products' addend
        "mov.b32 k, 0x80008000;" if bf16 else "mov.b32 k, 0x58005800;",
    ]
    for j, n in zip(scales, ops["scales"]):
        lines += [f"cvt.u16.u32 q, ${n};", "cvt.rn.f16x2.e4m3x2 sf, q;"]
        if bf16:
            # e4m3 * 2^BF16_SCALE_EXP, exact: fp16, float32, scaled, bf16 (4 significant bits)
            lines += ["mov.b32 {lo, hi}, sf;", "cvt.f32.f16 fa, lo;", "cvt.f32.f16 fb, hi;",
                      f"mul.f32 fa, fa, 0f{(BF16_SCALE_EXP + 127) << 23:08X};",
                      f"mul.f32 fb, fb, 0f{(BF16_SCALE_EXP + 127) << 23:08X};",
                      f"cvt.rn.bf16x2.f32 sg{j}, fa, fa;", f"cvt.rn.bf16x2.f32 sh{j}, fb, fb;"]
        else:
            lines += ["mul.rn.f16x2 sf, sf, k;", "mov.b32 {lo, hi}, sf;",
                      f"mov.b32 sg{j}, {{lo, lo}};", f"mov.b32 sh{j}, {{hi, hi}};"]
    # bf16 products by fma with -0 (mul.bf16x2 needs sm_90; fma.bf16x2 runs on sm_80+)
    scale_op = ("fma.rn.bf16x2 {r}, {r}, {s}, k;" if bf16
                else "mul.rn.f16x2 {r}, {r}, {s};")
    for i in range(v):
        lines += [f"mov.b64 {{b0, b1}}, ${ops['b0'][i]};", f"mov.b64 {{b2, b3}}, ${ops['b1'][i]};"]
        lines += decode(f"${ops['wg'][i]}", "ga", "gb", "gc", "gd")
        lines += decode(f"${ops['wh'][i]}", "ha", "hb", "hc", "hd")
        lines += [scale_op.format(r=r, s=f"sg{i // 2}") for r in ("ga", "gb", "gc", "gd")]
        lines += [scale_op.format(r=r, s=f"sh{i // 2}") for r in ("ha", "hb", "hc", "hd")]
        lines += [f"{mma} {out}, {{gc, hc, gd, hd}}, {{b0, b1}}, {acc if i == 0 else out};",
                  f"{mma} {out}, {{ga, ha, gb, hb}}, {{b2, b3}}, {out};"]
    return "{\n" + "\n".join(lines) + "\n}"


def _mma_constraints(v: int) -> str:
    ops = mma_operands(v)
    return ",".join(["=f"] * 4 + ["r"] * (2 * v + len(ops["scales"])) + ["l"] * (2 * v)
                    + ["f"] * 4)


_MMA_ASM_1 = tl.constexpr(_mma_asm(1))
_MMA_ASM_2 = tl.constexpr(_mma_asm(2))
_MMA_ASM_4 = tl.constexpr(_mma_asm(4))
_MMA_ASM_BF16_1 = tl.constexpr(_mma_asm(1, bf16=True))
_MMA_ASM_BF16_2 = tl.constexpr(_mma_asm(2, bf16=True))
_MMA_ASM_BF16_4 = tl.constexpr(_mma_asm(4, bf16=True))
_MMA_CONSTRAINTS_1 = tl.constexpr(_mma_constraints(1))
_MMA_CONSTRAINTS_2 = tl.constexpr(_mma_constraints(2))
_MMA_CONSTRAINTS_4 = tl.constexpr(_mma_constraints(4))


@triton.jit
def _frag_pos(k, V: tl.constexpr):
    """Where input k of a row goes in the fragment order of chunks of 32 V inputs, in fp16
    units: lane t's V words of a chunk, each word's inputs as the int64s ((0, 4), (2, 6))
    then ((1, 5), (3, 7)) that `_b_tile` loads (the first of each word position's steps, then
    the second)."""
    c = k // (32 * V)
    rem = k % (32 * V)
    t = rem // (8 * V)
    rem = rem % (8 * V)
    i = rem // 8
    q = rem % 8
    return 2 * ((c * 4 + t) * 4 * V + (q & 1) * 2 * V + i * 2 + ((q >> 1) & 1)) + (q >> 2)


@triton.jit
def _max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def _pow2(e):
    """2^e as float32 for int32 e in the normal range."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _exponent(amax):
    """e with amax * 2^-e < 2^15 (and >= 2^14 for amax > 0, unless amax < 2^-86, where e stops
    at -100 so that 2^-e stays a float32); 0 for amax == 0."""
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 + 1 - FP16_MAX_EXP
    return tl.where(amax > 0, tl.maximum(e, -100), 0)


@triton.jit
def to_fragments(x_ptr, x16_ptr, xf_ptr, k_inputs, stride_x, stride_x16, V: tl.constexpr,
                 BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    """Row t of x as fp16 fragments (`_frag_pos`) scaled by 2^-e, e per row; xf[t] = 2^(7 + e)
    undoes both biases. Inputs past k_inputs up to the row's padded length (<= BLOCK) are
    zeros."""
    _launch_next(PDL)
    t = tl.program_id(0)
    k = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + t.to(tl.int64) * stride_x + k, mask=k < k_inputs, other=0.0)
    x = x.to(tl.float32)
    e = _exponent(_max(tl.abs(x), 0))
    padded = (k_inputs + 32 * V - 1) // (32 * V) * (32 * V)
    tl.store(x16_ptr + t.to(tl.int64) * stride_x16 + _frag_pos(k, V),
             (x * _pow2(-e)).to(tl.float16), mask=k < padded)
    tl.store(xf_ptr + t, _pow2(e + W_BIAS_EXP))


@triton.jit
def _lanes(NW: tl.constexpr, S: tl.constexpr):
    """Per tensor row r (one per thread: lane r % 32 of warp r / 32): g, t, row tile, K split."""
    r = tl.arange(0, 32 * NW)
    lane = r % 32
    warp = r // 32
    return lane // 4, lane % 4, warp // S, warp % S


@triton.jit
def _grid_wait(PDL: tl.constexpr):
    """With programmatic dependent launch (PDL 1, sm_90+): wait until the stream's previous
    kernel has finished and its writes are visible. Loads before it may only read what no
    kernel in flight writes (weights, routing ids)."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _launch_next(PDL: tl.constexpr):
    """With PDL: the stream's next kernel may start once every program of this one got here
    (its programs take SMs that this kernel's last ones leave idle, and wait in `_grid_wait`)."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _rows_tile(w_ptr, s_ptr, we, se, row, lim, live, c, t, k_words, stride_wn, stride_sn,
               V: tl.constexpr, FULL: tl.constexpr):
    """int32 words [R, V] of weight rows `row` and `row + 8` (valid below `lim`, where `live`)
    of the expert at word offset `we` (scale byte offset `se`; scalars or per row) for chunk
    c (lane t's words c 4V + t V + i), and the block scale bytes [R, max(1, V / 2)] of the
    groups they span in both rows, packed as (row) | (row + 8) << 8 (word i in group i / 2;
    a row's are one load). FULL: every row and word exists and is live, nothing masked."""
    i = tl.arange(0, V)
    kw0 = c * (4 * V) + t * V
    kw = kw0[:, None] + i[None, :]
    ok_g1 = (row < lim) & live & (kw0 < k_words)          # [R]: rows g, g + 8 and the
    ok_h1 = (row + 8 < lim) & live & (kw0 < k_words)      # lane's first word
    ok_g = ok_g1[:, None] & (kw < k_words)
    ok_h = ok_h1[:, None] & (kw < k_words)
    base = w_ptr + (we + row.to(tl.int64) * stride_wn)[:, None] + kw
    if V >= 4:
        j = tl.arange(0, V // 2)
        grp = tl.multiple_of(kw0 // 2, V // 2)[:, None] + j[None, :]
        sb = s_ptr + (se + row.to(tl.int64) * stride_sn)[:, None] + grp
        ok_sg = ok_g1[:, None]
        ok_sh = ok_h1[:, None]
    else:
        sb = s_ptr + se + row.to(tl.int64) * stride_sn + kw0 // 2
        ok_sg = ok_g1
        ok_sh = ok_h1
    if FULL:
        wg = tl.load(base)
        wh = tl.load(base + 8 * stride_wn)
        sg = tl.load(sb).to(tl.int32)
        sh = tl.load(sb + 8 * stride_sn).to(tl.int32)
    else:
        wg = tl.load(base, mask=ok_g, other=0)
        wh = tl.load(base + 8 * stride_wn, mask=ok_h, other=0)
        sg = tl.load(sb, mask=ok_sg, other=0).to(tl.int32)
        sh = tl.load(sb + 8 * stride_sn, mask=ok_sh, other=0).to(tl.int32)
    sc = sg | (sh << 8)
    if V < 4:
        sc = sc[:, None]
    return wg, wh, sc


@triton.jit
def _b_tile(b_ptr, c, t, live, k_words, V: tl.constexpr, FULL: tl.constexpr):
    """Activation fragments of chunk c for lane t from the fragment-ordered fp16 row `b_ptr`
    (as int64): the two fp16 pairs of each mma step in one int64, so that they load into the
    register pair the mma reads; (first steps, second steps) of the V word positions, [R, V]
    each. Every lane loads its column's row (lanes of other columns only feed mma columns
    that are never read); zeros past k_words or where not `live` [R] (unless FULL)."""
    i = tl.arange(0, V)
    off = ((c * 4 + t) * (2 * V))[:, None] + i[None, :]
    if FULL:
        return tl.load(b_ptr + off), tl.load(b_ptr + off + V)
    ok = live[:, None] & (((c * (4 * V) + t * V)[:, None] + i[None, :]) < k_words)
    return (tl.load(b_ptr + off, mask=ok, other=0), tl.load(b_ptr + off + V, mask=ok, other=0))


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
def _mma(acc, w, b, NW: tl.constexpr, ASM: tl.constexpr, BF16: tl.constexpr = 0):
    """acc (4 float32 [R]) += the mma of weight words w = (wg [R, V], wh [R, V], scales
    [R, G]) and fragments b (2 int64 [R, V]; fp16, or bf16 with BF16): the PTX (ASM 1), or
    its emulation over the whole tensor (ASM 0: Triton's interpreter, which runs a program's
    NW warps as one tensor and cannot run PTX)."""
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
    e2m1 = _fp4_word(word[:, :, None] >> (4 * tl.arange(0, 8))[None, None, :], 0)
    # e2m1 * 2^-14 times e4m3 * 2^-8, times 2^15: e2m1 * e4m3 * 2^-7, exact in float32
    return e2m1 * _e4m3_low(scale[:, :, None]) * 32768.0


@triton.jit
def _mma_portable(acc, w, b, NW: tl.constexpr, BF16: tl.constexpr):
    """`_mma_asm` as tensor arithmetic: lane (g, t) of warp W is tensor row 32 W + 4 g + t;
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
        wg = wg * (128.0 / BF16_OUT)
        wh = wh * (128.0 / BF16_OUT)
    # the int64 pairs hold inputs (0, 4, 2, 6) and (1, 5, 3, 7): back to input order q =
    # 4 i2 + 2 i1 + i0 (each join adds a last axis: the innermost join's ends up first, i2)
    even = tl.join(tl.join(_half(b[0], 0, BF16), _half(b[0], 16, BF16)),
                   tl.join(_half(b[0], 32, BF16), _half(b[0], 48, BF16)))
    odd = tl.join(tl.join(_half(b[1], 0, BF16), _half(b[1], 16, BF16)),
                  tl.join(_half(b[1], 32, BF16), _half(b[1], 48, BF16)))
    x = tl.reshape(tl.join(even, odd), (NW, 1, 8, 4, V, 8))
    out = ()
    for rows in tl.static_range(2):
        a = tl.reshape(wh if rows else wg, (NW, 8, 1, 4, V, 8))
        d = _sum(_sum(a * x, 5), 3)                         # [NW, g, n, V]
        d = tl.permute(tl.reshape(d, (NW, 8, 4, 2, V)), (0, 1, 2, 4, 3))
        even, odd = tl.split(d)                             # columns 2t, 2t + 1
        out = out + (_sum(tl.reshape(even, (R, V)), 1), _sum(tl.reshape(odd, (R, V)), 1))
    return (acc[0] + out[0], acc[1] + out[1], acc[2] + out[2], acc[3] + out[3])


@triton.jit
def _tile_sum(d, TILES: tl.constexpr, S: tl.constexpr):
    """[R] accumulator -> [TILES, 32]: summed over the K splits."""
    return _sum(tl.reshape(d, (TILES, S, 32)), 1)


@triton.jit
def _gu_load(w, s, b_row, row, inter, step, split, t, k_words, stride_wn, stride_sn,
             V: tl.constexpr, S: tl.constexpr, FULL: tl.constexpr):
    """Gate rows and up rows of step `step` (chunk step S + split), and the chunk. FULL:
    every step of the warps is a whole chunk of whole row tiles, and the loads ahead of the
    last step re-read the last chunk (never used) instead of being masked."""
    c = step * S + split
    if FULL:
        c = tl.minimum(c, k_words // (4 * V) - 1)
    live = t >= 0
    return (_rows_tile(w, s, 0, 0, row, inter, live, c, t, k_words, stride_wn, stride_sn, V,
                       FULL),
            _rows_tile(w, s, inter * stride_wn, inter * stride_sn, row, inter, live, c, t,
                       k_words, stride_wn, stride_sn, V, FULL),
            c)


@triton.jit
def _gu_step(acc_g, acc_u, buf, b_row, t, k_words, V: tl.constexpr, NW: tl.constexpr,
             ASM: tl.constexpr, FULL: tl.constexpr):
    """The gate and up mma of a loaded step. The token's fragments load here, not with the
    weights two steps ahead: every warp of the SM reads the same row (L1), and registers
    held across steps are what limits the warps an SM runs."""
    b = _b_tile(b_row, buf[2], t, t >= 0, k_words, V, FULL)
    return _mma(acc_g, buf[0], b, NW, ASM), _mma(acc_u, buf[1], b, NW, ASM)


@triton.jit
def gate_up_mma(x16_ptr, xf_ptr, ids_ptr, tw_ptr, w_ptr, s_ptr, g_ptr, g2_ptr, h16_ptr, inter,
                k_words, top_k, stride_x16, stride_we, stride_wn, stride_se, stride_sn,
                stride_h16, V: tl.constexpr, TILES: tl.constexpr, S: tl.constexpr,
                VH: tl.constexpr, ASM: tl.constexpr, FULL: tl.constexpr,
                PDL: tl.constexpr = 0):
    """h[p, n] = silu(gate_e[n] . x_t) * (up_e[n] . x_t) * tw[p] * g2[e] for pair p = (t, slot)
    routed to e, one program per (pair, block of 16 TILES rows); warps split K S ways. h is
    stored as bf16 fragments for down (`_frag_pos` with VH words per lane). PDL: the first
    two steps' weights load before waiting for `to_fragments`."""
    _launch_next(PDL)
    pair = tl.program_id(0)
    tok = pair // top_k
    e = tl.load(ids_ptr + pair).to(tl.int64)
    g, t, tile, split = _lanes(TILES * S, S)
    row = tl.program_id(1) * (16 * TILES) + 16 * tile + g
    w = w_ptr.to(tl.pointer_type(tl.int32)) + e * stride_we
    s = s_ptr + e * stride_se
    b_row = x16_ptr.to(tl.pointer_type(tl.int64)) + tok.to(tl.int64) * (stride_x16 // 4)
    z = tl.full([32 * TILES * S], 0.0, tl.float32)
    acc_g = (z, z, z, z)
    acc_u = (z, z, z, z)
    steps = ((k_words + 4 * V - 1) // (4 * V) + S - 1) // S
    # Loads run two steps ahead in three buffers that the loop body names (as in
    # nvfp4_jit.gate_up_decode). Triton's own pipelining of these loads through shared
    # memory (tl.range num_stages) measured 2-3x slower.
    a = _gu_load(w, s, b_row, row, inter, 0, split, t, k_words, stride_wn, stride_sn, V, S, FULL)
    b = _gu_load(w, s, b_row, row, inter, 1, split, t, k_words, stride_wn, stride_sn, V, S, FULL)
    _grid_wait(PDL)
    for j in range(0, steps - 2, 3):
        c = _gu_load(w, s, b_row, row, inter, j + 2, split, t, k_words, stride_wn, stride_sn,
                     V, S, FULL)
        acc_g, acc_u = _gu_step(acc_g, acc_u, a, b_row, t, k_words, V, TILES * S, ASM, FULL)
        a = _gu_load(w, s, b_row, row, inter, j + 3, split, t, k_words, stride_wn, stride_sn,
                     V, S, FULL)
        acc_g, acc_u = _gu_step(acc_g, acc_u, b, b_row, t, k_words, V, TILES * S, ASM, FULL)
        b = _gu_load(w, s, b_row, row, inter, j + 4, split, t, k_words, stride_wn, stride_sn,
                     V, S, FULL)
        acc_g, acc_u = _gu_step(acc_g, acc_u, c, b_row, t, k_words, V, TILES * S, ASM, FULL)
    # the last steps % 3 steps are loaded (a, then b) but not computed yet
    if steps % 3 >= 1:
        acc_g, acc_u = _gu_step(acc_g, acc_u, a, b_row, t, k_words, V, TILES * S, ASM, FULL)
    if steps % 3 == 2:
        acc_g, acc_u = _gu_step(acc_g, acc_u, b, b_row, t, k_words, V, TILES * S, ASM, FULL)
    # lane (g, t) holds column 2t of rows g (d0) and g + 8 (d2): the pair is column 0
    f = tl.load(xf_ptr + tok)
    fg = f * tl.load(g_ptr + 2 * e)
    fu = f * tl.load(g_ptr + 2 * e + 1)
    scale = tl.load(g2_ptr + e) * tl.load(tw_ptr + pair).to(tl.float32)
    lane = tl.arange(0, 32)[None, :]
    n = tl.program_id(1) * (16 * TILES) + 16 * tl.arange(0, TILES)[:, None] + lane // 4
    keep = (lane % 4) == 0
    h_out = h16_ptr.to(tl.pointer_type(tl.int16)) + pair.to(tl.int64) * stride_h16
    for half in tl.static_range(2):
        gate = _tile_sum(acc_g[2 * half], TILES, S) * fg
        up = _tile_sum(acc_u[2 * half], TILES, S) * fu
        h = gate / (1.0 + tl.exp(-gate)) * up * scale
        rows = n + 8 * half
        tl.store(h_out + _frag_pos(rows, VH), _bf16_bits(h), mask=keep & (rows < inter))


@triton.jit
def _bf16_bits(x):
    """float32 x rounded to bf16 (to nearest, ties to even; NaN stays NaN), as int16 bits:
    the rounding spelled out, since Triton's interpreter truncates `.to(tl.bfloat16)`."""
    b = x.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, r).to(tl.int16)


@triton.jit
def _down_slot(tok, top_k, q, CHUNKS: tl.constexpr, FULL: tl.constexpr):
    """(pair, live, chunk) of walk step q (per tensor row): slot q / CHUNKS, chunk q % CHUNKS;
    not live past the last slot, or with FULL, where every step of the warps is a whole chunk
    of whole row tiles, the last step's again."""
    if FULL:
        q = tl.minimum(q, top_k * CHUNKS - 1)
    slot = q // CHUNKS
    return tok * top_k + tl.minimum(slot, top_k - 1), slot < top_k, q % CHUNKS


@triton.jit
def _down_weights(ids_ptr, w_ptr, s_ptr, tok, top_k, q, row, n_rows, t, k_words, stride_we,
                  stride_wn, stride_se, stride_sn, V: tl.constexpr, CHUNKS: tl.constexpr,
                  FULL: tl.constexpr):
    """Weights of walk step q (zeros where not live)."""
    p, live, c = _down_slot(tok, top_k, q, CHUNKS, FULL)
    e = tl.load(ids_ptr + p).to(tl.int64)
    return _rows_tile(w_ptr, s_ptr, e * stride_we, e * stride_se, row, n_rows, live, c, t,
                      k_words, stride_wn, stride_sn, V, FULL)


@triton.jit
def _down_acts(h16_ptr, tok, top_k, q, t, k_words, stride_h16, V: tl.constexpr,
               CHUNKS: tl.constexpr, FULL: tl.constexpr):
    """h fragments of walk step q (zeros where not live)."""
    p, live, c = _down_slot(tok, top_k, q, CHUNKS, FULL)
    b_row = h16_ptr.to(tl.pointer_type(tl.int64)) + (p.to(tl.int64) * (stride_h16 // 4))[:, None]
    return _b_tile(b_row, c, t, live, k_words, V, FULL)


@triton.jit
def _down_load(ids_ptr, w_ptr, s_ptr, h16_ptr, tok, top_k, q, row, n_rows, t, k_words,
               stride_we, stride_wn, stride_se, stride_sn, stride_h16, V: tl.constexpr,
               CHUNKS: tl.constexpr, FULL: tl.constexpr):
    """Weights and fragments of walk step q."""
    return (_down_weights(ids_ptr, w_ptr, s_ptr, tok, top_k, q, row, n_rows, t, k_words,
                          stride_we, stride_wn, stride_se, stride_sn, V, CHUNKS, FULL),
            _down_acts(h16_ptr, tok, top_k, q, t, k_words, stride_h16, V, CHUNKS, FULL))


@triton.jit
def down_mma(h16_ptr, hf_ptr, ids_ptr, w_ptr, s_ptr, out_ptr, n_rows, k_words, top_k,
             stride_h16, stride_we, stride_wn, stride_se, stride_sn, stride_out,
             V: tl.constexpr, TILES: tl.constexpr, S: tl.constexpr, CHUNKS: tl.constexpr,
             ASM: tl.constexpr, FULL: tl.constexpr, BF16: tl.constexpr = 0,
             PDL: tl.constexpr = 0):
    """out[t, n] = f * sum over t's slots p (routed to e) of w2_e[n] . h16[p]: one program per
    (token, block of 16 TILES rows) walks all of the token's slots (CHUNKS chunks each) as
    one float32 dot product, its warps taking every S-th step of the walk. h16: bf16
    fragments with BF16 (gate_up's h; f = BF16_OUT), else fp16 ones (f = hf[t]). PDL: the
    first two steps' weights load before waiting for the kernel that writes h16."""
    _launch_next(PDL)
    tok = tl.program_id(0)
    g, t, tile, split = _lanes(TILES * S, S)
    row = tl.program_id(1) * (16 * TILES) + 16 * tile + g
    w = w_ptr.to(tl.pointer_type(tl.int32))
    steps = (top_k * CHUNKS + S - 1) // S
    z = tl.full([32 * TILES * S], 0.0, tl.float32)
    acc = (z, z, z, z)
    wa = _down_weights(ids_ptr, w, s_ptr, tok, top_k, split, row, n_rows, t, k_words,
                       stride_we, stride_wn, stride_se, stride_sn, V, CHUNKS, FULL)
    wb = _down_weights(ids_ptr, w, s_ptr, tok, top_k, split + S, row, n_rows, t, k_words,
                       stride_we, stride_wn, stride_se, stride_sn, V, CHUNKS, FULL)
    _grid_wait(PDL)
    a = (wa, _down_acts(h16_ptr, tok, top_k, split, t, k_words, stride_h16, V, CHUNKS, FULL))
    b = (wb, _down_acts(h16_ptr, tok, top_k, split + S, t, k_words, stride_h16, V, CHUNKS,
                        FULL))
    for j in range(0, steps - 2, 3):
        q = (j + 2) * S + split
        c = _down_load(ids_ptr, w, s_ptr, h16_ptr, tok, top_k, q, row, n_rows, t, k_words,
                       stride_we, stride_wn, stride_se, stride_sn, stride_h16, V, CHUNKS, FULL)
        acc = _mma(acc, a[0], a[1], TILES * S, ASM, BF16)
        a = _down_load(ids_ptr, w, s_ptr, h16_ptr, tok, top_k, q + S, row, n_rows, t, k_words,
                       stride_we, stride_wn, stride_se, stride_sn, stride_h16, V, CHUNKS, FULL)
        acc = _mma(acc, b[0], b[1], TILES * S, ASM, BF16)
        b = _down_load(ids_ptr, w, s_ptr, h16_ptr, tok, top_k, q + 2 * S, row, n_rows, t,
                       k_words, stride_we, stride_wn, stride_se, stride_sn, stride_h16, V,
                       CHUNKS, FULL)
        acc = _mma(acc, c[0], c[1], TILES * S, ASM, BF16)
    if steps % 3 >= 1:
        acc = _mma(acc, a[0], a[1], TILES * S, ASM, BF16)
    if steps % 3 == 2:
        acc = _mma(acc, b[0], b[1], TILES * S, ASM, BF16)
    if BF16:
        f = BF16_OUT
    else:
        f = tl.load(hf_ptr + tok)
    lane = tl.arange(0, 32)[None, :]
    n = tl.program_id(1) * (16 * TILES) + 16 * tl.arange(0, TILES)[:, None] + lane // 4
    keep = (lane % 4) == 0
    out = out_ptr + tok.to(tl.int64) * stride_out
    for half in tl.static_range(2):
        rows = n + 8 * half
        tl.store(out + rows, _tile_sum(acc[2 * half], TILES, S) * f,
                 mask=keep & (rows < n_rows))
