"""Block FP8, defined independently of any kernel. A weight `W` [out, in] is stored as

- `weight` float8_e4m3fn [out, in];
- a block scale [ceil(out / B0), ceil(in / B1)] (HF calls it `weight_scale_inv`, yet it
  MULTIPLIES; bf16, fp16 or fp32), one per B0 x B1 block, the last row / column of blocks
  partial when B does not divide the size:

value[r, c] = float(weight[r, c]) * scale[r // B0, c // B1].

A rank holding rows `[start, start + n)` holds the scale rows covering them; its first row
sits `start % B0` rows into its first block (`offset`), which dequantization takes into
account so a shard dequantizes exactly to the full weight's rows. transformers' CPU
dequantizer derives B from the scale grid instead (`rows // scale_rows`) and is wrong on
partial blocks; this definition is the one the producers write."""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
FP8 = torch.float8_e4m3fn
SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class BlockFP8FormatError(ValueError):
    """Tensors that do not have the block-FP8 shapes or dtypes; the message names them."""


def scale_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """The scale shape of a weight of `shape`: ceil(out / B0), ceil(in / B1)."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def check(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str,
          offset: tuple[int, int] = (0, 0)) -> None:
    """BlockFP8FormatError naming `name` unless `weight` is e4m3 2-D and `scale` (a float
    dtype) covers it from `offset` inside its first block."""
    if weight.dtype != FP8 or weight.dim() != 2:
        raise BlockFP8FormatError(f"{name}: weight must be 2-D float8_e4m3fn, got "
                                  f"{weight.dtype} {tuple(weight.shape)}")
    if scale.dtype not in SCALE_DTYPES or scale.dim() != 2:
        raise BlockFP8FormatError(f"{name}: block scale must be 2-D bf16, fp16 or fp32, got "
                                  f"{scale.dtype} {tuple(scale.shape)}")
    for dim in (0, 1):
        need = -(-(weight.shape[dim] + offset[dim]) // block[dim])
        if scale.shape[dim] < need:
            raise BlockFP8FormatError(
                f"{name}: dim {dim} has {weight.shape[dim]} elements from offset "
                f"{offset[dim]}, needing {need} blocks of {block[dim]}; the scale has "
                f"{scale.shape[dim]}")


def expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int],
           offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """The block scale repeated to one value per weight element of `shape`, starting
    `offset` elements into the first block (float32)."""
    full = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return full[offset[0]:offset[0] + shape[0], offset[1]:offset[1] + shape[1]]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               offset: tuple[int, int] = (0, 0), dtype: torch.dtype = torch.float32,
               name: str = "weight") -> torch.Tensor:
    """The weight's values in `dtype` (computed in float32, or float64 when asked): fp8 code
    times its block's scale; `offset` is the shard's position inside its first block."""
    check(weight, scale, block, name, offset)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    values = weight.to(work) * expand(scale, tuple(weight.shape), block, offset).to(work)
    return values.to(dtype)


def quantize(w: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype = torch.float32
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, block scale in `scale_dtype`) with scale = block amax / 448 (1 for an
    all-zero block), the producers' rule; for tests and tiny checkpoints."""
    if w.dim() != 2:
        raise BlockFP8FormatError(f"quantize: weight must be 2-D, got {tuple(w.shape)}")
    rows, cols = scale_grid(tuple(w.shape), block)
    padded = w.new_zeros(rows * block[0], cols * block[1], dtype=torch.float32)
    padded[:w.shape[0], :w.shape[1]] = w.float()
    blocks = padded.reshape(rows, block[0], cols, block[1])
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).to(scale_dtype)
    per_element = expand(scale, tuple(w.shape), block)
    codes = (w.float() / per_element).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return codes, scale
