"""Launchers for the NVFP4 routed-expert kernels (`freetoken.kernels.nvfp4_jit`,
`freetoken.kernels.nvfp4_mma`).

`fused_moe` is the whole routed-expert computation of one rank: gate_up with SiLU-and-mul,
then down, weighted by the routing weights and summed over each token's top-k slots (a
partial sum; the MoE block all-reduces it). Few tokens take the decode kernels: gate_up one
program per (token, slot) pair and block of rows, down one per (token, block of rows)
walking all of the token's slots. 16-bit activations on a GPU decode on tensor cores
(`nvfp4_mma`: a warp per 16 rows, warps splitting K when a launch has few warps), as does
the dense NVFP4 linear's decode; float32 activations and CPUs take the CUDA-core GEMVs of
`nvfp4_jit` (blocks shrink to fewer rows when that leaves too few programs). More tokens
take the prefill kernels, on pairs sorted by expert into blocks. Nothing here synchronises
with the host, so decode steps can be captured in CUDA graphs. On sm_90+ the mma decode's
second and third kernels use programmatic dependent launch (`launches_early`).
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass

import torch

from freetoken.formats.nvfp4.format import GROUP, NVFP4FormatError
from freetoken.kernels.moe_align import align_by_expert

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
    walks all of a token's slots alone); `pdl`: the mma kernels after the first of a call
    start with programmatic dependent launch where the GPU and Triton have it
    (`launches_early`)."""

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


GPU_TILES = Tiles()
# The interpreter runs programs one after another in numpy: fewer, larger programs are faster.
INTERPRETER_TILES = Tiles(decode_n=128, decode_words=16, decode_programs=1, prefill_m=64,
                          prefill_n=128, prefill_groups=8)


def _jit():
    """The kernel module, imported on first use (see `freetoken.kernels.use_interpreter`)."""
    return importlib.import_module("freetoken.kernels.nvfp4_jit")


def _mma_jit():
    return importlib.import_module("freetoken.kernels.nvfp4_mma")


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def tiles_for(device: torch.device) -> Tiles:
    """GPU tiles on CUDA, interpreter tiles elsewhere."""
    return GPU_TILES if torch.device(device).type == "cuda" else INTERPRETER_TILES


def dequant_mode(x: torch.Tensor) -> int:
    """How the decode kernels turn packed words into weights for activations `x`: 1, the PTX
    lookup tables (any CUDA GPU), or 0, portable bit arithmetic (the interpreter, or
    `FREETOKEN_NVFP4_PTX=0`). Both give the same weights; only the instruction count
    differs."""
    from freetoken.kernels import interpreter_requested

    if x.device.type != "cuda" or interpreter_requested():
        return 0
    return 0 if os.environ.get("FREETOKEN_NVFP4_PTX", "1") == "0" else 1


def uses_mma(x: torch.Tensor, tiles: Tiles) -> bool:
    """Whether decode runs on tensor cores (`freetoken.kernels.nvfp4_mma`): 16-bit activations
    on a GPU with e4m3 conversions (compute capability >= 8.9) and the PTX decode on.
    float32 activations keep the CUDA-core kernels, whose products are exact in float32."""
    return (tiles.mma and dequant_mode(x) == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and _capability(x) >= (8, 9))


def _capability(x: torch.Tensor) -> tuple[int, int]:
    """The compute capability of x's GPU."""
    return _device_capability(x.device.index if x.device.index is not None
                              else torch.cuda.current_device())


@functools.cache
def _device_capability(device_index: int) -> tuple[int, int]:
    """Asked once per device, not on every decode call."""
    return torch.cuda.get_device_capability(device_index)


def launches_early(x: torch.Tensor, tiles: Tiles) -> bool:
    """Whether the mma decode's second and third kernels use programmatic dependent launch:
    on tensor-core decode (`uses_mma`) with compute capability 9.0+ (`griddepcontrol`) and a
    Triton that launches with it. Each such kernel starts while the previous one finishes,
    loads its first weights, and waits for the previous kernel's outputs (`_grid_wait`)."""
    return (tiles.pdl and x.is_cuda and uses_mma(x, tiles) and _capability(x) >= (9, 0)
            and _triton_launches_pdl())


@functools.cache
def _triton_launches_pdl() -> bool:
    from triton.backends.nvidia.compiler import CUDAOptions

    return "launch_pdl" in CUDAOptions.__dataclass_fields__


