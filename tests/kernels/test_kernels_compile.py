"""The engine's kernels compiled by Triton for sm_90 on this CPU: the decode step's linear
kernels in every variant their launchers ask for, and the other kernels with the arguments
their launchers launch them with at Qwen3.5-MoE's shapes. Triton's interpreter, which runs
every other kernel test here, accepts code that the compiler refuses (a @jit function
returning None, say), and a GPU run is the wrong place to find that out."""

from __future__ import annotations

import ast
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
    out[name] = nvfp4_sass.compile_outcome(lambda: nvfp4_sass.compile_kernel(
        fn, meta, 4, 90, pointers=pointers(fn, **types), divisible=set()))[0]
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


_LAUNCHED = """
import json, sys
sys.path.insert(0, "bench")
import torch
import triton
import nvfp4_sass
from freetoken.kernels import (canonical_gemm, delta_rule, fused_moe, norm_rope,
                               nvfp4_launch, nvfp4_mma_launch, paged_attention, pdl,
                               quant_gemm, step_io)

launches = []


def record(self, grid):
    # every launch of every kernel kept with its arguments, nothing run
    return lambda **kw: launches.append((self, kw))


triton.runtime.jit.JITFunction.__getitem__ = record
pdl.available = paged_attention.pdl_available = lambda x: True   # as on an sm_90 GPU


def bf16(*shape):
    return torch.empty(*shape, dtype=torch.bfloat16)


# Qwen3.5-MoE's decode-step kernels at one token and at 16 (TP 1 dimensions)
for t in (1, 16):
    norm_rope.rms_norm(bf16(t, 16, 256), bf16(256), 1e-6, True)
    norm_rope.gated_rms_norm(bf16(t, 32, 128), bf16(t, 32, 128), bf16(128), 1e-6)
    norm_rope.silu_and_mul(bf16(t, 1024))
    slots = torch.arange(t)
    mixed = delta_rule.conv_update(bf16(t, 8192), bf16(8192, 1, 4), bf16(t, 8192, 3), slots)
    q, k, v = mixed.split([2048, 2048, 4096], dim=-1)
    delta_rule.gated_delta_decode(q.reshape(t, 16, 128), k.reshape(t, 16, 128),
                                  v.reshape(t, 32, 128), bf16(t, 32), bf16(t, 32),
                                  torch.empty(32), torch.empty(32),
                                  torch.empty(t, 32, 128, 128), slots, torch.bfloat16)
    fused_moe.route(bf16(t, 256), 8, True, torch.bfloat16)
    step_io.float_argmax(bf16(t, 248320))
    step_io.unpack(torch.zeros(t, 5 + 64, dtype=torch.int64), torch.zeros(t, dtype=torch.int64),
                   torch.empty(t, dtype=torch.int64), torch.empty(t, dtype=torch.int64),
                   torch.empty(t, dtype=torch.int64), torch.empty(t, dtype=torch.int32),
                   torch.empty(t, dtype=torch.int64), torch.empty(t, 64, dtype=torch.int32))
# the 16-bit routed experts (row kernels at one token, grouped at 16) and a block-FP8
# projection on the tiled kernel at 16 tokens
w13, w2 = bf16(256, 1024, 2048), bf16(256, 2048, 512)
for t in (1, 16):
    ids = torch.randint(0, 256, (t, 8))
    fused_moe.fused_moe(bf16(t, 2048), bf16(t, 8), ids, w13, w2)
quant_gemm.fp8_gemm(bf16(16, 2048), torch.empty(9216, 2048, dtype=torch.float8_e4m3fn),
                    torch.empty(72, 16), (torch.arange(9216) // 128).int(), 128,
                    tile_format="fp8-block")
# prefill's rotary with the cache write, and the tp_invariant mode's chunked GEMM
q, k, v = bf16(32, 16, 256), bf16(32, 2, 256), bf16(32, 2, 256)
norm_rope.rotary_(q, k, torch.arange(32), torch.empty(32), 64,
                  (v, bf16(8, 16, 2, 256), bf16(8, 16, 2, 256), torch.arange(32)))
canonical_gemm.chunk_products(bf16(16, 4096), bf16(2048, 4096), 8, torch.bfloat16)
# the decode attention with its rotary, cache write, q/k norms and output gate folded in (q,
# gate, k and v views of one projection row), and prefill's attention
caches = bf16(64, 16, 2, 256), bf16(64, 16, 2, 256)
for t in (1, 16):
    q, gate, k, v = bf16(t, 36 * 256).split([4096, 4096, 512, 512], dim=-1)
    norm = paged_attention.QKNorm(bf16(256), bf16(256), 1e-6, True)
    rope = paged_attention.DecodeRope(torch.arange(t), torch.empty(32), k.view(t, 2, 256),
                                      v.view(t, 2, 256), torch.arange(t), norm)
    paged_attention.paged_attention(
        q.view(t, 16, 256), *caches, torch.zeros(t, 4, dtype=torch.int32),
        torch.arange(t + 1, dtype=torch.int32), torch.full((t,), 40, dtype=torch.int32),
        256**-0.5, None, rope, gate.view(t, 16, 256))
paged_attention.paged_attention(
    bf16(32, 16, 256), *caches, torch.zeros(1, 4, dtype=torch.int32),
    torch.tensor([0, 32], dtype=torch.int32), torch.tensor([40], dtype=torch.int32),
    256**-0.5, paged_attention.prefill_work([32], 16, "cpu"))
# the NVFP4 LM head's TP 8 shard at two and 16 tokens as the mma's columns, on the PTX path
# (what `dequant_mode` gives on a GPU)
nvfp4_mma_launch.dequant_mode = lambda x: 1
for t in (2, 16):
    nvfp4_mma_launch.dense_mma_launch(
        bf16(t, 2048), torch.empty(1, 31040, 1024, dtype=torch.uint8),
        torch.empty(1, 31040, 128, dtype=torch.uint8), bf16(t, 31040), 2048,
        nvfp4_launch.GPU_TILES, torch.ones(1))
out = []
for kernel, kw in launches:
    result, ptx = nvfp4_sass.compile_outcome(lambda: nvfp4_sass.compile_launch(kernel, kw))
    # the launch's constexprs (upper case by the kernels' convention) name its variant
    variant = {k: v for k, v in kw.items() if k.isupper() or k == "num_warps"}
    out.append((kernel.fn.__name__, result, "griddepcontrol.launch_dependents" in ptx,
                repr(variant)))
print(json.dumps(out))
"""


