"""The weight-only formats' values, written from their definitions and independent of the
engine (no engine dequantizer is imported): the `kernels` check judges every quantized GEMM
the engine runs by them. Everything is float64, in which each product below is exact.

- FP8 (e4m3fn: 1 sign bit, 4 exponent bits with bias 7, 3 mantissa bits, exponent 0
  subnormal, 0x7F / 0xFF NaN), decoded from the bits;
- FP8 per tensor: value = e4m3 * the tensor's 0-d `weight_scale` (a multiplier);
- FP8 block (B0 x B1): value[r, c] = e4m3[r, c] * scale[r // B0, c // B1], the last row /
  column of blocks partial where B does not divide the size; HF's `weight_scale_inv`
  multiplies despite its name;
- NVFP4 (`freetoken_verify.checks.kernels.nvfp4_oracle`: e2m1 codes two per byte, one e4m3
  scale per 16 inputs) with ModelOpt's global `weight_scale_2` multiplying or
  compressed-tensors' `weight_global_scale` dividing: value = e2m1 * block / global."""

from __future__ import annotations

import torch

from freetoken_verify.checks.kernels.nvfp4_oracle import GROUP, e2m1_values, e4m3_values, unpack


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]
            ) -> torch.Tensor:
    """One float64 scale per weight element: block (i, j) covers rows [i B0, (i + 1) B0) and
    inputs [j B1, (j + 1) B1), cut at the weight's edge."""
    s = scale.to(torch.float64).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return s[:shape[0], :shape[1]]


def fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
              ) -> torch.Tensor:
    """A block-FP8 checkpoint tensor's float64 values [out, in]."""
    if tuple(scale.shape) != (-(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1])):
        raise ValueError(f"block scale {tuple(scale.shape)} does not cover a weight of "
                         f"{tuple(weight.shape)} in {block[0]} x {block[1]} blocks")
    return e4m3_values(weight) * _expand(scale, tuple(weight.shape), block)


def fp8_tensor(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A per-tensor FP8 checkpoint tensor's float64 values."""
    return e4m3_values(weight) * scale.reshape(()).to(torch.float64)


def nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
          divides: bool) -> torch.Tensor:
    """An NVFP4 checkpoint tensor's float64 values [out, in]; `divides`: the stored global
    is compressed-tensors' divisor, else ModelOpt's multiplier."""
    codes = e2m1_values(unpack(packed))
    blocks = e4m3_values(block_scale).repeat_interleave(GROUP, dim=-1)
    g = global_scale.reshape(()).to(torch.float64)
    return codes * blocks / g if divides else codes * blocks * g
