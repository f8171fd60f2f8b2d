"""Launchers of `gemv_jit`: decode-step linear layers (up to MAX_TOKENS tokens) with their
neighbouring small steps fused in, and the MoE block's combination, for the engine's CUDA
path. Each is checked against the torch composition it replaces (`reference_linear`,
`reference_moe_combine`: the engine's CPU path, step by step)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from freetoken.kernels import interpreting, jit_module, next_pow2
from freetoken.kernels.pdl import available as pdl_available
from freetoken.kernels.pdl import launch as pdl_launch
from freetoken.kernels.tile_table import parse_tiles, read_tile_table, spell_tiles

MAX_TOKENS = 16
"""Up to this many tokens a linear layer takes `gemv_kernel`; more go to the GEMM."""
REDUCE_BLOCK_N = 256
NORM_BLOCK = 4096
"""The row kernel's RMSNorm statistics take up to this many inputs per step."""
ROW_PREFETCH = True
"""True: the 16-bit row kernel (`gemv_rows_jit`) of a call with an input norm loads each
weight tile a step ahead, the first before the norm's full-row pass (`prefetches`); False:
the tile is loaded in its step (the pipeliner's prologue then comes after the norm's pass).
On an H100 at one token: realdims attention qkv + norm 16.8 -> 16.0 us, GatedDeltaNet
in_proj + norm 20.9 -> 20.7 us, the same bits (the FP8 row kernel gained nothing from it:
docs/performance.md)."""


ROW_EARLY = True
"""True: the row kernels (16-bit, and FP8 and NVFP4 in `quant_gemm`) load the residual
before their sums and, where the 16-bit one prefetches, the norm weight's tile beside the
weights' (not after the norm's and the sums' cross-warp reductions, which a load cannot
pass); False: where they are used (`bench/tile_ab.py` switch `no-row-early`). The same bits
either way."""

ROW_PDL = True
"""True: the 16-bit row kernel launches with programmatic dependent launch where the GPU has
it (`freetoken.kernels.pdl`): its programs start while the stream's previous kernel
finishes, load their first weight tile and wait for it before they read x; each lets the
next kernel launch as it starts. With the decode attention's `launch_next`, the medium
Llama's one-token step went from 324-330 to 284-286 us on an H100 (docs/performance.md).
False: ordinary launches (`bench/tile_ab.py` switch `no-row-pdl`)."""


def prefetches(norm: bool, pdl: bool = False) -> bool:
    """The 16-bit row kernel's PREFETCH for a call with (`norm`) or without an input norm,
    launched with (`pdl`) or without programmatic dependent launch (which needs the first
    tile loaded before the wait)."""
    return pdl or (ROW_PREFETCH and norm)


@dataclass(frozen=True)
class Norm:
    """An RMSNorm to apply to x before the projection: `weight`, `eps`, and `offset`
    (the weight is `1 + w`, Gemma / Qwen3.5)."""

    weight: torch.Tensor
    eps: float
    offset: bool


