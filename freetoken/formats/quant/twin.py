"""One module's weight dequantized from the format definition, in float64, whatever its
format and producer: what a harness builds a dequantized twin from (HF's own loaders are not
reliable for these checkpoints: CPU block-FP8 dequantization is wrong on partial blocks,
compressed-tensors NVFP4 experts come out times their global scale, ModelOpt is not read).
Independent of the engine's layers and kernels, so it can check them."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from freetoken.formats.fp8 import block as fp8_block
from freetoken.formats.nvfp4.format import check_shapes, e2m1_table, unpack_nibbles
from freetoken.formats.quant.format import (
    BF16,
    FP8_BLOCK,
    FP8_TENSOR,
    NVFP4,
    ModuleFormat,
    QuantConfigError,
)


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


def dequantize_module(fmt: ModuleFormat, tensors: Mapping[str, torch.Tensor],
                      module: str) -> torch.Tensor:
    """Linear `module`'s weight [out, in] in float64 from its checkpoint tensors (`tensors`:
    suffix -> tensor, e.g. {"weight": ..., "weight_scale_inv": ...}), by the definition of
    `fmt`: NVFP4 code x block scale x weight_scale_2 (ModelOpt) or / weight_global_scale
    (compressed-tensors); FP8 per tensor code x weight_scale; FP8 block code x its block's
    scale. A stored input scale is checked (finite, above 0) and otherwise unused: the
    engine is weight-only."""
    fields = _fields(fmt, tensors, module)
    if "input_scale" in fields:
        check_scalar_scale(fields["input_scale"], f"{module} input scale")
    weight = fields["weight"]
    if fmt.kind == BF16:
        return weight.double()
    if fmt.kind == FP8_BLOCK:
        return fp8_block.dequantize(weight, fields["weight_scale"], fmt.block,
                                    dtype=torch.float64, name=f"{module}.weight")
    if fmt.kind == FP8_TENSOR:
        scale = check_scalar_scale(fields["weight_scale"], f"{module}.weight_scale")
        return weight.double() * scale
    check_shapes(weight, fields["weight_scale"], f"{module}.weight")
    g = check_scalar_scale(fields["weight_scale_2"], f"{module} global scale")
    values = e2m1_table().double()[unpack_nibbles(weight).long()]
    blocks = values.unflatten(-1, (-1, 16)) * fields["weight_scale"].double().unsqueeze(-1)
    blocks = blocks / g if fmt.global_scale_is_reciprocal else blocks * g
    return blocks.flatten(-2)


def write_dequantized_twin(folder: str | Path, dst: str | Path, scheme,
                           dtype: torch.dtype = torch.float32) -> Path:
    """Copy checkpoint `folder` (one `model.safetensors`) to `dst` with every quantized
    module (by `scheme`, the folder's QuantScheme) replaced by its `weight` dequantized in
    float64 from the format definition and rounded once to `dtype`, its scales dropped, and
    no quantization config left: the unquantized model the quantized one must compute."""
    folder, dst = Path(folder), Path(dst)
    shutil.copytree(folder, dst)
    (dst / "hf_quant_config.json").unlink(missing_ok=True)
    tensors = load_file(folder / "model.safetensors")
    # A scheme answers for linear modules; an embedding or norm it would call quantized
    # still holds its plain weight, so only modules whose weight is in the format's dtype
    # are dequantized.
    quantized = set()
    for name, t in tensors.items():
        module, _, suffix = name.rpartition(".")
        fmt = scheme.format_of(module)
        if fmt.suffixes().get(suffix) == "weight" and t.dtype in fmt.weight_dtypes():
            quantized.add(module)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    out = {}
    for name, t in tensors.items():
        module, _, suffix = name.rpartition(".")
        if module in quantized and suffix in scheme.format_of(module).suffixes():
            modules.setdefault(module, {})[suffix] = t
        else:
            out[name] = t
    for module, parts in modules.items():
        out[f"{module}.weight"] = dequantize_module(scheme.format_of(module), parts,
                                                    module).to(dtype)
    save_file(out, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
