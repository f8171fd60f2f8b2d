"""Launchers of the CUDA-core NVFP4 decode kernels (`nvfp4_decode_jit`) and of the prefill
kernels (`nvfp4_prefill_jit`), and the block sizes every NVFP4 launcher shares (`Tiles`).
The tensor-core decode's launchers are in `nvfp4_mma_launch`; `nvfp4_moe.fused_moe` and
`nvfp4_linear.nvfp4_linear` pick between them.

Decode: gate_up one program per (token, slot) pair and block of rows, down one per (token,
block of rows) walking all of the token's slots; blocks shrink to fewer rows when that
leaves too few programs. Prefill: pairs sorted by expert into blocks. Nothing here
synchronises with the host, so decode steps can be captured in CUDA graphs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from freetoken.formats.nvfp4.format import GROUP, NVFP4FormatError
from freetoken.kernels import interpreting, jit_module, next_pow2
from freetoken.kernels.pdl import capability

DECODE_MAX_TOKENS = 16
"""Up to this many tokens, each (token, slot) pair streams its expert's weights itself."""


@dataclass(frozen=True)
class Tiles:
    """Block sizes. decode: at most `decode_n` weight rows per program, halved while a launch
    has fewer than `decode_programs` programs (one or two tokens of small TP-local experts);
    every thread takes `decode_words` int32 words (8 weights each) per row and step, so a
    step covers decode_words * 32 * decode_warps / rows words of each row. prefill: pairs per
    block (BLOCK_M), output rows per program (BLOCK_N), 16-input groups per step. mma (the
    tensor-core decode, on unless `mma` is False): `mma_tiles` 16-row tiles per program, and
    the warps of a program split K while a launch has fewer than `mma_warps` warps, up to
    `mma_max_split` ways, down's at least `mma_down_min_split` ways (a down warp otherwise
    walks all of a token's slots alone); `pdl`: a MoE call's down starts with programmatic
    dependent launch after its gate_up where the GPU and Triton have it
    (`nvfp4_mma_launch.launches_early`); `mma_maxnreg`: a register cap for the tensor-core
    gate_up (ptxas `maxnreg`; None: ptxas chooses). Registers are allocated per SM quarter,
    so gate_up's 97-99 give 16 warps an SM and 88 would give 20 (no spill at 88,
    `bench/nvfp4_sass.py --maxnreg`); off until a GPU timing says it pays."""

    decode_n: int = 16
    decode_words: int = 8
    decode_warps: int = 2
    decode_programs: int = 512
    prefill_m: int = 64
    prefill_n: int = 64
    prefill_groups: int = 4
    num_warps: int = 4
    num_stages: int = 3
    mma: bool = True
    mma_warps: int = 2048
    mma_max_split: int = 8
    mma_tiles: int = 1
    mma_down_min_split: int = 2
    pdl: bool = True
    mma_maxnreg: int | None = None

    def __post_init__(self):
        if self.mma_maxnreg is not None and not 24 <= self.mma_maxnreg <= 255:
            raise ValueError(f"Tiles.mma_maxnreg {self.mma_maxnreg}: a register cap is None "
                             f"or 24..255 (ptxas maxnreg)")


GPU_TILES = Tiles()
# The interpreter runs programs one after another in numpy: fewer, larger programs are faster.
INTERPRETER_TILES = Tiles(decode_n=128, decode_words=16, decode_programs=1, prefill_m=64,
                          prefill_n=128, prefill_groups=8)


def tiles_for(device: torch.device) -> Tiles:
    """GPU tiles on CUDA, interpreter tiles elsewhere."""
    return GPU_TILES if torch.device(device).type == "cuda" else INTERPRETER_TILES


def dequant_mode(x: torch.Tensor) -> int:
    """How the decode kernels turn packed words into weights for activations `x`: 1, the PTX
    lookup tables (any CUDA GPU), or 0, portable bit arithmetic (the interpreter, or
    `FREETOKEN_NVFP4_PTX=0`). Both give the same weights; only the instruction count
    differs."""
    if x.device.type != "cuda" or interpreting():
        return 0
    return 0 if os.environ.get("FREETOKEN_NVFP4_PTX", "1") == "0" else 1


def uses_mma(x: torch.Tensor, tiles: Tiles) -> bool:
    """Whether decode runs on tensor cores (`nvfp4_mma_launch`): 16-bit activations on a GPU
    with e4m3 conversions (compute capability >= 8.9) and the PTX decode on. float32
    activations keep the CUDA-core kernels, whose products are exact in float32."""
    return (tiles.mma and dequant_mode(x) == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and capability(x) >= (8, 9))


