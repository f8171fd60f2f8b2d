"""The dtype screen: quantized data (float8, uint8, int8 tensors) in a module the
quantization config does not declare quantized, or under a tensor name its format does not
write, is refused before anything loads, naming the tensor and its dtype. Without it a float8
checkpoint that lost its `quantization_config` loads (the loader casts e4m3 to the model
dtype without its scales) and generates fluent garbage, exit 0; the format of a module comes
from the config, never from a dtype."""

from __future__ import annotations

from pathlib import Path

from freetoken.formats.quant import UNQUANTIZED
from freetoken.formats.quant.resolve import FOREIGN
from freetoken.loading.files import CheckpointError
from freetoken.loading.validate import tensor_dtypes

QUANTIZED = {"F8_E4M3": "float8_e4m3fn", "F8_E4M3FNUZ": "float8_e4m3fnuz",
             "F8_E5M2": "float8_e5m2", "F8_E5M2FNUZ": "float8_e5m2fnuz", "U8": "uint8",
             "I8": "int8"}
"""safetensors dtypes no unquantized weight is stored in."""


def screen(dtypes: dict[str, str], quantization, source: str = "the checkpoint") -> None:
    """CheckpointError naming the first tensor of `dtypes` (name -> safetensors dtype) whose
    dtype is quantized data while `quantization` (a QuantScheme, None when the checkpoint has
    no quantization config) puts its module in no quantized format writing that tensor.
    Modules outside the engine (vision tower, MTP head) are not screened."""
    for name in sorted(dtypes):
        dtype = QUANTIZED.get(dtypes[name])
        module, _, suffix = name.rpartition(".")
        if dtype is None or any(name.startswith(f + ".") for f in FOREIGN):
            continue
        fmt = quantization.format_of(module) if quantization is not None else UNQUANTIZED
        if fmt.quantized and suffix in fmt.suffixes():
            continue
        declared = ("the checkpoint has no quantization config" if quantization is None
                    else f"{quantization.source} makes module {module!r} {fmt.describe()}")
        raise CheckpointError(
            f"{source}: tensor {name!r} is {dtype}, quantized data, but {declared}; it would "
            "load as garbage (a quantized checkpoint whose quantization config was lost or "
            "does not list this module?)")


def screen_checkpoint(folder: str | Path, quantization) -> None:
    """`screen` over a checkpoint folder's headers (see `screen`)."""
    screen(tensor_dtypes(folder), quantization, str(folder))
