"""The NVFP4 format (4-bit e2m1 weights, e4m3 block scales per 16 inputs, a float32 global
scale per tensor): its definition and torch quantizer (`format`, `quantizer`), the checkpoint
producers' configs and tensor names (`checkpoint`), and how its tensors split across ranks
(`specs`). Imports nothing from the rest of the engine: kernels, loading, layers and the
config all build on it."""