def _pdl_args(on: bool) -> dict:
    """Kernel arguments for a launch with (or without) programmatic dependent launch."""
    return {"PDL": 1, "launch_pdl": True} if on else {}


def _mma_shape(units: int, rows: int, k_inputs: int, walk: int, tiles: Tiles,
               min_split: int = 1) -> tuple[int, int, int, int]:
    """(V, S, CHUNKS, TILES) of an mma decode launch: V words per lane and chunk (the largest of
    4, 2, 1 that divides the row into whole chunks of 32 V inputs), CHUNKS chunks per row,
    TILES 16-row tiles per program, and the K split S: warps per program, doubled (up to
    `mma_max_split`) while it is below `min_split` or the launch has fewer than `mma_warps`
    warps, as long as each warp keeps at least one of the `walk * CHUNKS` steps."""
    v = next((v for v in (4, 2) if k_inputs % (32 * v) == 0), 1)
    chunks = -(-k_inputs // (32 * v))
    row_tiles = min(tiles.mma_tiles, _pow2(-(-rows // 16)))
    split, warps = 1, units * -(-rows // 16)
    while (split < tiles.mma_max_split and (split < min_split or warps * split < tiles.mma_warps)
           and 2 * split <= walk * chunks):
        split *= 2
    return v, split, chunks, row_tiles


def _fragments(x: torch.Tensor, k_inputs: int, v: int, pdl: bool = False):
    """`to_fragments` of x's rows: (x16 [T, padded K] fp16, xf [T] float32). pdl: it lets
    the next kernel launch early (it is itself an ordinary launch)."""
    tokens, chunks = x.shape[0], -(-k_inputs // (32 * v))
    x16 = torch.empty(tokens, chunks * 32 * v, dtype=torch.float16, device=x.device)
    xf = torch.empty(tokens, dtype=torch.float32, device=x.device)
    _mma_jit().to_fragments[(tokens,)](
        x, x16, xf, k_inputs, x.stride(0), x16.stride(0), V=v, BLOCK=_pow2(x16.shape[1]),
        num_warps=4, PDL=int(pdl))
    return x16, xf


def _decode_mma(x, ids, tw, w13, s13, g13, w2, s2, g2, inter, top_k, tiles):
    pdl = launches_early(x, tiles)
    h16 = _gate_up_mma(x, ids, tw, w13, s13, g13, g2, inter, top_k, tiles, pdl)
    out = torch.empty(x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    _down_mma(h16, None, ids, w2, s2, out, inter, top_k, tiles, pdl)
    return out


def _gate_up_mma(x, ids, tw, w13, s13, g13, g2, inter, top_k, tiles, pdl=False):
    """gate_up on tensor cores: h (times the routing weight and down's global scale) as bf16
    fragments [pairs, padded I] for `_down_mma`. pdl: the call's `launches_early`, decided
    once for its kernels."""
    jit, pairs, tokens, hidden = _mma_jit(), ids.numel(), x.shape[0], x.shape[1]
    v, split, _, row_tiles = _mma_shape(pairs, inter, hidden, 1, tiles)
    x16, xf = _fragments(x, hidden, v, pdl)
    vh, _, chunks_h, _ = _mma_shape(tokens, hidden, inter, top_k, tiles)
    h16 = torch.empty(pairs, chunks_h * 32 * vh, dtype=torch.bfloat16, device=x.device)
    we, wn, _ = _word_strides("w13", w13)
    jit.gate_up_mma[(pairs, -(-inter // (16 * row_tiles)))](
        x16, xf, ids, tw, w13, s13, g13, g2, h16, inter, hidden // 8, top_k, x16.stride(0),
        we, wn, s13.stride(0), s13.stride(1), h16.stride(0), V=v, TILES=row_tiles, S=split,
        VH=vh, ASM=dequant_mode(x), FULL=_full(inter, hidden, 1, v, split, row_tiles),
        num_warps=split * row_tiles, **_pdl_args(pdl))
    return h16


def _full(rows: int, k_inputs: int, walk: int, v: int, split: int, row_tiles: int) -> bool:
    """Whether an mma launch needs no masks: whole row tiles, whole chunks, and the walk's
    steps (`walk` rows of chunks) shared evenly by the K split."""
    chunks, rem = divmod(k_inputs, 32 * v)
    return rows % (16 * row_tiles) == 0 and rem == 0 and (walk * chunks) % split == 0


def _down_mma(h16, hf, ids, w2, s2, out, k_inputs, top_k, tiles, pdl=False):
    """down on tensor cores: out[t] = the sum over t's slots of w2[ids[p]] @ h16[p]; h16 bf16
    fragments (gate_up's), or fp16 ones times hf [T] (`_fragments`)."""
    tokens, n_rows = out.shape[0], w2.shape[1]
    v, split, chunks, row_tiles = _mma_shape(tokens, n_rows, k_inputs, top_k, tiles,
                                             tiles.mma_down_min_split)
    we, wn, _ = _word_strides("w2", w2)
    bf16 = h16.dtype == torch.bfloat16
    _mma_jit().down_mma[(tokens, -(-n_rows // (16 * row_tiles)))](
        h16, h16 if bf16 else hf, ids, w2, s2, out, n_rows, k_inputs // 8, top_k,
        h16.stride(0), we, wn, s2.stride(0), s2.stride(1), out.stride(0), V=v, TILES=row_tiles,
        S=split, CHUNKS=chunks, ASM=dequant_mode(h16),
        FULL=_full(n_rows, k_inputs, top_k, v, split, row_tiles), BF16=int(bf16),
        num_warps=split * row_tiles, **_pdl_args(pdl))


def _precision(dtype: torch.dtype) -> str:
    # fp32 activations must not silently drop to TF32 on a GPU; 16-bit ones are exact anyway.
    return "ieee" if dtype == torch.float32 else "tf32"


def _local_intermediate(w13: torch.Tensor, w2: torch.Tensor) -> int:
    """The TP-local intermediate size the kernels are told: half of w13's rows."""
    return w13.shape[1] // 2


def _check(x, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global) -> None:
    hidden, experts, inter = x.shape[-1], w13.shape[0], w13.shape[1] // 2
    want = {"w13": (experts, 2 * inter, hidden // 2), "w13_scale": (experts, 2 * inter,
            hidden // GROUP), "w13_global": (experts, 2), "w2": (experts, hidden, inter // 2),
            "w2_scale": (experts, hidden, inter // GROUP), "w2_global": (experts,)}
    got = {"w13": w13, "w13_scale": w13_scale, "w13_global": w13_global, "w2": w2,
           "w2_scale": w2_scale, "w2_global": w2_global}
    for name, shape in want.items():
        if tuple(got[name].shape) != shape:
            raise NVFP4FormatError(f"fused_moe: {name} has shape {tuple(got[name].shape)}, "
                                   f"expected {shape} for hidden={hidden}, local "
                                   f"intermediate={inter}, experts={experts}")
    if hidden % GROUP or inter % GROUP:
        raise NVFP4FormatError(f"fused_moe: hidden={hidden} and local intermediate={inter} "
                               f"must be multiples of the {GROUP}-element group")
    if w13.dtype != torch.uint8 or w2.dtype != torch.uint8:
        raise NVFP4FormatError(f"fused_moe: packed weights must be uint8, got w13 "
                               f"{w13.dtype}, w2 {w2.dtype}")
    if topk_ids.shape[0] != x.shape[0]:
        raise NVFP4FormatError(f"fused_moe: topk_ids has {topk_ids.shape[0]} rows for "
                               f"{x.shape[0]} tokens")


def fused_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              w13: torch.Tensor, w13_scale: torch.Tensor, w13_global: torch.Tensor,
              w2: torch.Tensor, w2_scale: torch.Tensor, w2_global: torch.Tensor,
              path: str = "auto", tiles: Tiles | None = None) -> torch.Tensor:
    """Routed-expert partial sum for `x` [T, H] with NVFP4 experts, in x's dtype.

    Shapes as `NVFP4FusedExperts`: w13 [E, 2I, H/2] uint8 (gate rows, then up rows),
    w13_scale [E, 2I, H/16] e4m3, w13_global [E, 2] float32 (gate, up); w2 [E, H, I/2],
    w2_scale [E, H, I/16], w2_global [E]. `path`: "auto", "decode" or "prefill".
    Rank-dependent through the TP-local intermediate size I."""
    _check(x, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global)
    tiles = tiles or tiles_for(x.device)
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    if path == "auto":
        path = "decode" if tokens <= DECODE_MAX_TOKENS else "prefill"
    if path not in ("decode", "prefill"):
        raise ValueError(f"fused_moe: path must be auto, decode or prefill, got {path!r}")
    args = dict(x=x.contiguous(), ids=topk_ids.reshape(-1).contiguous(),
                tw=topk_weights.reshape(-1).contiguous(), w13=w13,
                s13=w13_scale.view(torch.uint8), g13=w13_global.float().contiguous(), w2=w2,
                s2=w2_scale.view(torch.uint8), g2=w2_global.float().contiguous(),
                inter=_local_intermediate(w13, w2), top_k=top_k, tiles=tiles)
    if tokens == 0:
        return x.new_zeros(0, hidden)
    if path == "decode":
        return _decode_mma(**args) if uses_mma(x, tiles) else _decode(**args)
    out = torch.empty(tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    _prefill(out=out, **args)
    return out.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def word_order(x: torch.Tensor, k: int, scale: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, int]:
    """Rows of `x` [T, >= k] as the decode kernels read activations: float32, in word order
    (`out[t, j * xs + w]` = x[t, 8w + j] for the first k inputs), optionally times the
    float32 scalar tensor `scale`; the j-stride xs is k / 8 rounded up to 16 (the padding is
    never read). One kernel."""
    tokens, words = x.shape[0], k // 8
    xs = _word_stride(words)
    out = torch.empty(tokens, 8, xs, dtype=torch.float32, device=x.device)
    src = x[:, :k].reshape(tokens, words, 8).transpose(1, 2)
    if scale is None:
        out[:, :, :words].copy_(src)
    else:
        torch.mul(src, scale, out=out[:, :, :words])
    return out.view(tokens, 8 * xs), xs


def _word_stride(words: int) -> int:
    # a multiple of 16: Triton then knows every j-run is 16-byte aligned (vector loads)
    return -(-words // 16) * 16


def _word_strides(name: str, w: torch.Tensor) -> tuple[int, int, int]:
    """Expert and row strides of packed weights `w` in int32 words, and the vector width the
    kernel may assume for a row (4 words when every row starts 16-byte aligned)."""
    if w.stride(-1) != 1 or w.stride(0) % 4 or w.stride(1) % 4 or w.data_ptr() % 4:
        raise NVFP4FormatError(f"fused_moe decode: {name} must be 4-byte aligned rows of packed "
                               f"bytes (strides {tuple(w.stride())}, rows of {w.shape[-1]} "
                               f"bytes); pass a contiguous tensor with a multiple of 8 inputs "
                               f"per row")
    aligned = w.stride(0) % 16 == 0 and w.stride(1) % 16 == 0 and w.data_ptr() % 16 == 0
    return w.stride(0) // 4, w.stride(1) // 4, 4 if aligned else 1


def _decode_shape(units: int, rows: int, k_words: int, x: torch.Tensor, tiles: Tiles
                  ) -> tuple[int, dict]:
    """Rows per program and the launch meta of a decode kernel over `rows` output rows of
    `k_words` words each, `units` independent row sets (pairs or tokens). Rows per program
    start at decode_n and halve while the launch has fewer than decode_programs programs,
    but not below one word per thread of a warp (short rows: TP-local down); warps drop
    when a step's tile would leave threads with fewer than 2 words."""
    block_n = min(tiles.decode_n, _pow2(rows))
    while (block_n > 1 and units * -(-rows // block_n) < tiles.decode_programs
           and (block_n // 2) * _pow2(k_words) >= 32):
        block_n //= 2
    warps = tiles.decode_warps
    while True:
        per_step = max(2, tiles.decode_words * 32 * warps // block_n)
        # a power of two, and whole 16-input groups (2 words) per step
        kw = max(2, min(_pow2(k_words), 1 << (per_step.bit_length() - 1)))
        if warps == 1 or block_n * kw >= 2 * 32 * warps:
            break
        warps //= 2
    return block_n, dict(BLOCK_N=block_n, KW=kw, ASM=dequant_mode(x), EVEN=k_words % kw == 0,
                         num_warps=warps)


def _decode(x, ids, tw, w13, s13, g13, w2, s2, g2, inter, top_k, tiles):
    jit, pairs, tokens, hidden = _jit(), ids.numel(), x.shape[0], x.shape[1]
    xw, xs = word_order(x, hidden)
    hs = _word_stride(inter // 8)
    h = torch.empty(pairs, 8 * hs, dtype=torch.float32, device=x.device)
    block_n, meta = _decode_shape(pairs, inter, hidden // 8, x, tiles)
    we, wn, vec = _word_strides("w13", w13)
    jit.gate_up_decode[(pairs, -(-inter // block_n))](
        xw, ids, tw, w13, s13, g13, g2, h, 0, inter, hidden // 8, top_k, xw.stride(0), xs,
        we, wn, s13.stride(0), s13.stride(1), h.stride(0), hs, VEC=vec, **meta)
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    _down_words(h, hs, ids, w2, s2, out, inter, top_k, tiles)
    return out


def down_decode_launch(x, w, s, g, out, k_inputs, tiles):
    """out = g * (w[0] @ x[:, :k_inputs].T).T for the dense NVFP4 linear (one expert: w [1,
    rows, k_inputs / 2], s its block scales, g [1] its global scale); `out` [T, rows] in any
    float dtype. 16-bit activations on a GPU take the mma kernels (`down_mma` with one slot per
    token, g folded into the fragments' float32 factor), others the CUDA-core ones."""
    ids = torch.zeros(x.shape[0], dtype=torch.int32, device=x.device)
    if uses_mma(x, tiles):
        v = _mma_shape(x.shape[0], w.shape[1], k_inputs, 1, tiles)[0]
        pdl = launches_early(x, tiles)
        x16, xf = _fragments(x, k_inputs, v, pdl)
        _down_mma(x16, xf.mul_(g), ids, w, s, out, k_inputs, 1, tiles, pdl)
        return
    xw, xs = word_order(x, k_inputs, scale=g)
    _down_words(xw, xs, ids, w, s, out, k_inputs, 1, tiles)


def _down_words(h, hs, ids, w2, s2, out, k_inputs, top_k, tiles):
    """out[t] = sum over t's slots p of w2[ids[p]] @ h[p][:k_inputs], h in word order (j-stride
    hs) and already scaled."""
    jit, tokens, n_rows = _jit(), out.shape[0], w2.shape[1]
    block_n, meta = _decode_shape(tokens, n_rows, k_inputs // 8, h, tiles)
    we, wn, vec = _word_strides("w2", w2)
    jit.down_decode[(tokens, -(-n_rows // block_n))](
        h, ids, w2, s2, out, 0, n_rows, k_inputs // 8, top_k, -(-(k_inputs // 8) // meta["KW"]),
        h.stride(0), hs, we, wn, s2.stride(0), s2.stride(1), out.stride(0), VEC=vec, **meta)


def _prefill(x, ids, tw, w13, s13, g13, w2, s2, g2, inter, top_k, tiles, out):
    jit, pairs, hidden = _jit(), ids.numel(), x.shape[1]
    rows, block_expert = align_by_expert(ids, w13.shape[0], tiles.prefill_m)
    h = torch.empty(rows.numel(), inter, dtype=x.dtype, device=x.device)
    grid = (block_expert.numel(), -(-inter // tiles.prefill_n))
    jit.gate_up_prefill[grid](
        x, rows, block_expert, w13, s13, g13, h, pairs, inter, hidden // GROUP, top_k,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), h.stride(0),
        BLOCK_M=tiles.prefill_m, BLOCK_N=tiles.prefill_n, GROUPS=tiles.prefill_groups,
        PRECISION=_precision(x.dtype), num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    down_prefill_launch(h, rows, block_expert, tw, w2, s2, g2, out, pairs, inter, tiles)


def down_prefill_launch(h, rows, block_expert, tw, w2, s2, g2, out, pairs, k_inputs, tiles):
    """`down_decode_launch` for sorted blocks: h row r belongs to pair rows[r]."""
    n_rows = w2.shape[1]
    grid = (block_expert.numel(), -(-n_rows // tiles.prefill_n))
    _jit().down_prefill[grid](
        h, rows, block_expert, tw, w2, s2, g2, out, pairs, n_rows, k_inputs // GROUP,
        h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), out.stride(0),
        BLOCK_M=tiles.prefill_m, BLOCK_N=tiles.prefill_n, GROUPS=tiles.prefill_groups,
        PRECISION=_precision(h.dtype), num_warps=tiles.num_warps, num_stages=tiles.num_stages)
