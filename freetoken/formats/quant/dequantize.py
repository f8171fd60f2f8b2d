"""One module's weight dequantized from its format definition, in float64, whatever its
format and producer: what a quantized checkpoint's dequantized twin is made of
(`freetoken.formats.quant.twin`).

The arithmetic is its own, written from the definitions (e2m1 values decoded from their sign,
exponent and mantissa bits; a block's scale found by index arithmetic), and shares no code
with the engine's dequantizers (`freetoken.formats.nvfp4.format`, `freetoken.formats.fp8.block`)
or its layers and kernels: a bug in those cannot cancel out between the engine and the
reference built from this."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from freetoken.formats.quant.format import (
    BF16,
    FP8_BLOCK,
    FP8_TENSOR,
    NVFP4,
    ModuleFormat,
    QuantConfigError,
)

NVFP4_GROUP = 16
CHUNK_BYTES = 64 << 20
"""A large module is dequantized a band of rows at a time, each band's float64 values at most
this size (a 35B lm_head in float64 would be 4 GB at once, its temporaries several times that)."""


def _fields(fmt: ModuleFormat, tensors: Mapping[str, torch.Tensor], module: str) -> dict:
    """`tensors` (checkpoint suffix -> tensor) by normalised field; missing ones named."""
    suffixes = fmt.suffixes()
    fields = {suffixes[s]: t for s, t in tensors.items() if s in suffixes}
    need = ("weight",) if fmt.kind == BF16 else ("weight", "weight_scale") + (
        ("weight_scale_2",) if fmt.kind == NVFP4 else ())
    missing = [f"{module}.{s}" for s, f in suffixes.items() if f in need and f not in fields]
    if missing:
        raise QuantConfigError(f"{module}: {fmt.describe()} tensors missing: "
                               f"{', '.join(missing)}")
    return fields


def check_scalar_scale(tensor: torch.Tensor, name: str) -> float:
    """A per-tensor scale (`weight_scale` of FP8 per tensor, an `input_scale`) as a float;
    QuantConfigError naming `name` unless it has one element, finite and above 0."""
    if tensor.numel() != 1:
        raise QuantConfigError(f"{name}: a per-tensor scale has 1 element, got shape "
                               f"{tuple(tensor.shape)}")
    value = float(tensor.double())
    if not math.isfinite(value) or value <= 0:
        raise QuantConfigError(f"{name}: per-tensor scale {value} is not finite and above 0")
    return value


def _need(ok: bool, module: str, what: str) -> None:
    if not ok:
        raise QuantConfigError(f"{module}: {what}")


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float64 values of 4-bit e2m1 codes: bit 3 the sign, bits 2..1 the exponent (bias 1),
    bit 0 the mantissa; exponent 0 is subnormal (0 or 0.5)."""
    c = codes.long()
    exponent, mantissa = (c >> 1) & 3, (c & 1).double()
    normal = (1 + mantissa / 2) * torch.pow(2.0, (exponent - 1).double())
    magnitude = torch.where(exponent > 0, normal, mantissa / 2)
    return torch.where((c & 8) > 0, -magnitude, magnitude)


