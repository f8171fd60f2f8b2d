"""Layers that compute with block-FP8 weights, weight-only: the linear method
(`block_linear`)."""
