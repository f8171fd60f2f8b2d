"""Layers that compute with NVFP4 weights (the format itself is `freetoken.formats.nvfp4`):
the backend choice, the torch reference backend and the layers."""

from freetoken.layers.quantization.nvfp4.backend import BackendChoice, BackendError, choose_backend
from freetoken.layers.quantization.nvfp4.linear import NVFP4Linear
from freetoken.layers.quantization.nvfp4.moe import NVFP4FusedExperts

__all__ = ["BackendChoice", "BackendError", "choose_backend", "NVFP4Linear", "NVFP4FusedExperts"]