def test_decode_step_kernels_compile_as_launched():
    """The decode step's other kernels (RMSNorm, GatedDeltaNet's gated norm, conv update and delta
    rule, SiLU-and-mul, routing, the step's argmax and input unpacking, the 16-bit routed
    experts on their row and grouped kernels with the alignment, the block-FP8 tiled GEMM,
    prefill's rotary with its cache write, the tp_invariant mode's chunked GEMM, the decode
    attention with its q/k norms and output gate folded in, prefill's attention, the NVFP4
    LM head with the tokens as the mma's columns on its PTX path), launched by their own
    launchers at Qwen3.5-MoE's one- and 16-token shapes with the launches recorded, not run,
    and each compiled for sm_90 with the arguments as launched
    (`nvfp4_sass.compile_launch`): all compile, and the gated norm and the decode attention
    let the next kernel (out_proj or o_proj, launched with programmatic dependent launch)
    start early."""
    from conftest import run_compiled

    proc = run_compiled(["-c", _LAUNCHED])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(proc.stdout.splitlines()[-1])
    names = {name for name, *_ in results}
    assert names == {"rms_norm_kernel", "gated_rms_norm_kernel", "silu_and_mul_kernel",
                     "conv_update_kernel", "gated_delta_decode_kernel", "route_kernel",
                     "float_argmax_kernel", "argmax_finish_kernel", "unpack_kernel",
                     "gate_up_rows_kernel", "down_rows_kernel", "align_kernel",
                     "gate_up_kernel", "down_kernel", "fp8_gemm_kernel", "rotary_kernel",
                     "chunked_gemm_kernel", "paged_attention_kernel", "dense_mma"}, names
    failed = [(name, variant, result) for name, result, _, variant in results
              if result != "ok"]
    assert not failed, failed
    triggers = {name for name, _, trigger, _ in results if trigger}
    assert triggers == {"gated_rms_norm_kernel", "paged_attention_kernel"}, triggers
    attention = [ast.literal_eval(variant) for name, _, _, variant in results
                 if name == "paged_attention_kernel"]
    folded = [v for v in attention if v.get("DECODE")]
    assert len(folded) == 2 and all(v["QK_NORM"] and v["NORM_OFFSET"] and v["GATE"]
                                    for v in folded), attention
