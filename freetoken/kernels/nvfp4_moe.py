"""Launchers for the NVFP4 routed-expert kernels (`freetoken.kernels.nvfp4_jit`).

`fused_moe` is the whole routed-expert computation of one rank: gate_up with SiLU-and-mul,
then down, weighted by the routing weights and summed over each token's top-k slots (a
partial sum; the MoE block all-reduces it). Few tokens take the decode kernels (GEMVs, one
program per (token, slot) pair and block of rows, gate_up split over K when that leaves too
few programs); more take the prefill kernels, on pairs sorted by expert into blocks. Nothing
here synchronises with the host, so decode steps can be captured in CUDA graphs.
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass

import torch

from freetoken.layers.quantization.nvfp4.format import GROUP, NVFP4FormatError

DECODE_MAX_TOKENS = 16
"""Up to this many tokens, each (token, slot) pair streams its expert's weights itself."""


@dataclass(frozen=True)
class Tiles:
    """Block sizes. decode: weight rows per program (`decode_n`), packed bytes per row per
    step and warps (`decode_kb`, `decode_warps`; `few_kb`, `few_warps` when a launch has at
    most `few_pairs` pairs), and the program count below which gate_up splits K
    (`decode_programs`: a few pairs of small TP-local experts otherwise leave the GPU with
    a few programs each walking the whole K); prefill: pairs per block (BLOCK_M), output
    rows per program (BLOCK_N), 16-input groups per step."""

    decode_n: int = 16
    decode_kb: int = 64
    decode_warps: int = 2
    few_pairs: int = 16
    few_kb: int = 128
    few_warps: int = 4
    decode_programs: int = 256
    prefill_m: int = 64
    prefill_n: int = 64
    prefill_groups: int = 4
    num_warps: int = 4
    num_stages: int = 3


GPU_TILES = Tiles()
# The interpreter runs programs one after another in numpy: fewer, larger programs are faster.
INTERPRETER_TILES = Tiles(decode_n=128, decode_kb=512, prefill_m=64, prefill_n=128,
                          prefill_groups=8)


def _jit():
    """The kernel module, imported on first use (see `freetoken.kernels.use_interpreter`)."""
    return importlib.import_module("freetoken.kernels.nvfp4_jit")


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def tiles_for(device: torch.device) -> Tiles:
    """GPU tiles on CUDA, interpreter tiles elsewhere."""
    return GPU_TILES if torch.device(device).type == "cuda" else INTERPRETER_TILES


def dequant_mode(x: torch.Tensor) -> int:
    """Which dequantization the kernels compile for activations `x`: 1 (bf16) or 2 (fp16)
    for the PTX lookup tables, which need `cvt.rn.f16x2.e4m3x2` (compute capability 8.9+),
    else 0 (portable float32 bit arithmetic: the interpreter, fp32 activations, older GPUs)."""
    from freetoken.kernels import interpreter_requested

    if x.device.type != "cuda" or interpreter_requested():
        return 0
    if os.environ.get("FREETOKEN_NVFP4_PTX", "1") == "0":  # A/B timing, or a PTX problem
        return 0
    if not _ptx_capable(x.device.index if x.device.index is not None else
                        torch.cuda.current_device()):
        return 0
    return {torch.bfloat16: 1, torch.float16: 2}.get(x.dtype, 0)


