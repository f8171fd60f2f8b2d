"""The decode step's linear kernels compiled by Triton for sm_90 on this CPU, in the
variants their launchers ask for: Triton's interpreter, which runs every other kernel test
here, accepts code that the compiler refuses (a @jit function returning None, say), and a
GPU run is the wrong place to find that out."""

from __future__ import annotations

import json

_COMPILE = """
import inspect, json, sys
sys.path.insert(0, "bench")
import nvfp4_sass
from freetoken.kernels import jit_module

gemv = jit_module("gemv_jit")
rows = jit_module("gemv_rows_jit")
quant = jit_module("quant_gemm_rows_jit")


def pointers(fn, **types):
    out = {p: "*bf16" for p in inspect.signature(fn.fn).parameters if p.endswith("_ptr")}
    out.update(partial_ptr="*fp32", eps="fp32", **types)
    return out


fp8 = dict(weight_ptr="*fp8e4nv", scale_ptr="*fp32", scale_row_ptr="*i32")
nvfp4 = dict(weight_ptr="*i32", scale_ptr="*u8", global_ptr="*fp32", group_ptr="*i32")
fused = dict(NORM=1, STORE_NORMED=True, GATED=True, HAS_BIAS=True, HAS_RESIDUAL=True,
             SPLIT=False, EVEN_K=True, BLOCK_N=2)
plain = dict(NORM=0, STORE_NORMED=False, GATED=False, HAS_BIAS=False, HAS_RESIDUAL=False,
             SPLIT=True, EVEN_K=False, BLOCK_N=4)
cases = {
    "gemv fused": (gemv.gemv_kernel, dict(fused, BLOCK_N=16, BLOCK_M=16, BLOCK_K=256,
                                          PRECISION="tf32"), {}),
    "gemv reduce": (gemv.gemv_reduce_kernel, dict(GATED=True, HAS_BIAS=True,
                                                  HAS_RESIDUAL=True, BLOCK_M=1,
                                                  BLOCK_N=256), {}),
    "rows fused, pdl": (rows.gemv_rows_kernel, dict(fused, BLOCK_K=1024, NORM_BLOCK=1024,
                                                    PREFETCH=True, PDL=1, EARLY=1), {}),
    "rows fused, late": (rows.gemv_rows_kernel, dict(fused, BLOCK_K=1024, NORM_BLOCK=1024,
                                                     PREFETCH=True, PDL=0, EARLY=0), {}),
    "rows fused, in step": (rows.gemv_rows_kernel, dict(fused, BLOCK_K=512, NORM_BLOCK=1024,
                                                        PREFETCH=False), {}),
    "rows plain split": (rows.gemv_rows_kernel, dict(plain, BLOCK_K=256, NORM_BLOCK=1024,
                                                     PREFETCH=True, PDL=1), {}),
    "fp8 rows fused": (quant.fp8_gemm_rows_kernel, dict(fused, SCALE=1, BLOCK_COLS=128, SUB=4,
                                                        BLOCK_K=512, NORM_BLOCK=1024), fp8),
    "fp8 rows late": (quant.fp8_gemm_rows_kernel, dict(fused, SCALE=0, BLOCK_COLS=128, SUB=1,
                                                       BLOCK_K=1024, NORM_BLOCK=1024,
                                                       EARLY=0), fp8),
    "nvfp4 rows fused": (quant.nvfp4_gemm_rows_kernel, dict(fused, RECIPROCAL=1, ASM=1, KW=16,
                                                            NORM_BLOCK=1024), nvfp4),
    "nvfp4 rows plain split": (quant.nvfp4_gemm_rows_kernel, dict(plain, RECIPROCAL=0, ASM=1,
                                                                  KW=8, NORM_BLOCK=1024),
                               nvfp4),
}
out = {}
for name, (fn, meta, types) in cases.items():
    try:
        kernel = nvfp4_sass.compile_kernel(fn, meta, 4, 90, pointers=pointers(fn, **types),
                                           divisible=set())
        out[name] = "ok" if ".entry" in kernel.asm["ptx"] else "no PTX entry"
    except Exception as err:   # the compiler's message names the kernel's line
        out[name] = f"{type(err).__name__}: {err}"[:2000]
print(json.dumps(out))
"""


def test_decode_linear_kernels_compile_for_sm90():
    """Every variant the launchers ask of the decode linear kernels (the fusions on and off,
    split, prefetched or loaded in their step, early or late loads, programmatic dependent
    launch) compiles for sm_90: the 16-bit tiled and row kernels, the split reduction, and
    the FP8 and NVFP4 row kernels."""
    from conftest import run_compiled

    proc = run_compiled(["-c", _COMPILE])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(proc.stdout.splitlines()[-1])
    failed = {name: result for name, result in results.items() if result != "ok"}
    assert len(results) == 10 and not failed, failed
