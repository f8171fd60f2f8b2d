"""Launcher of `moe_rows_jit`: the routed experts of one token (the batch-1 decode step,
captured in CUDA graphs) without tensor cores, which `fused_moe.fused_moe` takes at one
token. Two launches: gate/up with SiLU-and-mul into h [top_k, I], then the down projection
with the routing weights and the slots' sum folded in. The scale arguments come from
`fused_moe` (its `_scale_args`), which validates them for both paths."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.kernels import interpreting, jit_module, next_pow2
from freetoken.kernels.quant_gemm import SM_PROGRAMS


@dataclass(frozen=True)
class RowMoeTiles:
    """Output features per program of the gate/up and of the down kernel, inputs per step
    (at most; a shorter row takes one step of its own length rounded up to a power of two)
    and warps."""

    gate_up_n: int = 4
    down_n: int = 4
    block_k: int = 1024
    num_warps: int = 4


INTERPRETER_TILES = RowMoeTiles(gate_up_n=64, down_n=64, block_k=256)
"""The interpreter pays per program and per operation: few programs of large tiles."""


def choose_tiles(hidden: int, inter: int, top_k: int) -> RowMoeTiles:
    """Up to 4 features per program and steps of up to 1024 inputs (a gate/up program of
    Qwen3.5-35B-A3B: 8 rows of 2048 bf16 weights in two steps, 32 KiB, all in flight at
    once; block FP8 steps within its column blocks, 128 inputs for Qwen's), halving the
    features per program while a launch would have fewer than about two programs per SM of
    an H200 (the gate/up launch at TP 8: 8 slots of 64 features is 128 programs of 4, 512
    of 1)."""
    if interpreting():
        return INTERPRETER_TILES
    gate_up_n, down_n = 4, 4
    while gate_up_n > 1 and top_k * _cdiv(inter, gate_up_n) < SM_PROGRAMS:
        gate_up_n //= 2
    while down_n > 1 and _cdiv(hidden, down_n) < SM_PROGRAMS:
        down_n //= 2
    return RowMoeTiles(gate_up_n=gate_up_n, down_n=down_n)


def _jit():
    """The kernel module, imported on first use (see `freetoken.kernels.jit_module`)."""
    return jit_module("moe_rows_jit")


def gate_up(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, tiles: RowMoeTiles,
            block_k: int, scale_args: dict) -> torch.Tensor:
    """h = SiLU(gate) * up [top_k, I] in x's dtype for the one token x [1, H] and its slots'
    experts `ids` [1, top_k]; `scale_args` the kernel's SCALE arguments, `block_k` the step
    (in SCALE 1 one that a single scale column serves)."""
    hidden = x.shape[1]
    top_k = ids.shape[1]
    inter = w13.shape[1] // 2
    h = torch.empty(top_k, inter, dtype=x.dtype, device=x.device)
    _jit().gate_up_rows_kernel[(top_k, _cdiv(inter, tiles.gate_up_n))](
        x_ptr=x, w13_ptr=w13, h_ptr=h, ids_ptr=ids, hidden=hidden, inter=inter,
        stride_ids_slot=ids.stride(1), stride_w13_expert=w13.stride(0),
        stride_w13_row=w13.stride(1), stride_h_slot=h.stride(0),
        EVEN_K=hidden % block_k == 0, STEPS=_cdiv(hidden, block_k), BLOCK_N=tiles.gate_up_n,
        BLOCK_K=block_k, num_warps=tiles.num_warps, **scale_args)
    return h


def down(h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w2: torch.Tensor,
         tiles: RowMoeTiles, block_k: int, scale_args: dict, sum_slots: bool,
         dtype: torch.dtype) -> torch.Tensor:
    """The token's weighted slots h[s] . w2[e_s]^T * weights[s]: summed in slot order in
    float32 and rounded once to `dtype`, [1, H]; or, without `sum_slots`, each slot's float32
    value [1, top_k, H]."""
    top_k, inter = h.shape
    hidden = w2.shape[1]
    out = (torch.empty(1, hidden, dtype=dtype, device=h.device) if sum_slots
           else torch.empty(1, top_k, hidden, dtype=torch.float32, device=h.device))
    _jit().down_rows_kernel[(_cdiv(hidden, tiles.down_n),)](
        h_ptr=h, w2_ptr=w2, weights_ptr=weights, ids_ptr=ids, out_ptr=out, hidden=hidden,
        inter=inter, stride_ids_slot=ids.stride(1), stride_weights_slot=weights.stride(1),
        stride_h_slot=h.stride(0), stride_w2_expert=w2.stride(0), stride_w2_row=w2.stride(1),
        stride_out_slot=0 if sum_slots else out.stride(1), TOP_K=top_k,
        BLOCK_S=next_pow2(top_k), SUM_SLOTS=sum_slots,
        EVEN_K=inter % block_k == 0, STEPS=_cdiv(inter, block_k), BLOCK_N=tiles.down_n,
        BLOCK_K=block_k, num_warps=tiles.num_warps, **scale_args)
    return out


def _cdiv(n: int, d: int) -> int:
    return -(-n // d)
