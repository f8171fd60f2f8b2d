"""Layers that compute with NVFP4 weights (the format itself is `freetoken.formats.nvfp4`):
the backend choice, the torch reference backend and the routed experts."""

from freetoken.layers.quantization.nvfp4.backend import BackendChoice, BackendError, choose_backend
from freetoken.layers.quantization.nvfp4.moe import NVFP4FusedExperts

__all__ = ["BackendChoice", "BackendError", "choose_backend", "NVFP4FusedExperts"]