@dataclass(frozen=True)
class GemvTiles:
    """Output features per program, input features per step, warps, pipeline stages, and
    into how many parts the inputs are split (more than 1: a second launch adds them).
    `rows`: the kernel without tensor cores (`gemv_rows_jit`: one token per program, any
    number of features per program) instead of the 16-token dot tiles of `gemv_jit`."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    split: int = 1
    rows: bool = False

    def key(self) -> str:
        """The tile table's spelling: `block_n/block_k/warps/stages/split`, with an `r`
        before it for the row kernel."""
        return spell_tiles((self.block_n, self.block_k, self.num_warps, self.num_stages,
                            self.split), self.rows)

    @classmethod
    def parse(cls, entry: str) -> GemvTiles:
        """The tiles a table entry spells (`key`'s inverse); ValueError naming the entry."""
        return parse_tiles(cls, entry, "[r]block_n/block_k/warps/stages/split")


def _jit():
    """The kernel module, imported on first use (see `freetoken.kernels.jit_module`)."""
    return jit_module("gemv_jit")


def _rows_jit():
    return jit_module("gemv_rows_jit")


@functools.cache
def enabled() -> bool:
    """Whether the engine's CUDA path takes these kernels: yes unless the environment sets
    FREETOKEN_DECODE_GEMV=0 (for A/B timing against the GEMM and the separate small
    kernels), read once per process."""
    return os.environ.get("FREETOKEN_DECODE_GEMV", "1") != "0"


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` serves this call: a 2-d x of at most MAX_TOKENS tokens whose dtype
    is the weight's, floating point."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_TOKENS and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and weight.dim() == 2 and weight.stride(-1) == 1)


def choose_tiles(out_features: int, in_features: int, dtype: torch.dtype) -> GemvTiles:
    """Tiles for a [out_features, in_features] weight when the measured table has none:
    16 features per program (the smallest tensor-core tile, so the most programs over a
    small weight), 32 when that still leaves several programs per SM; steps of 256 inputs
    (float32: 128); the inputs split (up to 8 ways, each part at least a step) until
    there are about two programs per SM of an H200. The interpreter, which pays per program
    and per operation, takes 64 features per program and no split."""
    block_k = min(128 if dtype == torch.float32 else 256, max(16, next_pow2(in_features)))
    if interpreting():
        return GemvTiles(block_n=64, block_k=block_k)
    block_n = 32 if out_features >= 32 * 264 else 16
    programs, split = _cdiv(out_features, block_n), 1
    while split < 8 and programs * split * 2 <= 264 and in_features >= 2 * split * block_k:
        split *= 2
    return GemvTiles(block_n=block_n, block_k=block_k, split=split)


def table_key(rows: int, in_features: int, tokens: int, norm: bool, gated: bool,
              residual: bool) -> str:
    """The measured table's key of a call: weight shape, what is fused, token bucket (1,
    or 2..MAX_TOKENS)."""
    fused = "+".join(n for n, on in (("norm", norm), ("gated", gated), ("residual", residual))
                     if on) or "plain"
    return f"{rows}x{in_features}/{fused}/{1 if tokens == 1 else MAX_TOKENS}"


@functools.cache
def _table() -> dict:
    """The tile table: FREETOKEN_GEMV_TABLE (a JSON file `bench/decode_kernels.py --write`
    wrote) when set, else `gemv_tiles.H200`."""
    return read_tile_table("FREETOKEN_GEMV_TABLE", _shipped)


def _shipped() -> dict:
    from freetoken.kernels.gemv_tiles import H200

    return H200


def tiles_for(x: torch.Tensor, weight: torch.Tensor, *, norm: Norm | None = None,
              gated: bool = False, residual: torch.Tensor | None = None) -> GemvTiles | None:
    """The tiles `linear` takes for this call, or None for the unfused path (the GEMM and
    the separate small kernels). 16-bit activations look the measured table up: a shape,
    fusion and token bucket it lacks, or one where it found the unfused path faster, gets
    None (untimed tiles were slower than the GEMM at some shapes). float32 takes
    `choose_tiles` (its GEMM is no faster, and the float32 engine tests exercise it)."""
    if x.dtype == torch.float32:
        out_features = weight.shape[0] // 2 if gated else weight.shape[0]
        return choose_tiles(out_features, x.shape[1], x.dtype)
    entry = _table().get(table_key(weight.shape[0], x.shape[1], x.shape[0], norm is not None,
                                   gated, residual is not None))
    if entry is None or entry == "gemm":
        return None
    return GemvTiles.parse(entry)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           norm: Norm | None = None, gated: bool = False,
           residual: torch.Tensor | None = None, tiles: GemvTiles | None = None,
           normed: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(rms_norm(x), weight, bias)` for x [T, in] (T <= MAX_TOKENS) in one launch;
    with `gated` the weight stacks [gate | up] and the result is `silu(gate) * up`
    [T, out / 2]; with `residual` [T, out] it is `residual + y`. The norm, when given,
    normalises over x's whole row; with `normed` (x's shape and dtype) the launch also
    stores there the normalised x its dot read (`reference_norm`)."""
    tokens, in_features = x.shape
    if weight.shape[1] != in_features:
        raise ValueError(f"gemv: x has {in_features} input features, weight "
                         f"{tuple(weight.shape)} takes {weight.shape[1]}")
    check_normed(x, norm, normed, "gemv")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"gemv: a gated weight stacks [gate | up], but {tuple(weight.shape)} "
                         "has an odd number of rows")
    out_features = weight.shape[0] // 2 if gated else weight.shape[0]
    out = torch.empty(tokens, out_features, dtype=x.dtype, device=x.device)
    if residual is not None and tuple(residual.shape) != (tokens, out_features):
        raise ValueError(f"gemv: residual {tuple(residual.shape)} is not the output's "
                         f"{(tokens, out_features)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    residual = None if residual is None else (
        residual if residual.stride(-1) == 1 else residual.contiguous())
    tiles = tiles or choose_tiles(out_features, in_features, x.dtype)
    block_m, rows = 16, weight.shape[0]
    step = _cdiv(_cdiv(in_features, tiles.split), tiles.block_k) * tiles.block_k
    splits = _cdiv(in_features, step)
    partial = (torch.empty(splits, tokens, rows, dtype=torch.float32, device=x.device)
               if splits > 1 else out)
    fused = dict(bias_ptr=bias if bias is not None else weight,
                 residual_ptr=residual if residual is not None else out,
                 stride_residual_token=residual.stride(0) if residual is not None else 0,
                 GATED=gated, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None)
    main = fused if splits == 1 else dict(fused, GATED=False, HAS_BIAS=False, HAS_RESIDUAL=False)
    args = dict(
        x_ptr=x, weight_ptr=weight, norm_weight_ptr=norm.weight if norm is not None else weight,
        partial_ptr=partial, out_ptr=out, normed_ptr=normed if normed is not None else x,
        stride_normed_token=normed.stride(0) if normed is not None else 0,
        STORE_NORMED=normed is not None, tokens=tokens,
        out_features=rows if splits > 1 else out_features, in_features=in_features,
        split_features=step, eps=norm.eps if norm is not None else 0.0,
        stride_x_token=x.stride(0), stride_weight_row=weight.stride(0),
        stride_partial_split=tokens * rows, stride_out_token=out.stride(0),
        NORM=0 if norm is None else (2 if norm.offset else 1), SPLIT=splits > 1,
        EVEN_K=in_features % tiles.block_k == 0, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **main)
    features = _cdiv(rows if splits > 1 else out_features, tiles.block_n)
    if tiles.rows:
        early = ROW_PDL and pdl_available(x)
        pdl_launch(_rows_jit().gemv_rows_kernel, (features, tokens, splits), early,
                   NORM_BLOCK=min(NORM_BLOCK, next_pow2(in_features)),
                   PREFETCH=prefetches(norm is not None, early), EARLY=int(ROW_EARLY), **args)
    else:
        _jit().gemv_kernel[(features, _cdiv(tokens, block_m), splits)](
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=block_m, **args)
    if splits > 1:
        reduce_m = min(block_m, next_pow2(tokens))
        _jit().gemv_reduce_kernel[(_cdiv(out_features, REDUCE_BLOCK_N), _cdiv(tokens, reduce_m))](
            partial_ptr=partial, out_ptr=out, tokens=tokens, out_features=rows, splits=splits,
            stride_partial_split=tokens * rows, stride_out_token=out.stride(0),
            BLOCK_M=reduce_m, BLOCK_N=REDUCE_BLOCK_N, num_warps=4, **fused)
    return out


def check_normed(x: torch.Tensor, norm: Norm | None, normed: torch.Tensor | None,
                 what: str) -> None:
    """ValueError naming `what` unless `normed` (when given) can take the normalised x of
    a call with a norm: x's shape and dtype, contiguous rows."""
    if normed is not None and (norm is None or normed.shape != x.shape
                               or normed.dtype != x.dtype or normed.stride(-1) != 1):
        raise ValueError(f"{what}: normed {tuple(normed.shape)} {normed.dtype} takes the "
                         f"normalised x {tuple(x.shape)} {x.dtype} (contiguous rows) of a "
                         f"call with a norm (norm given: {norm is not None})")


