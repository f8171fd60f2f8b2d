"""NVFP4 checkpoints from ModelOpt and compressed-tensors, read into one normalised form.

Normalised form (ModelOpt's): per quantized linear `M`, tensors `M.weight` (uint8, packed),
`M.weight_scale` (e4m3 blocks), `M.weight_scale_2` (float32 global multiplier) and optionally
`M.input_scale`. compressed-tensors names them `weight_packed`, `weight_scale`,
`weight_global_scale`, `input_global_scale`, with the same packing and the same block scales
but the RECIPROCAL global: CT's `weight_global_scale` = 6 * 448 / amax, and CT dequantizes as
code * weight_scale / weight_global_scale. Normalising takes 1 / g once, in float64, rounded
to float32: the two forms then dequantize identically up to that one rounding (at most one
float32 ulp of the global scale, a relative 2^-24 on every weight); no float32 global g has
1 / (1 / g) == g guaranteed, so bit equality is not available.

Which modules are NVFP4, and in whose naming, is the quantization config's answer
(`freetoken.formats.quant`): this module only reads the tensors. For loading through a shard
plan (one checkpoint tensor at a time) `canonical_field` maps a tensor suffix to the
normalised field, and `ModuleFormat.global_scale_is_reciprocal` tells the layer to invert its
global scales at run time instead of in a shard spec, so that shard specs stay bitwise
invertible.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch

from freetoken.formats.nvfp4.format import check_shapes
from freetoken.formats.nvfp4.quantizer import NVFP4Tensor
from freetoken.formats.quant.format import (
    COMPRESSED_TENSORS,
    MODELOPT,
    NVFP4,
    ModuleFormat,
    QuantConfigError,
)

FIELDS = ("weight", "weight_scale", "weight_scale_2", "input_scale")
_SUFFIXES = {p: ModuleFormat(NVFP4, p).suffixes() for p in (MODELOPT, COMPRESSED_TENSORS)}
_RECIPROCAL = {COMPRESSED_TENSORS: ("weight_global_scale", "input_global_scale")}


class NVFP4ConfigError(QuantConfigError):
    """A checkpoint tensor FreeToken cannot read as NVFP4."""


def tensor_suffixes(producer: str) -> dict[str, str]:
    """`producer`'s checkpoint tensor suffix -> normalised (ModelOpt) field."""
    if producer not in _SUFFIXES:
        raise NVFP4ConfigError(f"unknown NVFP4 producer {producer!r}; expected "
                               f"{MODELOPT!r} or {COMPRESSED_TENSORS!r}")
    return dict(_SUFFIXES[producer])


def canonical_field(name: str, producer: str) -> tuple[str, str] | None:
    """`M.<suffix>` -> (M, normalised field), or None when `name` is no NVFP4 tensor."""
    module, _, suffix = name.rpartition(".")
    field = _SUFFIXES[producer].get(suffix)
    return (module, field) if field and module else None


def normalise_tensor(name: str, tensor: torch.Tensor, producer: str) -> torch.Tensor:
    """One checkpoint tensor in the normalised convention: CT's reciprocal global scales are
    inverted (float64, rounded once to float32); global scales become float32 scalars."""
    suffix = name.rpartition(".")[2]
    if suffix in _RECIPROCAL.get(producer, ()):
        return (1.0 / tensor.to(torch.float64)).to(torch.float32).reshape(())
    if _SUFFIXES[producer].get(suffix) in ("weight_scale_2", "input_scale"):
        return tensor.to(torch.float32).reshape(())
    return tensor


def _global(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if tensor.numel() != 1:
        raise NVFP4ConfigError(f"{name}: a per-tensor global scale has 1 element, got shape "
                               f"{tuple(tensor.shape)}")
    if not bool(torch.isfinite(tensor).all()) or float(tensor) < 0:
        raise NVFP4ConfigError(f"{name}: global scale {float(tensor)} is not finite and >= 0")
    return tensor


def read_nvfp4_weight(get: Callable[[str], torch.Tensor], names: Collection[str], module: str,
                      producer: str) -> tuple[NVFP4Tensor, torch.Tensor | None]:
    """Read linear `module`'s tensors via `get(name)` into the normalised form; `names` is
    what the checkpoint holds. Returns the weight and its input scale (None when absent).
    Errors name the offending tensor."""
    want = {field: f"{module}.{suffix}" for suffix, field in _SUFFIXES[producer].items()}
    missing = [want[f] for f in FIELDS[:3] if want[f] not in names]
    if missing:
        raise NVFP4ConfigError(f"{module}: NVFP4 ({producer}) tensors missing: "
                               f"{', '.join(missing)}")
    packed, block = get(want["weight"]), get(want["weight_scale"])
    check_shapes(packed, block, f"{want['weight']} / {want['weight_scale']}")
    g_name = want["weight_scale_2"]
    g = normalise_tensor(g_name, _global(get(g_name), g_name), producer)
    input_scale = None
    if want["input_scale"] in names:
        input_scale = normalise_tensor(want["input_scale"], get(want["input_scale"]), producer)
    return NVFP4Tensor(packed, block, g), input_scale


def to_checkpoint(weight: NVFP4Tensor, module: str, producer: str) -> dict[str, torch.Tensor]:
    """`weight` as `producer` stores it (for tests and tiny checkpoints): ModelOpt's global
    scale is a 0-dim float32 tensor, compressed-tensors' the float32 reciprocal, shape [1]."""
    g = weight.global_scale.to(torch.float32).reshape(())
    if producer == COMPRESSED_TENSORS:
        g = (1.0 / g.to(torch.float64)).to(torch.float32).reshape(1)
    tensors = {"weight": weight.packed, "weight_scale": weight.block_scale, "weight_scale_2": g}
    return {f"{module}.{suffix}": tensors[field].clone()
            for suffix, field in _SUFFIXES[producer].items() if field in tensors}
