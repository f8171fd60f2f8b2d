"""Decode tiles of the weight-only quantized GEMMs (`quant_gemm.tiles_for`), measured on an
H200 by `bench/quant_linear.py --sweep --write` at Qwen3.5-35B-A3B's TP 1 and TP 8 shapes
(keys `quant_gemm.table_key`: format kind, TP-local weight shape, token bucket; values
`QuantTiles.key()`: tokens / rows / inputs per step / warps / stages / input split, an `r`
before it for FP8's row kernel, `quant_gemm_rows_jit`); a call it lacks gets
`quant_gemm.choose_tiles`. The FP8 one-token entries were measured again 2026-12-04 with the
row kernel in the sweep (`--sweep rows`)."""

H200: dict[str, str] = {
    "fp8/1024x2048/1": "r1/2/2048/8/2/1",
    "fp8/1024x2048/16": "16/32/128/4/4/4",
    "fp8/12288x2048/1": "r1/8/512/4/2/1",
    "fp8/12288x2048/16": "16/32/256/4/4/1",
    "fp8/128x2048/1": "r1/2/2048/8/2/1",
    "fp8/128x2048/16": "16/32/512/4/4/4",
    "fp8/1536x2048/1": "r1/4/2048/8/2/1",
    "fp8/1536x2048/16": "16/32/128/4/4/2",
    "fp8/2048x4096/1": "r1/4/2048/8/2/1",
    "fp8/2048x4096/16": "16/32/256/4/4/4",
    "fp8/2048x512/1": "r1/8/512/8/2/1",
    "fp8/2048x512/16": "16/32/256/4/4/1",
    "fp8/2048x64/1": "16/16/64/4/4/1",
    "fp8/2048x64/16": "16/16/64/4/4/1",
    "fp8/9216x2048/1": "r1/8/512/4/2/1",
    "fp8/9216x2048/16": "16/32/128/4/4/1",
    "nvfp4/1024x2048/1": "16/32/256/4/4/8",
    "nvfp4/1024x2048/16": "16/32/256/4/4/4",
    "nvfp4/128x2048/1": "16/16/256/4/4/8",
    "nvfp4/128x2048/16": "16/16/256/4/4/4",
    "nvfp4/1536x2048/1": "16/32/256/4/4/8",
    "nvfp4/1536x2048/16": "16/32/256/4/4/4",
    "nvfp4/2048x4096/1": "16/64/128/4/4/16",
    "nvfp4/2048x4096/16": "16/64/256/8/4/4",
    "nvfp4/2048x512/1": "16/16/256/4/4/1",
    "nvfp4/2048x512/16": "16/16/256/4/4/1",
    "nvfp4/2048x64/1": "16/16/64/4/4/1",
    "nvfp4/2048x64/16": "16/16/64/4/4/1",
    "nvfp4/248320x2048/1": "16/64/128/4/4/1",
    "nvfp4/248320x2048/16": "16/64/128/4/4/1",
    "nvfp4/31040x2048/1": "16/64/128/4/4/1",
    "nvfp4/31040x2048/16": "16/64/128/4/4/1",
    "nvfp4/9216x2048/1": "16/64/64/4/4/4",
    "nvfp4/9216x2048/16": "16/32/256/4/4/1",
}