def _check_nvfp4(fields: dict, module: str) -> None:
    packed, scale = fields["weight"], fields["weight_scale"]
    _need(packed.dtype == torch.uint8 and packed.dim() == 2, module,
          f"packed NVFP4 weight must be 2-D uint8, got {packed.dtype} {tuple(packed.shape)}")
    rows, inputs = packed.shape[0], packed.shape[1] * 2
    _need(inputs % NVFP4_GROUP == 0 and scale.dtype == torch.float8_e4m3fn
          and tuple(scale.shape) == (rows, inputs // NVFP4_GROUP), module,
          f"NVFP4 block scale must be float8_e4m3fn [{rows}, {inputs / NVFP4_GROUP:g}] for "
          f"{inputs} inputs in groups of {NVFP4_GROUP}, got {scale.dtype} "
          f"{tuple(scale.shape)}")
    check_scalar_scale(fields["weight_scale_2"], f"{module} global scale")


def _check_fp8_block(fields: dict, block: tuple[int, int], module: str) -> None:
    weight, scale = fields["weight"], fields["weight_scale"]
    _need(weight.dtype == torch.float8_e4m3fn and weight.dim() == 2, module,
          f"block-FP8 weight must be 2-D float8_e4m3fn, got {weight.dtype} "
          f"{tuple(weight.shape)}")
    grid = tuple(-(-n // b) for n, b in zip(weight.shape, block))
    _need(scale.is_floating_point() and tuple(scale.shape) == grid, module,
          f"block scale must be a float [{grid[0]}, {grid[1]}] grid of {block[0]}x{block[1]} "
          f"blocks over {tuple(weight.shape)}, got {scale.dtype} {tuple(scale.shape)}")


def check_module(fmt: ModuleFormat, tensors: Mapping[str, torch.Tensor], module: str) -> dict:
    """`tensors` (checkpoint suffix -> tensor) by normalised field, checked against `fmt`:
    every tensor it needs present, shapes and dtypes as the format defines them, per-tensor
    scales finite and above 0. QuantConfigError naming the module otherwise."""
    fields = _fields(fmt, tensors, module)
    if "input_scale" in fields:
        check_scalar_scale(fields["input_scale"], f"{module} input scale")
    if fmt.kind == NVFP4:
        _check_nvfp4(fields, module)
    elif fmt.kind == FP8_BLOCK:
        _check_fp8_block(fields, fmt.block, module)
    elif fmt.kind == FP8_TENSOR:
        check_scalar_scale(fields["weight_scale"], f"{module}.weight_scale")
    return fields


def _nvfp4(fields: dict, reciprocal: bool) -> torch.Tensor:
    packed, scale = fields["weight"], fields["weight_scale"]
    rows, inputs = packed.shape[0], packed.shape[1] * 2
    codes = torch.empty(rows, inputs, dtype=torch.uint8)
    codes[:, 0::2], codes[:, 1::2] = packed & 0x0F, packed >> 4  # element 2j: low nibble
    values = e2m1_values(codes) * scale.double()[:, torch.arange(inputs) // NVFP4_GROUP]
    g = float(fields["weight_scale_2"].double())
    return values / g if reciprocal else values * g


def _fp8_block(fields: dict, block: tuple[int, int]) -> torch.Tensor:
    weight, scale = fields["weight"], fields["weight_scale"]
    rows = torch.arange(weight.shape[0]) // block[0]
    cols = torch.arange(weight.shape[1]) // block[1]
    return weight.double() * scale.double()[rows][:, cols]


def dequantize_module(fmt: ModuleFormat, tensors: Mapping[str, torch.Tensor],
                      module: str) -> torch.Tensor:
    """Linear `module`'s weight [out, in] in float64 from its checkpoint tensors (`tensors`:
    suffix -> tensor, e.g. {"weight": ..., "weight_scale_inv": ...}), by the definition of
    `fmt`: NVFP4 e2m1 code x block scale x weight_scale_2 (ModelOpt) or / weight_global_scale
    (compressed-tensors); FP8 per tensor code x weight_scale; FP8 block code x its block's
    scale (the last blocks partial). A stored input scale is checked (finite, above 0) and
    otherwise unused: the engine is weight-only. QuantConfigError naming the module for a
    missing tensor or a shape the format cannot have (`check_module`)."""
    fields = check_module(fmt, tensors, module)
    if fmt.kind == NVFP4:
        return _nvfp4(fields, fmt.global_scale_is_reciprocal)
    if fmt.kind == FP8_BLOCK:
        return _fp8_block(fields, fmt.block)
    if fmt.kind == FP8_TENSOR:
        return fields["weight"].double() * float(fields["weight_scale"].double())
    return fields["weight"].double()


def _bands(fmt: ModuleFormat, rows: int, cols: int) -> list[tuple[int, int]]:
    """Row bands of at most CHUNK_BYTES of float64 values, cut on a block boundary."""
    step = max(1, CHUNK_BYTES // (8 * max(cols, 1)))
    if fmt.kind == FP8_BLOCK:
        step = max(fmt.block[0], step // fmt.block[0] * fmt.block[0])
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def _band(fmt: ModuleFormat, parts: dict, start: int, stop: int) -> dict:
    """The module's tensors for rows [start, stop): scales per row or per block row follow,
    per-tensor ones are whole."""
    out = {}
    for suffix, t in parts.items():
        field = fmt.suffixes().get(suffix)
        if t.dim() < 2 or field not in ("weight", "weight_scale"):
            out[suffix] = t
        elif fmt.kind == FP8_BLOCK and field == "weight_scale":
            out[suffix] = t[start // fmt.block[0]: -(-stop // fmt.block[0])]
        else:
            out[suffix] = t[start:stop]
    return out


def dequantized_weight(fmt: ModuleFormat, parts: dict, module: str,
                       dtype: torch.dtype) -> torch.Tensor:
    """`dequantize_module` rounded once to `dtype`; a large module a band of rows at a time
    (its shapes checked whole first, so a scale with rows to spare is still refused)."""
    fields = check_module(fmt, parts, module)
    rows, cols = fields["weight"].shape[0], fields["weight"].shape[1] * (
        2 if fmt.kind == NVFP4 else 1)
    if rows * cols * 8 <= CHUNK_BYTES:
        return dequantize_module(fmt, parts, module).to(dtype)
    out = torch.empty(rows, cols, dtype=dtype)
    for start, stop in _bands(fmt, rows, cols):
        out[start:stop] = dequantize_module(fmt, _band(fmt, parts, start, stop), module).to(dtype)
    return out
