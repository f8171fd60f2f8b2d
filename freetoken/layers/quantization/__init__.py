"""Layers that compute with quantized weights (NVFP4 so far; the formats themselves are
`freetoken.formats`)."""
