"""Quantized weight formats and the layers that compute with them (NVFP4 so far)."""
