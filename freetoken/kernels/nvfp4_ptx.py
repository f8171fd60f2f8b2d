"""PTX text of the NVFP4 decode kernels' inline assembly, built in Python (no Triton here, so
tests can read and emulate it without importing a kernel module).

- `word_asm`: the CUDA-core decode's word of 8 e2m1 nibbles -> 8 float32 values, by `prmt`
  byte permutes used as 8-entry lookup tables (`BF16_HIGH`, `BF16_LOW`, `SIGN_TABLE`).
- `mma_asm`: the tensor-core decode's lane step: nibbles -> fp16 (or bf16) pairs by bit
  selects, block scales by `cvt.rn.f16x2.e4m3x2`, the activations (in input order) paired
  to match by `prmt`, and `mma.m16n8k16` (operands: `mma_operands`).
  `freetoken.kernels.nvfp4_mma_jit` says why each is exact.
"""

from __future__ import annotations


def imm(value: int) -> str:
    """A 32-bit PTX immediate, written as a signed decimal."""
    return str(value - (1 << 32) if value >= 1 << 31 else value)


def word_asm() -> str:
    """PTX: one int32 word of 8 packed e2m1 nibbles ($8) -> their 8 values as float32 ($0..$7,
    element order), exact. A float32 e2m1 value has its low 16 bits zero, so two `prmt` byte
    lookups give the high and low bytes of its upper half (tables in $9, $10 and $11, $12),
    a third the sign bytes (table $13); one more `prmt` pairs them up, and a shift or a mask
    places each in a float32. 25 instructions per 8 weights."""
    lines = [
        ".reg .b32 m, mh, sg, sl, sh, h0, h1, l0, l1, g0, g1, u;",
        f"and.b32 m, $8, {imm(0x77777777)};",     # magnitude codes, one per nibble
        "shr.u32 mh, m, 16;",                       # codes of nibbles 4-7 at nibbles 0-3
        f"and.b32 sg, $8, {imm(0x88888888)};",    # sign bits
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
            lines += [f"prmt.b32 u, {lo}, {hi}, {imm(sel)};",
                      f"shl.b32 ${out}, u, 16;",
                      f"and.b32 ${out + 1}, u, {imm(0xFFFF0000)};"]
            out += 2
    return "{\n" + "\n".join(lines) + "\n}"


# Bytes of the upper 16 bits of the e2m1 magnitudes 0-7 (0, 0.5, 1, 1.5, 2, 3, 4, 6) as prmt
# tables: byte k of the (codes 0-3, codes 4-7) words is the high (or low) byte for code k.
BF16_HIGH = (0x3F3F3F00, 0x40404040)   # 0x0000 0x3F00 0x3F80 0x3FC0 0x4000 0x4040 0x4080 0x40C0
BF16_LOW = (0xC0800000, 0xC0804000)
SIGN_TABLE = 0x8000                      # selector 1 (negative) -> 0x80

BF16_SCALE_EXP = 100
"""bf16 decode: block scales are e4m3 * 2^100, so that e2m1 * 2^-126 (the decoded nibble)
times a scale is a normal bf16 (2^-36 .. 2^-15) and exact; outputs are multiplied by 2^26."""

# the sign bit and the e2m1 magnitude bits of both halves: fp16 (15, 11..9), bf16 (15, 8..6)
_FP16_NIBBLE_BITS = 0x8E008E00
_BF16_NIBBLE_BITS = 0x81C081C0
_LOP3_SELECT = 0xE4     # lop3 table of (a & c) | (b & ~c)
# prmt selectors of two 16-bit pairs (a, b): the low halves (a0, b0), the high (a1, b1)
_PAIR_LOW = 0x5410
_PAIR_HIGH = 0x7632


def mma_operands(v: int) -> dict[str, list[int]]:
    """Operand numbers of `mma_asm(v)`: out (the accumulator out, 4 float32), wg / wh (the
    v int32 words of rows g / g + 8), scales (one per 16-input group of the lane's words:
    rows g and g + 8's scale bytes in bits 0..7 and 8..15), b0 / b1 (per word, the
    activations of inputs 0..3 and of 4..7 as int64s: four 16-bit values each, in input
    order), acc (4 float32 in)."""
    groups = max(1, v // 2)
    first = {"wg": 4, "wh": 4 + v, "scales": 4 + 2 * v, "b0": 4 + 2 * v + groups,
             "b1": 4 + 3 * v + groups, "acc": 4 + 4 * v + groups}
    sizes = {"wg": v, "wh": v, "scales": groups, "b0": v, "b1": v, "acc": 4}
    return {"out": [0, 1, 2, 3], **{k: list(range(first[k], first[k] + sizes[k]))
                                    for k in first}}


def mma_asm(v: int = 1, bf16: bool = False) -> str:
    """PTX for a lane's v word positions of one chunk (operands: `mma_operands`): each word
    position's two mma steps, chained through one accumulator (word i takes scale i / 2).
    fp16 operands (weights e2m1 * e4m3 * 2^-7), or with `bf16` bf16 ones (weights
    e2m1 * e4m3 * 2^(BF16_SCALE_EXP - 126)). A word's decoded pairs hold inputs (0, 4),
    (2, 6) (the first step) and (1, 5), (3, 7) (the second); four `prmt`s pair the
    activations, given in input order, the same way."""
    ops = mma_operands(v)

    def decode_fp16(word: str, r02h: str, r13h: str, r02l: str, r13l: str) -> list[str]:
        return [
            f"shr.b32 t, {word}, 3;",
            f"lop3.b32 u, {word}, t, {0x80808080 - (1 << 32)}, {_LOP3_SELECT};",
            f"and.b32 {r13h}, u, {_FP16_NIBBLE_BITS - (1 << 32)};",
            "shl.b32 u, u, 8;",
            f"and.b32 {r02h}, u, {_FP16_NIBBLE_BITS - (1 << 32)};",
            f"shl.b32 v, {word}, 4;",
            f"shl.b32 t, {word}, 1;",
            f"lop3.b32 u, v, t, {0x80808080 - (1 << 32)}, {_LOP3_SELECT};",
            f"and.b32 {r13l}, u, {_FP16_NIBBLE_BITS - (1 << 32)};",
            "shl.b32 u, u, 8;",
            f"and.b32 {r02l}, u, {_FP16_NIBBLE_BITS - (1 << 32)};",
        ]

    def decode_bf16(word: str, r02h: str, r13h: str, r02l: str, r13l: str) -> list[str]:
        # a nibble's sign goes to bit 15 of its half and its magnitude to bits 8..6: 6 bits
        # apart for every nibble, so one select of (word, word >> 6) places the odd bytes'
        # nibbles (the low ones 4 bits down), and one of (word << 8, word << 2) the even ones'
        sel = f"{0x88008800 - (1 << 32)}, {_LOP3_SELECT}"
        m = f"{_BF16_NIBBLE_BITS - (1 << 32)}"
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
        ".reg .b32 b0, b1, b2, b3, xa, xb, xc, xd;",
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
        # inputs (0, 1), (2, 3) in xa, xb and (4, 5), (6, 7) in xc, xd -> (0, 4), (2, 6) in
        # b0, b1 and (1, 5), (3, 7) in b2, b3
        lines += [f"mov.b64 {{xa, xb}}, ${ops['b0'][i]};",
                  f"mov.b64 {{xc, xd}}, ${ops['b1'][i]};",
                  f"prmt.b32 b0, xa, xc, {_PAIR_LOW};", f"prmt.b32 b1, xb, xd, {_PAIR_LOW};",
                  f"prmt.b32 b2, xa, xc, {_PAIR_HIGH};", f"prmt.b32 b3, xb, xd, {_PAIR_HIGH};"]
        lines += decode(f"${ops['wg'][i]}", "ga", "gb", "gc", "gd")
        lines += decode(f"${ops['wh'][i]}", "ha", "hb", "hc", "hd")
        lines += [scale_op.format(r=r, s=f"sg{i // 2}") for r in ("ga", "gb", "gc", "gd")]
        lines += [scale_op.format(r=r, s=f"sh{i // 2}") for r in ("ha", "hb", "hc", "hd")]
        lines += [f"{mma} {out}, {{gc, hc, gd, hd}}, {{b0, b1}}, {acc if i == 0 else out};",
                  f"{mma} {out}, {{ga, ha, gb, hb}}, {{b2, b3}}, {out};"]
    return "{\n" + "\n".join(lines) + "\n}"


def mma_constraints(v: int) -> str:
    ops = mma_operands(v)
    return ",".join(["=f"] * 4 + ["r"] * (2 * v + len(ops["scales"])) + ["l"] * (2 * v)
                    + ["f"] * 4)

