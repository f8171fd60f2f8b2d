"""Which format each module of a quantized checkpoint is in, read from any of the three
producers (ModelOpt, compressed-tensors, HF `fp8`), in one answer: the module formats
(`format`), a producer's config parsed into a `QuantScheme` (`producers`, `scheme`), and the
resolution of every engine module, fused destinations included, against a model's module
table (`resolve`). Format-specific tensors live beside it (`nvfp4/`, `fp8/`)."""

from freetoken.formats.quant.format import (
    BF16,
    FP8_BLOCK,
    FP8_TENSOR,
    NVFP4,
    UNQUANTIZED,
    ModuleFormat,
    QuantConfigError,
)
from freetoken.formats.quant.producers import parse_quant_config, read_quant_config
from freetoken.formats.quant.resolve import Destination, Gemm, ModuleTable, resolve
from freetoken.formats.quant.scheme import QuantScheme

__all__ = ["BF16", "FP8_BLOCK", "FP8_TENSOR", "NVFP4", "UNQUANTIZED", "Destination", "Gemm",
           "ModuleFormat", "ModuleTable", "QuantConfigError", "QuantScheme",
           "parse_quant_config", "read_quant_config", "resolve"]
