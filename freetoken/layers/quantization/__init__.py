"""Layers that compute with quantized weights: NVFP4 routed experts (`nvfp4/`) and the
weight-only linear methods (`fp8/`), chosen per layer by `linear_method` from the module's
format (the formats themselves are `freetoken.formats`)."""

from freetoken.layers.quantization.method import Split, linear_method

__all__ = ["Split", "linear_method"]
