"""Launcher of `canonical_gemm_jit`, the GEMM of the `tp_invariant` mode on the engine's CUDA
path (`freetoken.layers.invariant` calls it where the step takes the Triton paths): one
fixed tiling for every shape, so an output element is the same bits at every TP size.

`chunk_products` is checked against `reference_chunk_products` (float64) and against its own
column and chunk slices bit for bit (tests/kernels/test_canonical_gemm.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.kernels import jit_module


@dataclass(frozen=True)
class CanonicalTiles:
    """Rows, columns and inputs per program, warps and stages: constants of the mode (a
    tile chosen by shape would make an element's arithmetic depend on the launch)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2


TILES = CanonicalTiles()


def _jit():
    """The kernel module, imported on first use (see `freetoken.kernels.jit_module`)."""
    return jit_module("canonical_gemm_jit")


def chunk_products(x: torch.Tensor, weight: torch.Tensor, chunks: int,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """[chunks, M, N] in `out_dtype`: entry c is `x[:, chunk c] weight[:, chunk c]^T` for x
    [M, K] and weight [N, K] cut into `chunks` equal chunks of K, accumulated in float32 and
    rounded once. `chunks=1` is the whole product (a column-parallel GEMM)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"canonical_gemm: x {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)} are not [M, K] and [N, K]")
    if x.dtype != weight.dtype:
        raise ValueError(f"canonical_gemm: x is {x.dtype} but weight is {weight.dtype}")
    rows, inputs = x.shape
    cols = weight.shape[0]
    if chunks < 1 or inputs % chunks:
        raise ValueError(f"canonical_gemm: {inputs} inputs do not split into {chunks} chunks")
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    out = torch.empty(chunks, rows, cols, dtype=out_dtype, device=x.device)
    if out.numel() == 0:
        return out
    t = TILES
    grid = (-(-rows // t.block_m), -(-cols // t.block_n), chunks)
    _jit().chunked_gemm_kernel[grid](
        x_ptr=x, w_ptr=weight, out_ptr=out, rows=rows, cols=cols, k_chunk=inputs // chunks,
        stride_x_row=x.stride(0), stride_w_row=weight.stride(0),
        stride_out_chunk=out.stride(0), stride_out_row=out.stride(1),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        # float32 stays float32 on tensor cores (tf32 would drop 13 bits of mantissa).
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=t.num_warps, num_stages=t.num_stages)
    return out


def reference_chunk_products(x: torch.Tensor, weight: torch.Tensor, chunks: int
                             ) -> torch.Tensor:
    """`chunk_products` in float64 (the oracle)."""
    inputs = x.shape[1]
    size = inputs // chunks
    return torch.stack([x[:, c * size:(c + 1) * size].double()
                        @ weight[:, c * size:(c + 1) * size].double().T
                        for c in range(chunks)])
