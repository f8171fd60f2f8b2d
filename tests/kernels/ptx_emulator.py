"""Executes the PTX subset of the NVFP4 kernels' inline assembly on Python ints, since Triton's
interpreter cannot run inline PTX: 32-bit logic and shifts, `prmt` (default mode), `lop3`,
register packing moves, `cvt.rn.f16x2.e4m3x2`, `mul.rn.f16x2`, `fma.rn.bf16x2`, the float32
conversions and multiply of the bf16 scale path, and a warp's
`mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32` (all lanes run in lock
step, so the mma sees every lane's registers, laid out as the PTX ISA's m16n8k16 fragment
figures say). bf16 values go through torch (numpy has no bf16); subnormals are kept."""

from __future__ import annotations

import re

import numpy as np
import torch

MASK = 0xFFFFFFFF


def _f16(bits: int) -> float:
    return float(np.array([bits & 0xFFFF], dtype=np.uint16).view(np.float16)[0])


def _f16_bits(value: float) -> int:
    return int(np.array([value], dtype=np.float16).view(np.uint16)[0])


def _bf16(bits: int) -> float:
    return _f32((bits & 0xFFFF) << 16)


def _bf16_bits(value: float) -> int:
    """value (exact in float32: the results here are) rounded to bf16 (to nearest, ties to
    even), as bits."""
    return int(torch.tensor([value], dtype=torch.float32).to(torch.bfloat16)
               .view(torch.int16).item()) & 0xFFFF


def _f32(bits: int) -> float:
    return float(np.array([bits & MASK], dtype=np.uint32).view(np.float32)[0])


def _f32_bits(value: float) -> int:
    return int(np.array([value], dtype=np.float32).view(np.uint32)[0])


def _e4m3(byte: int) -> float:
    return float(torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float())


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for bit in range(32):
        i = ((a >> bit) & 1) << 2 | ((b >> bit) & 1) << 1 | ((c >> bit) & 1)
        # immLut is indexed by (a, b, c) as F0, CC, AA: bit index = a*4 + b*2 + c
        out |= ((lut >> i) & 1) << bit
    return out


