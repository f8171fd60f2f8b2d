"""Decode tiles of the weight-only quantized GEMMs (`quant_gemm.tiles_for`), measured on an
H200 by `bench/quant_linear.py --sweep --write` at Qwen3.5-35B-A3B's TP 1 and TP 8 shapes
(keys `quant_gemm.table_key`: format kind, or a format where it wants tiles of its own
(`fp8-block/...`, `fp8-tensor/...`: taken before the kind's `fp8/...`), TP-local weight
shape (`+norm`: a row-kernel call with the input norm fused, where measured apart), token
bucket; values `QuantTiles.key()`: tokens / rows / inputs per step / warps / stages / input
split, an `r` before it for the row kernels, `quant_gemm_rows_jit`); a call it lacks gets
`quant_gemm.choose_tiles`. The FP8 one-token entries were measured again 2026-12-04 with the
row kernel in the sweep (`--sweep rows`); the NVFP4 one-token entries of the TP 1 shapes
(9216x2048, 2048x4096, 1024x2048, 2048x512) on an H100 on 2026-12-06, when the NVFP4 row
kernel came (`--formats nvfp4 --tp 1 --tokens 1 --sweep rows`: 1.4-1.7x the tensor-core
tiles there), and those of the TP 8 shards (1536x2048, 128x2048, 2048x64) on an H100 on
2026-12-06 (`--formats fp8-tensor,fp8-block,nvfp4 --tp 1,8 --tokens 1 --sweep rows`: 6.23 ->
3.93, 5.12 -> 2.75 and 3.08 -> 2.65 us a call); the NVFP4 LM head shards keep the
tensor-core tiles. The one `+norm` entry, attention's FP8 qkv with the input norm fused,
was swept on an H100 on 2026-12-06 for both FP8 formats that share the key (block 11.61 ->
10.89 us, per tensor 11.12 -> 10.86). The `fp8-block` and `fp8-tensor` entries are where a
sweep of each FP8 format apart found other tiles than the shared key's (H100, 2026-12-06,
`--formats fp8-tensor,fp8-block --tp 1 --tokens 1 --sweep rows`): GatedDeltaNet's in_proj
takes 32 rows a program (block 13.42 -> 11.80 us plain, 16.38 -> 12.40 with the norm; per
tensor 15.38 -> 13.57 with the norm); in the engine (`tile_ab`, batch 1) block FP8 RD8 820.3
-> 768.2 us a step, ModelOpt mixed RD8 583.1 -> 560.7."""

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
    "fp8/9216x2048+norm/1": "r1/8/2048/4/2/1",
    "fp8/9216x2048/1": "r1/8/512/4/2/1",
    "fp8/9216x2048/16": "16/32/128/4/4/1",
    "fp8-block/12288x2048+norm/1": "r1/32/2048/4/2/1",
    "fp8-block/12288x2048/1": "r1/32/2048/4/2/1",
    "fp8-block/2048x4096/1": "r1/1/2048/4/2/1",
    "fp8-block/9216x2048+norm/1": "r1/16/2048/4/2/1",
    "fp8-tensor/12288x2048+norm/1": "r1/32/1024/4/2/1",
    "fp8-tensor/2048x4096/1": "r1/2/2048/8/2/1",
    "nvfp4/1024x2048/1": "r1/1/1024/4/2/1",
    "nvfp4/1024x2048/16": "16/32/256/4/4/4",
    "nvfp4/128x2048/1": "r1/1/2048/8/2/1",
    "nvfp4/128x2048/16": "16/16/256/4/4/4",
    "nvfp4/1536x2048/1": "r1/4/2048/4/2/1",
    "nvfp4/1536x2048/16": "16/32/256/4/4/4",
    "nvfp4/2048x4096/1": "r1/4/2048/4/2/1",
    "nvfp4/2048x4096/16": "16/64/256/8/4/4",
    "nvfp4/2048x512/1": "r1/4/512/8/2/1",
    "nvfp4/2048x512/16": "16/16/256/4/4/1",
    "nvfp4/2048x64/1": "r1/4/256/4/2/1",
    "nvfp4/2048x64/16": "16/16/64/4/4/1",
    "nvfp4/248320x2048/1": "16/64/128/4/4/1",
    "nvfp4/248320x2048/16": "16/64/128/4/4/1",
    "nvfp4/31040x2048/1": "16/64/128/4/4/1",
    "nvfp4/31040x2048/16": "16/64/128/4/4/1",
    "nvfp4/9216x2048/1": "r1/8/512/4/2/1",
    "nvfp4/9216x2048/16": "16/32/256/4/4/1",
}