def moe_combine(slots: torch.Tensor, x: torch.Tensor, gate_weight: torch.Tensor,
                shared: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """`slots.sum(1).to(x.dtype) + sigmoid(F.linear(x, gate_weight)) * shared` in one
    launch: slots float32 [T, k, H] (the routed experts' weighted outputs), or one slot in
    x's dtype [T, 1, H] (experts that sum their slots themselves: the rounded sum), x [T, H]
    the MoE block's input, gate_weight [1, H], shared [T, H] the shared expert's output;
    plus `residual` [T, H] where given (the decoder layer's add, rounded after the block's
    output is, as `residual + block(x)` rounds)."""
    tokens, hidden = x.shape
    if slots.dim() != 3 or slots.shape[0] != tokens or slots.shape[2] != hidden or \
            gate_weight.numel() != hidden:
        raise ValueError(f"moe_combine: slots {tuple(slots.shape)}, gate weight "
                         f"{tuple(gate_weight.shape)} do not fit x {tuple(x.shape)}")
    if residual is not None and tuple(residual.shape) != tuple(x.shape):
        raise ValueError(f"moe_combine: residual {tuple(residual.shape)} does not fit x "
                         f"{tuple(x.shape)}")
    if slots.dtype != torch.float32 and (slots.dtype != x.dtype or slots.shape[1] != 1):
        raise ValueError(f"moe_combine: slots {tuple(slots.shape)} {slots.dtype}: float32 "
                         f"slots, or one slot in x's dtype {x.dtype}")
    out = torch.empty_like(x)
    x = x.contiguous()
    slots = slots.contiguous()
    shared = shared.contiguous()
    residual = None if residual is None else residual.contiguous()
    block = min(1024, next_pow2(hidden))
    _jit().moe_combine_kernel[(tokens, _cdiv(hidden, block))](
        slots_ptr=slots, x_ptr=x, gate_weight_ptr=gate_weight.reshape(-1), shared_ptr=shared,
        residual_ptr=x if residual is None else residual, out_ptr=out, hidden=hidden,
        top_k=slots.shape[1], stride_slots_token=slots.stride(0),
        stride_slots_slot=slots.stride(1), stride_x_token=x.stride(0),
        stride_shared_token=shared.stride(0),
        stride_residual_token=0 if residual is None else residual.stride(0),
        stride_out_token=out.stride(0), BLOCK_N=block, BLOCK_D=block,
        RESIDUAL=residual is not None, num_warps=4)
    return out


def reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     *, norm: Norm | None = None, gated: bool = False,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
    """The torch steps `linear` fuses, each rounded as the engine's CPU path rounds it."""
    if norm is not None:
        x = reference_norm(x, norm)
    y = F.linear(x, weight, bias)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if residual is None else residual + y


def reference_norm(x: torch.Tensor, norm: Norm) -> torch.Tensor:
    """The RMSNorm `linear` applies before its dot, rounded as the engine's CPU path rounds
    it (what `linear(..., normed=)` stores)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    return ((h * (1.0 + norm.weight.float())).to(x.dtype) if norm.offset
            else norm.weight * h.to(x.dtype))


def reference_moe_combine(slots: torch.Tensor, x: torch.Tensor, gate_weight: torch.Tensor,
                          shared: torch.Tensor, residual: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """The torch steps `moe_combine` fuses (`SparseMoeBlock`'s CPU path)."""
    routed = slots.sum(dim=1).to(x.dtype)
    out = routed + torch.sigmoid(F.linear(x, gate_weight)) * shared
    return out if residual is None else residual + out


def _cdiv(n: int, d: int) -> int:
    return -(-n // d)