def _mma(lanes: list[dict], a: list[str], b: list[str], c: list[str], half=None
         ) -> list[list[float]]:
    """D = A B + C of m16n8k16 (fp16 or, with half=_bf16, bf16 A, B; fp32 C, D), per lane's
    four D registers."""
    half = half or _f16
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    C = np.zeros((16, 8))
    for lane, regs in enumerate(lanes):
        g, t = lane // 4, lane % 4
        for i, name in enumerate(a):         # a0: (g, 2t..), a1: (g+8, ..), a2: (g, 2t+8..)
            row, col = g + 8 * (i % 2), 2 * t + 8 * (i // 2)
            A[row, col] = half(regs[name])
            A[row, col + 1] = half(regs[name] >> 16)
        for i, name in enumerate(b):         # b0: (2t.., g), b1: (2t+8.., g)
            B[2 * t + 8 * i, g] = half(regs[name])
            B[2 * t + 8 * i + 1, g] = half(regs[name] >> 16)
        for i, name in enumerate(c):         # c0, c1: (g, 2t..), c2, c3: (g+8, 2t..)
            C[g + 8 * (i // 2), 2 * t + i % 2] = _f32(regs[name])
    D = A @ B + C
    return [[D[lane // 4 + 8 * (i // 2), 2 * (lane % 4) + i % 2] for i in range(4)]
            for lane in range(len(lanes))]


def run(program: str, lanes: list[dict[str, int]]) -> list[dict[str, int]]:
    """Run `program` (inline asm text with $n operands) on each lane's operands (ints: 32-bit
    registers, 64-bit for `mov.b64` sources); returns every lane's registers."""
    regs = [dict(r) for r in lanes]

    def val(r: dict, tok: str) -> int:
        if tok in r:
            return r[tok]
        if tok.startswith("0f"):        # a float32 given by its bits
            return int(tok[2:], 16)
        return int(tok, 0) & MASK

    for raw in program.splitlines():
        line = raw.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if op.startswith("mma.sync"):
            groups = [g.replace(" ", "").split(",") for g in re.findall(r"\{([^}]*)\}", args)]
            out = _mma(regs, groups[1], groups[2], groups[3],
                       _bf16 if ".bf16.bf16." in op else _f16)
            for r, d in zip(regs, out):
                for name, value in zip(groups[0], d):
                    r[name] = _f32_bits(value)
            continue
        for r in regs:
            _step(r, op, args, val)
    return regs


def _step(r: dict, op: str, args: str, val) -> None:
    if op in ("mov.b32", "mov.b64") and "{" in args:
        if args.strip().startswith("{"):     # unpack: {lo, hi}, src
            dst, src = args.split("}")
            lo, hi = [x.strip() for x in dst.strip("{ ").split(",")]
            x = val(r, src.strip(", "))
            width = 16 if op == "mov.b32" else 32
            r[lo], r[hi] = x & ((1 << width) - 1), (x >> width) & ((1 << width) - 1)
        else:                                 # pack: dst, {lo, hi} (16-bit halves)
            dst, src = args.split(",", 1)
            lo, hi = [x.strip() for x in src.strip(" {}").split(",")]
            r[dst.strip()] = (val(r, lo) & 0xFFFF) | (val(r, hi) & 0xFFFF) << 16
        return
    d, *src = [a.strip() for a in args.split(",")]
    x = [val(r, s) for s in src]
    if op == "and.b32":
        out = x[0] & x[1]
    elif op == "or.b32":
        out = x[0] | x[1]
    elif op == "shl.b32":
        out = (x[0] << x[1]) & MASK
    elif op in ("shr.u32", "shr.b32"):
        out = (x[0] & MASK) >> x[1]
    elif op == "lop3.b32":
        out = _lop3(x[0], x[1], x[2], x[3])
    elif op == "mov.b32":
        out = x[0] & MASK
    elif op == "cvt.u16.u32":
        out = x[0] & 0xFFFF
    elif op == "cvt.rn.f16x2.e4m3x2":
        out = _f16_bits(_e4m3(x[0] & 0xFF)) | _f16_bits(_e4m3((x[0] >> 8) & 0xFF)) << 16
    elif op == "mul.rn.f16x2":
        # the product of two fp16 values is exact in float32: one rounding, to fp16
        out = (_f16_bits(np.float32(_f16(x[0])) * np.float32(_f16(x[1])))
               | _f16_bits(np.float32(_f16(x[0] >> 16)) * np.float32(_f16(x[1] >> 16))) << 16)
    elif op == "fma.rn.bf16x2":
        # a product of two bf16 values is exact in float32: one rounding, to bf16
        out = (_bf16_bits(_bf16(x[0]) * _bf16(x[1]) + _bf16(x[2]))
               | _bf16_bits(_bf16(x[0] >> 16) * _bf16(x[1] >> 16) + _bf16(x[2] >> 16)) << 16)
    elif op == "cvt.f32.f16":
        out = _f32_bits(_f16(x[0]))
    elif op == "mul.f32":
        out = _f32_bits(np.float32(_f32(x[0])) * np.float32(_f32(x[1])))
    elif op == "cvt.rn.bf16x2.f32":      # d = {a: upper half, b: lower half}
        out = _bf16_bits(_f32(x[1])) | _bf16_bits(_f32(x[0])) << 16
    elif op == "prmt.b32":
        pool = (x[1] << 32 | x[0]).to_bytes(8, "little")
        out = 0
        for i in range(4):
            sel = (x[2] >> 4 * i) & 0xF
            byte = pool[sel & 7]
            if sel & 8:
                byte = 0xFF if byte & 0x80 else 0
            out |= byte << 8 * i
    else:
        raise AssertionError(f"PTX op {op} is not emulated")
    r[d] = out
