"""NVFP4 (4-bit e2m1 weights, e4m3 block scales per 16 inputs, a float32 global scale per
tensor): format, quantizer, torch reference, checkpoint readers, TP shard specs, backend
choice and the layers that use them."""

from freetoken.layers.quantization.nvfp4.backend import BackendChoice, BackendError, choose_backend
from freetoken.layers.quantization.nvfp4.checkpoint import (
    COMPRESSED_TENSORS,
    MODELOPT,
    NVFP4Config,
    NVFP4ConfigError,
    read_quant_config,
)
from freetoken.layers.quantization.nvfp4.format import GROUP, NVFP4FormatError, dequantize
from freetoken.layers.quantization.nvfp4.linear import NVFP4Linear
from freetoken.layers.quantization.nvfp4.moe import NVFP4FusedExperts
from freetoken.layers.quantization.nvfp4.quantizer import NVFP4Tensor, quantize

__all__ = [
    "BackendChoice", "BackendError", "choose_backend", "COMPRESSED_TENSORS", "MODELOPT",
    "NVFP4Config", "NVFP4ConfigError", "read_quant_config", "GROUP", "NVFP4FormatError",
    "dequantize", "NVFP4Linear", "NVFP4FusedExperts", "NVFP4Tensor", "quantize",
]
