"""Measured tiles of the decode-step linear kernel (`freetoken.kernels.gemv`) on one H200,
bf16, by `bench/decode_kernels.py --sweep --write FILE` (docs/performance.md, "Engine
decode (H200)"): key `ROWSxINPUTS/fused/tokens bucket` (`gemv.table_key`), value
`block_n/block_k/warps/stages/split` (an `r` before it: the row kernel, `gemv_rows_jit`) or
"gemm" where the GEMM and the separate small kernels were faster. Shapes not listed take
`gemv.choose_tiles`. These are the TP 1 shapes of the medium Llama (hidden 1024) and of
qwen3.5-moe-realdims (hidden 2048): the 16-token entries measured 2026-12-01, the one-token
entries 2026-12-04 with the row kernel in the sweep (torch 2.11, triton 3.6). The MoE
router with its RMSNorm (`256x2048/norm/*`, the launch that also stores the normalised input
for the experts) was swept on an H100 on 2026-12-05 (one token: 3.26 us fused against 7.35
us for the RMSNorm and the GEMM; 16 tokens: the unfused steps faster), and GatedDeltaNet's
16-bit b|a beside a quantized qkv|z (`64x2048/plain/*`) on an H100 on 2026-12-05 (one
token: 2.02 us against 5.01 us for the GEMM; 16 tokens 4.90 against 5.03)."""

H200: dict[str, str] = {
    "1024x1024/residual/1": "r2/1024/4/2/1",
    "1024x1024/residual/16": "16/256/4/4/1",
    "1024x2048/gated/1": "r1/2048/8/2/1",
    "1024x2048/gated/16": "gemm",
    "1024x2816/residual/1": "r1/2048/4/2/1",
    "1024x2816/residual/16": "16/256/4/4/1",
    "12352x2048/norm/1": "r4/1024/4/2/1",
    "12352x2048/norm/16": "gemm",
    "1536x1024/norm/1": "r2/1024/4/1/1",
    "1536x1024/norm/16": "16/256/4/4/1",
    "2048x4096/residual/1": "r2/4096/8/2/1",
    "2048x4096/residual/16": "16/256/4/4/1",
    "2048x512/plain/1": "r2/512/4/2/1",
    "2048x512/plain/16": "16/256/4/4/1",
    "256x2048/norm/1": "r1/2048/8/2/1",
    "256x2048/norm/16": "gemm",
    "256x2048/plain/1": "r1/2048/4/2/1",
    "256x2048/plain/16": "16/256/4/4/1",
    "5632x1024/norm+gated/1": "r2/1024/4/1/1",
    "5632x1024/norm+gated/16": "32/256/4/4/1",
    "64x2048/plain/1": "r1/2048/4/2/1",
    "64x2048/plain/16": "16/256/4/4/1",
    "9216x2048/norm/1": "r4/1024/4/1/1",
    "9216x2048/norm/16": "gemm",
}
