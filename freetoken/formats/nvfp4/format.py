"""NVFP4 storage format (ModelOpt layout), independent of any kernel.

A weight `W` [out, in] is stored as:

- `weight` uint8 [out, in / 2]: 4-bit e2m1 codes, element 2j in the LOW nibble of byte j and
  element 2j + 1 in the high nibble;
- `weight_scale` float8_e4m3fn [out, in / 16]: one block scale per 16 consecutive inputs;
- `weight_scale_2` float32 scalar: the per-tensor global scale.

value = E2M1[code] * weight_scale[row, col // 16] * weight_scale_2. Codes 0..7 are
0, .5, 1, 1.5, 2, 3, 4, 6 and codes 8..15 their negatives (bit 3 is the sign).
"""

from __future__ import annotations

import functools

import torch

GROUP = 16
"""Inputs per block scale: a TP split of an input dimension must fall on a multiple of it."""
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class NVFP4FormatError(ValueError):
    """Tensors that do not have the NVFP4 shapes or dtypes; the message names them."""


def e2m1_table(device=None) -> torch.Tensor:
    """The 16 code values as float32, indexed by code: one tensor per device, made on first
    use, so a CUDA graph that dequantizes captures no host-to-device copy (read it only)."""
    return _e2m1_table(torch.device("cpu" if device is None else device))


@functools.cache
def _e2m1_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., 2n] (values 0..15, any integer dtype) -> bytes uint8 [..., n], element 2j in
    the low nibble."""
    if codes.shape[-1] % 2:
        raise NVFP4FormatError(f"cannot pack {codes.shape[-1]} codes: the last dim must be even")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes uint8 [..., n] -> codes uint8 [..., 2n]; the inverse of `pack_nibbles`."""
    if packed.dtype != torch.uint8:
        raise NVFP4FormatError(f"packed NVFP4 weights must be uint8, got {packed.dtype}")
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def check_shapes(packed: torch.Tensor, block_scale: torch.Tensor, name: str = "weight") -> int:
    """Validate one NVFP4 weight's tensors; returns the logical input size. Errors name `name`
    and the sizes that disagree."""
    if packed.dtype != torch.uint8:
        raise NVFP4FormatError(f"{name}: packed weight must be uint8, got {packed.dtype}")
    if block_scale.dtype != torch.float8_e4m3fn:
        raise NVFP4FormatError(f"{name}: block scale must be float8_e4m3fn, got "
                               f"{block_scale.dtype}")
    full_in = packed.shape[-1] * 2
    if full_in % GROUP:
        raise NVFP4FormatError(f"{name}: input size {full_in} ({packed.shape[-1]} packed bytes) "
                               f"is not a multiple of the {GROUP}-element group")
    want = (*packed.shape[:-1], full_in // GROUP)
    if tuple(block_scale.shape) != want:
        raise NVFP4FormatError(f"{name}: block scale has shape {tuple(block_scale.shape)}, "
                               f"packed weight {tuple(packed.shape)} needs {want}")
    return full_in


def dequantize(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
               name: str = "weight") -> torch.Tensor:
    """float32 values of an NVFP4 weight by table lookup: the reference every kernel is
    checked against. Leading dims (e.g. experts) broadcast with a matching `global_scale`
    shaped [...] (one scalar per leading index) or a plain scalar."""
    full_in = check_shapes(packed, block_scale, name)
    values = e2m1_table(packed.device)[unpack_nibbles(packed).long()]
    blocks = values.unflatten(-1, (full_in // GROUP, GROUP))
    # fp8 -> fp32 first: torch cannot do arithmetic on float8 tensors on CPU.
    blocks = blocks * block_scale.to(torch.float32).unsqueeze(-1)
    g = global_scale.to(torch.float32)
    g = g.reshape(*g.shape, *([1] * (blocks.dim() - g.dim())))
    return (blocks * g).flatten(-2)