def weight_strides(w: torch.Tensor, w_scale: torch.Tensor, word_bytes: int = 1) -> dict:
    """The expert and row strides of packed weights `w` [E, rows, K / 2] (in units of
    `word_bytes` bytes: 4 for the kernels that read int32 words) and of their block scales,
    as kernel keyword arguments."""
    return dict(stride_w_expert=w.stride(0) // word_bytes, stride_w_row=w.stride(1) // word_bytes,
                stride_scale_expert=w_scale.stride(0), stride_scale_row=w_scale.stride(1))


def word_vector(name: str, w: torch.Tensor) -> int:
    """The words a row of packed weights `w` may be assumed aligned to: 4 when every row starts
    16-byte aligned, else 1. Raises unless rows are 4-byte aligned (whole int32 words)."""
    if w.stride(-1) != 1 or w.stride(0) % 4 or w.stride(1) % 4 or w.data_ptr() % 4:
        raise NVFP4FormatError(f"fused_moe decode: {name} must be 4-byte aligned rows of packed "
                               f"bytes (strides {tuple(w.stride())}, rows of {w.shape[-1]} "
                               f"bytes); pass a contiguous tensor with a multiple of 8 inputs "
                               f"per row")
    aligned = w.stride(0) % 16 == 0 and w.stride(1) % 16 == 0 and w.data_ptr() % 16 == 0
    return 4 if aligned else 1


def word_order(x: torch.Tensor, k: int, scale: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, int]:
    """Rows of `x` [T, >= k] as the decode kernels read activations: float32, in word order
    (`out[t, j * stride + w]` = x[t, 8w + j] for the first k inputs), optionally times the
    float32 scalar tensor `scale`; the j-stride is k / 8 rounded up to 16 (the padding is
    never read). Returns (out, stride)."""
    tokens, words = x.shape[0], k // 8
    stride = _word_stride(words)
    out = torch.empty(tokens, 8, stride, dtype=torch.float32, device=x.device)
    src = x[:, :k].reshape(tokens, words, 8).transpose(1, 2)
    if scale is None:
        out[:, :, :words].copy_(src)
    else:
        torch.mul(src, scale, out=out[:, :, :words])
    return out.view(tokens, 8 * stride), stride