@functools.cache
def _ptx_capable(device_index: int) -> bool:
    """Compute capability 8.9+ (asked once per device, not on every decode launch)."""
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


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


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort pairs by expert, padding each expert's run to a multiple of `block_m`.

    Returns `rows` int32 [num_blocks * block_m] (pair index per sorted row, len(ids) where
    padding) and `block_expert` int32 [num_blocks] (-1: block unused). num_blocks is the upper
    bound cdiv(n, block_m) + min(E, n), so the grid needs no device-to-host copy."""
    n = ids.numel()
    num_blocks = -(-n // block_m) + min(num_experts, n)
    ids = ids.to(torch.int64)
    order = torch.argsort(ids, stable=True)
    # scatter_add instead of bincount: bincount reads the max back to the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    first = torch.cumsum(counts, 0) - counts
    sorted_e = ids[order]
    rank_in_expert = torch.arange(n, device=ids.device) - first[sorted_e]
    dest = padded_end[sorted_e] - padded[sorted_e] + rank_in_expert
    rows = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=ids.device)
    rows[dest] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return rows, block_expert.to(torch.int32)


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
        return _decode(**args)
    out = torch.empty(tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    _prefill(out=out, **args)
    return out.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def _decode(x, ids, tw, w13, s13, g13, w2, s2, g2, inter, top_k, tiles):
    jit, pairs, tokens, hidden = _jit(), ids.numel(), x.shape[0], x.shape[1]
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    block_n = min(tiles.decode_n, _pow2(inter))
    meta = _decode_meta(block_n, hidden // 2, pairs, x, tiles)
    n_blocks, steps = -(-inter // block_n), -(-(hidden // 2) // meta["KB"])
    splits = 1
    while pairs * n_blocks * splits < tiles.decode_programs and 2 * splits <= steps:
        splits *= 2
    k_split = -(-steps // splits) * meta["KB"]
    splits = -(-(hidden // 2) // k_split)
    gu = (torch.empty(splits, pairs, 2 * inter, dtype=torch.float32, device=x.device)
          if splits > 1 else h)
    jit.gate_up_decode[(pairs, n_blocks, splits)](
        x, ids, w13, s13, g13, h, gu, inter, hidden // 2, k_split, top_k, x.stride(0),
        w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), h.stride(0),
        gu.stride(0) if splits > 1 else 0, gu.stride(1) if splits > 1 else 0,
        SPLIT=splits > 1, **meta)
    if splits > 1:
        block = min(1024, _pow2(inter))
        jit.silu_mul_splits[(pairs, -(-inter // block))](
            gu, ids, g13, h, inter, splits, gu.stride(0), gu.stride(1), h.stride(0),
            BLOCK=block, num_warps=4)
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    down_decode_launch(h, ids, tw, w2, s2, g2, out, inter, top_k, tiles)
    return out


def _decode_meta(block_n, k_bytes, pairs, x, tiles) -> dict:
    few = pairs <= tiles.few_pairs
    kb = min(tiles.few_kb if few else tiles.decode_kb, max(8, _pow2(k_bytes)))
    warps = tiles.few_warps if few else tiles.decode_warps
    # The PTX works on 4 bytes at a time: tiles too small to give every thread 4 bytes (a
    # tiny TP-local expert) take the portable dequantization.
    asm = dequant_mode(x) if block_n * kb >= 4 * 32 * warps else 0
    return dict(BLOCK_N=block_n, KB=kb, ASM=asm, num_warps=warps)


def down_decode_launch(h, ids, tw, w2, s2, g2, out, k_inputs, top_k, tiles):
    """out[t] = sum over t's slots of tw[p] * g2[e] * (w2[e] @ h[p][:k_inputs]), p = t * top_k
    + slot routed to e = ids[p]; `out` [T, rows] in any float dtype. With top_k > 1 each pair
    writes a float32 partial row and `sum_slots` adds a token's rows in slot order."""
    jit, tokens, n_rows = _jit(), out.shape[0], w2.shape[1]
    block_n = min(tiles.decode_n, _pow2(n_rows))
    by_pair = top_k > 1
    dest = out if not by_pair else torch.empty(ids.numel(), n_rows, dtype=torch.float32,
                                               device=out.device)
    jit.down_decode[(ids.numel(), -(-n_rows // block_n))](
        h, ids, tw, w2, s2, g2, dest, n_rows, k_inputs // 2, top_k, h.stride(0),
        w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), dest.stride(0),
        BY_PAIR=by_pair, **_decode_meta(block_n, k_inputs // 2, ids.numel(), h, tiles))
    if by_pair:
        block = min(1024, _pow2(n_rows))
        jit.sum_slots[(tokens, -(-n_rows // block))](
            dest, out, n_rows, top_k, dest.stride(0), out.stride(0), BLOCK=block,
            TOPK=_pow2(top_k), num_warps=4)


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
