"""Measured tiles of the decode-step linear kernel (`freetoken.kernels.gemv`) on one H200,
bf16, by `bench/decode_kernels.py --sweep --write FILE` (docs/performance.md, "Engine
decode (H200)"): key `ROWSxINPUTS/fused/tokens bucket` (`gemv.table_key`), value
`block_n/block_k/warps/stages/split` or "gemm" where the GEMM and the separate small
kernels were faster. Shapes not listed take `gemv.choose_tiles`. These are the TP 1 shapes
of the medium Llama (hidden 1024) and of qwen3.5-moe-realdims (hidden 2048), measured
2026-12-01 (torch 2.11, triton 3.6)."""

H200: dict[str, str] = {
    "1024x1024/residual/1": "16/256/4/4/1",
    "1024x1024/residual/16": "16/256/4/4/1",
    "1024x2048/gated/1": "32/128/4/4/4",
    "1024x2048/gated/16": "gemm",
    "1024x2816/residual/1": "32/128/4/4/4",
    "1024x2816/residual/16": "16/256/4/4/1",
    "12352x2048/norm/1": "gemm",
    "12352x2048/norm/16": "gemm",
    "1536x1024/norm/1": "16/256/4/4/1",
    "1536x1024/norm/16": "16/256/4/4/1",
    "2048x4096/residual/1": "32/128/4/4/4",
    "2048x4096/residual/16": "16/256/4/4/1",
    "2048x512/plain/1": "16/128/4/4/1",
    "2048x512/plain/16": "16/256/4/4/1",
    "256x2048/plain/1": "16/128/4/4/8",
    "256x2048/plain/16": "16/256/4/4/1",
    "5632x1024/norm+gated/1": "32/256/4/4/1",
    "5632x1024/norm+gated/16": "32/256/4/4/1",
    "9216x2048/norm/1": "gemm",
    "9216x2048/norm/16": "gemm",
}