def _word_stride(words: int) -> int:
    # a multiple of 16: Triton then knows every j-run is 16-byte aligned (vector loads)
    return -(-words // 16) * 16


def decode_shape(units: int, rows: int, k_words: int, x: torch.Tensor, tiles: Tiles
                 ) -> tuple[int, dict]:
    """Rows per program and the launch meta of a decode kernel over `rows` output rows of
    `k_words` words each, `units` independent row sets (pairs or tokens). Rows per program
    start at decode_n and halve while the launch has fewer than decode_programs programs,
    but not below one word per thread of a warp (short rows: TP-local down); warps drop
    when a step's tile would leave threads with fewer than 2 words."""
    block_n = min(tiles.decode_n, next_pow2(rows))
    while (block_n > 1 and units * -(-rows // block_n) < tiles.decode_programs
           and (block_n // 2) * next_pow2(k_words) >= 32):
        block_n //= 2
    warps = tiles.decode_warps
    while True:
        per_step = max(2, tiles.decode_words * 32 * warps // block_n)
        # a power of two, and whole 16-input groups (2 words) per step
        kw = max(2, min(next_pow2(k_words), 1 << (per_step.bit_length() - 1)))
        if warps == 1 or block_n * kw >= 2 * 32 * warps:
            break
        warps //= 2
    return block_n, dict(BLOCK_N=block_n, KW=kw, ASM=dequant_mode(x), EVEN=k_words % kw == 0,
                         num_warps=warps)


def gate_up_decode_launch(x, topk_ids, topk_weights, w13, s13, g13, g2, intermediate, top_k,
                          tiles) -> tuple[torch.Tensor, int]:
    """h of every (token, slot) pair by `gate_up_decode`, float32 in word order, times the
    routing weight and down's global scale: (h [pairs, 8 * stride], its j-stride)."""
    pairs, hidden = topk_ids.numel(), x.shape[1]
    xw, stride_x_nibble = word_order(x, hidden)
    stride_h_nibble = _word_stride(intermediate // 8)
    h = torch.empty(pairs, 8 * stride_h_nibble, dtype=torch.float32, device=x.device)
    block_n, meta = decode_shape(pairs, intermediate, hidden // 8, x, tiles)
    jit_module("nvfp4_decode_jit").gate_up_decode[(pairs, -(-intermediate // block_n))](
        x_ptr=xw, topk_ids_ptr=topk_ids, topk_weights_ptr=topk_weights, w_ptr=w13,
        w_scale_ptr=s13, gate_up_global_ptr=g13, down_global_ptr=g2, h_ptr=h,
        zero=0, intermediate=intermediate, k_words=hidden // 8, top_k=top_k,
        stride_x_token=xw.stride(0), stride_x_nibble=stride_x_nibble,
        **weight_strides(w13, s13, word_bytes=4),
        stride_h_pair=h.stride(0), stride_h_nibble=stride_h_nibble,
        VEC=word_vector("w13", w13), **meta)
    return h, stride_h_nibble


def down_decode_launch(h, stride_h_nibble, topk_ids, w2, s2, out, k_inputs, top_k, tiles):
    """out[t] = sum over t's slots p of w2[topk_ids[p]] @ h[p][:k_inputs] by `down_decode`, h
    in word order (j-stride `stride_h_nibble`) and already scaled."""
    tokens, n_rows, k_words = out.shape[0], w2.shape[1], k_inputs // 8
    block_n, meta = decode_shape(tokens, n_rows, k_words, h, tiles)
    jit_module("nvfp4_decode_jit").down_decode[(tokens, -(-n_rows // block_n))](
        h_ptr=h, topk_ids_ptr=topk_ids, w_ptr=w2, w_scale_ptr=s2, out_ptr=out,
        zero=0, n_rows=n_rows, k_words=k_words, top_k=top_k,
        steps_per_slot=-(-k_words // meta["KW"]),
        stride_h_pair=h.stride(0), stride_h_nibble=stride_h_nibble,
        **weight_strides(w2, s2, word_bytes=4), stride_out_token=out.stride(0),
        VEC=word_vector("w2", w2), **meta)


def _precision(dtype: torch.dtype) -> str:
    # fp32 activations must not silently drop to TF32 on a GPU; 16-bit ones are exact anyway.
    return "ieee" if dtype == torch.float32 else "tf32"


def _prefill_meta(tiles: Tiles, dtype: torch.dtype) -> dict:
    return dict(BLOCK_M=tiles.prefill_m, BLOCK_N=tiles.prefill_n, GROUPS=tiles.prefill_groups,
                PRECISION=_precision(dtype), num_warps=tiles.num_warps,
                num_stages=tiles.num_stages)


def gate_up_prefill_launch(x, sorted_pairs, block_expert, w13, s13, g13, num_pairs,
                           intermediate, top_k, tiles) -> torch.Tensor:
    """h [sorted rows, intermediate] in x's dtype by `gate_up_prefill`, row r that of pair
    sorted_pairs[r] (`moe_align.align_by_expert`'s layout)."""
    h = torch.empty(sorted_pairs.numel(), intermediate, dtype=x.dtype, device=x.device)
    grid = (block_expert.numel(), -(-intermediate // tiles.prefill_n))
    jit_module("nvfp4_prefill_jit").gate_up_prefill[grid](
        x_ptr=x, sorted_pairs_ptr=sorted_pairs, block_expert_ptr=block_expert, w_ptr=w13,
        w_scale_ptr=s13, gate_up_global_ptr=g13, h_ptr=h,
        num_pairs=num_pairs, intermediate=intermediate, k_groups=x.shape[1] // GROUP,
        top_k=top_k, stride_x_token=x.stride(0), **weight_strides(w13, s13),
        stride_h_row=h.stride(0), **_prefill_meta(tiles, x.dtype))
    return h


def down_prefill_launch(h, sorted_pairs, block_expert, topk_weights, w2, s2, g2, out,
                        num_pairs, k_inputs, tiles):
    """out[p] = w2[e] @ h[r] * g2[e] * topk_weights[p] by `down_prefill`, for the pair p
    that sorted row r holds (expert e); out [pairs, rows] float32."""
    n_rows = w2.shape[1]
    grid = (block_expert.numel(), -(-n_rows // tiles.prefill_n))
    jit_module("nvfp4_prefill_jit").down_prefill[grid](
        h_ptr=h, sorted_pairs_ptr=sorted_pairs, block_expert_ptr=block_expert,
        topk_weights_ptr=topk_weights, w_ptr=w2, w_scale_ptr=s2, down_global_ptr=g2,
        out_ptr=out, num_pairs=num_pairs, n_rows=n_rows, k_groups=k_inputs // GROUP,
        stride_h_row=h.stride(0), **weight_strides(w2, s2), stride_out_pair=out.stride(0),
        **_prefill_meta(tiles, h.dtype))
