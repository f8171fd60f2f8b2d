"""@triton.jit helpers shared by the NVFP4 kernels (`nvfp4_decode_jit`, `nvfp4_prefill_jit`,
`nvfp4_mma_jit`): e2m1 nibbles and e4m3 block-scale bytes to float32 by bit arithmetic, and
the SiLU-and-mul of gate_up.

Weight layout (ModelOpt): bytes [rows, K / 2] with element 2j in the low nibble of byte j;
block scales e4m3 [rows, K / 16], passed as their raw bytes (uint8) so that no kernel needs
Triton's fp8 types; one float32 global scale per (expert, part).

An e2m1 code `s e1 e0 m` placed at fp16 bits 15 and 11..9 is the fp16 number e2m1 * 2^-14
exactly (codes 0 and 1 land on fp16 subnormals, which fp16 -> fp32 converts exactly); an
e4m3 byte `s eeee mmm` at fp16 bits 15 and 13..7 is e4m3 * 2^-8 the same way. The powers of
two are undone by `FP4_UNBIAS` and `E4M3_UNBIAS`, once per output where possible.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP4_UNBIAS = tl.constexpr(16384.0)
"""`fp4_word` gives e2m1 * 2^-14: times this, e2m1."""
E4M3_UNBIAS = tl.constexpr(256.0)
"""`e4m3_low` gives e4m3 * 2^-8: times this, e4m3."""


@triton.jit
def e4m3_low(s):
    """float32 value * 2^-8 of e4m3 bytes in int32 `s` (NaN encodings never occur in NVFP4
    scales)."""
    bits = ((s & 0x80) << 8) | ((s & 0x7F) << 7)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e4m3(s):
    """float32 value of e4m3 bytes in int32 `s`."""
    return e4m3_low(s) * E4M3_UNBIAS


@triton.jit
def fp4_word(b, shift: tl.constexpr):
    """e2m1 value * 2^-14 of the nibble at bit `shift` of int32 `b` (a word, or a byte: shift
    0 its low nibble, 4 its high one), as float32."""
    n = b >> shift
    bits = ((n & 0x8) << 12) | ((n & 0x7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def silu_mul(gate, up, gate_up_global_ptr, expert):
    """SiLU(gate * g_gate) * (up * g_up), with the expert's gate and up global scales (two
    float32 per expert: gate, up)."""
    gate = gate * tl.load(gate_up_global_ptr + 2 * expert)
    return gate / (1.0 + tl.exp(-gate)) * (up * tl.load(gate_up_global_ptr + 2 * expert + 1))
