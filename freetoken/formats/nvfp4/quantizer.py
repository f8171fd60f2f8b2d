"""NVFP4 quantizer following ModelOpt's `NVFP4QTensor.quantize` (weights, group size 16):

- global scale (`weight_scale_2`) = amax(|W|) / (6 * 448), float32;
- block scale = block_amax / (6 * global), a zero block gets 1.0, cast to float8_e4m3fn
  (round to nearest even);
- element code = x / (block_scale_e4m3 * global) rounded to nearest on the e2m1 grid, ties to
  the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4),
  magnitudes above 6 clamp to 6; the sign bit is set for x < 0 (so -0.1 gives code 8, -0);
- codes packed two per byte, even element in the low nibble.

One deliberate difference: an all-zero tensor gets global scale 0 and all-zero codes, where
ModelOpt divides 0 by 0. A block whose scale underflows e4m3 (scale 0) gets code 0 everywhere
instead of ModelOpt's clamped +-6; both dequantize to 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.formats.nvfp4.format import (
    E2M1_MAX,
    E4M3_MAX,
    GROUP,
    NVFP4FormatError,
    dequantize,
    pack_nibbles,
)

# Midpoints between consecutive e2m1 magnitudes; ties at the odd-indexed ones (0.75, 1.75,
# 3.5) round up to the even code, the others (0.25, 1.25, 2.5, 5) down. ModelOpt's rule.
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)


@dataclass
class NVFP4Tensor:
    """One quantized weight in the normalised (ModelOpt) convention."""

    packed: torch.Tensor
    """uint8 [..., out, in / 2], even element in the low nibble."""
    block_scale: torch.Tensor
    """float8_e4m3fn [..., out, in / 16]."""
    global_scale: torch.Tensor
    """float32 scalar: value = e2m1 * block_scale * global_scale."""

    def dequantize(self) -> torch.Tensor:
        """float32 values, by table lookup."""
        return dequantize(self.packed, self.block_scale, self.global_scale)


def e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """Round float32 values onto the e2m1 grid (nearest, ties to even, clamp at 6): uint8
    codes 0..15."""
    bounds = torch.tensor(_BOUNDS, dtype=torch.float32, device=scaled.device)
    mag = scaled.abs()
    # searchsorted counts bounds strictly below |x|; a tie at an odd bound then steps up.
    code = torch.searchsorted(bounds, mag.contiguous(), right=False).to(torch.uint8)
    ties_up = torch.zeros_like(mag, dtype=torch.bool)
    for b in _TIES_UP:
        ties_up |= mag == b
    code = code + ties_up.to(torch.uint8)
    return code | ((scaled < 0).to(torch.uint8) << 3)


def global_scale_of(weight: torch.Tensor) -> torch.Tensor:
    """ModelOpt's per-tensor `weight_scale_2`: amax / (6 * 448), float32 scalar."""
    return weight.detach().abs().amax().to(torch.float32) / (E2M1_MAX * E4M3_MAX)


def quantize(weight: torch.Tensor, global_scale: torch.Tensor | None = None) -> NVFP4Tensor:
    """Quantize `weight` [..., out, in] (in a multiple of 16) to NVFP4. `global_scale`
    overrides the amax rule (ModelOpt does so when experts share a calibrated amax)."""
    if weight.shape[-1] % GROUP:
        raise NVFP4FormatError(f"cannot quantize: input size {weight.shape[-1]} is not a "
                               f"multiple of the {GROUP}-element group")
    w = weight.detach().to(torch.float32)
    g = global_scale_of(w) if global_scale is None else global_scale.to(torch.float32)
    blocks = w.unflatten(-1, (w.shape[-1] // GROUP, GROUP))
    block_amax = blocks.abs().amax(dim=-1)
    raw = block_amax / (E2M1_MAX * g)
    # ModelOpt's rule for empty blocks; block_amax == 0 also covers 0 / 0 when g == 0.
    raw = torch.where((raw == 0) | (block_amax == 0), torch.ones_like(raw), raw)
    # Only an explicit global_scale can push a block past e4m3's range; the cast would give NaN.
    block_scale = raw.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    step = block_scale.to(torch.float32) * g
    safe = torch.where(step > 0, step, torch.ones_like(step)).unsqueeze(-1)
    codes = e2m1_codes(blocks / safe)
    codes = torch.where((step > 0).unsqueeze(-1), codes, torch.zeros_like(codes))
    return NVFP4Tensor(pack_nibbles(codes.flatten(-2)), block_scale, g.reshape(()))
