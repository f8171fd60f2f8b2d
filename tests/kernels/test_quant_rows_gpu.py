"""The FP8 and NVFP4 row kernels (`freetoken.kernels.quant_gemm`) compiled on a GPU (skipped
without one), bf16: a chain of one-token quantized projections launched with programmatic
dependent launch (`quant_gemm.ROW_PDL`) gives the bits of ordinary launches, eagerly and in
a CUDA graph's replay, and its first step taken ahead (`ROW_FIRST`) those of the loop."""

from __future__ import annotations

import pytest
import torch
from gpu_checks import assert_graph_equals_eager

from freetoken.formats.fp8.tensor import quantize_per_tensor
from freetoken.formats.nvfp4.quantizer import quantize as quantize_nvfp4
from freetoken.kernels import gemv, quant_gemm

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _fp8(rows, inputs, seed):
    gen = torch.Generator().manual_seed(seed)
    codes, scale = quantize_per_tensor(torch.randn(rows, inputs, generator=gen) * inputs**-0.5)
    return dict(weight=codes.cuda(), scale=scale.reshape(1, 1).cuda(),
                scale_row=torch.zeros(rows, dtype=torch.int32, device="cuda"),
                block_cols=inputs)


def _nvfp4(rows, inputs, seed):
    gen = torch.Generator().manual_seed(seed)
    q = quantize_nvfp4(torch.randn(rows, inputs, generator=gen) * inputs**-0.5)
    return dict(packed=q.packed.cuda(), block_scale=q.block_scale.cuda(),
                global_scale=q.global_scale.reshape(1).cuda(),
                group=torch.zeros(rows, dtype=torch.int32, device="cuda"))


def _chain_steps():
    """Qwen3.5-MoE's one-token quantized layer at TP 1, as ModelOpt's mixed checkpoint has
    it: GatedDeltaNet's in_proj with the input norm (FP8 per tensor), out_proj with the
    residual (FP8), the shared expert's gate_up with its SiLU-and-mul and its down (NVFP4),
    each call's tiles the shipped table's."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    norm = gemv.Norm(torch.randn(2048, **kw) * 0.3, 1e-6, True)
    residual = torch.randn(1, 2048, **kw)
    return [
        (quant_gemm.fp8_gemm, _fp8(12288, 2048, 1), dict(norm=norm, tile_format="fp8-tensor")),
        (quant_gemm.fp8_gemm, _fp8(2048, 4096, 2), dict(residual=residual,
                                                       tile_format="fp8-tensor")),
        (quant_gemm.nvfp4_gemm, _nvfp4(1024, 2048, 3), dict(gated=True)),
        (quant_gemm.nvfp4_gemm, _nvfp4(2048, 512, 4), {}),
    ]


def test_quantized_row_kernels_with_pdl_match_ordinary_launches(monkeypatch):
    """Three layers of the chain (each call reads the previous one's output): with PDL where
    the GPU has it, and with the first step ahead in ordinary launches, the same bits as
    the plain launches, eagerly and in a graph's replay. (A read before the wait would
    differ only when it loses the race; the PTX test in test_quant_gemm.py guards the
    order.)"""
    steps = _chain_steps()
    x0 = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)

    def chain(x):
        for _ in range(3):
            for gemm, weight, fused in steps:
                inputs = (weight["weight"].shape[1] if "weight" in weight
                          else weight["packed"].shape[1] * 2)
                x = gemm(x[:, :inputs], **weight, **fused)
        return x

    for name in ("ROW_PDL", "ROW_FIRST"):
        monkeypatch.setattr(quant_gemm, name, False)
    want = chain(x0)
    assert quant_gemm.fusing_tiles(1, 12288, 2048, "fp8-tensor", norm=True) is not None
    for name in ("ROW_FIRST", "ROW_PDL"):
        monkeypatch.setattr(quant_gemm, name, True)
        for _ in range(5):
            assert torch.equal(chain(x0), want), name
        assert_graph_equals_eager(lambda: chain(x0), name, want, replays=5)
