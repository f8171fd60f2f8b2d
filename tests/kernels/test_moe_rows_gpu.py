"""The one-token routed experts on the row kernels (`freetoken.kernels.moe_rows`, taken by
`fused_moe.fused_moe` at one token) compiled on a GPU (skipped without one), at
Qwen3.5-35B-A3B's expert dimensions (256 experts of hidden 2048, I = 512 / tp, top 8) for
TP 1, 2, 4 and 8: bf16 experts, summed and per slot, and block-FP8 experts (128 x 128
blocks, the last rank's shard) within 1e-2 relative L2 of the torch loop, bf16 experts
with Qwen3.5's shared expert (I_s = 512 / tp) and its gate as one more slot (and the
decoder layer's residual added in the down launch) against the torch steps, and a CUDA
graph's replay equal to the eager call bit for bit."""

from __future__ import annotations

import pytest
import torch
from gpu_checks import assert_graph_equals_eager, rel_l2

from freetoken.distributed import TPInfo, acting_as
from freetoken.formats.fp8.block import FP8
from freetoken.kernels import fused_moe
from freetoken.kernels.moe_rows import SharedExpertRows
from freetoken.layers.quantization.fp8.moe import BlockFP8FusedExperts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
TP_SIZES = (1, 2, 4, 8)


def _make_token(experts, gen):
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16, generator=gen)
    weights, ids = torch.softmax(torch.randn(1, experts, device="cuda", generator=gen),
                                 -1).topk(8)
    return x, (weights / weights.sum(-1, keepdim=True)).bfloat16(), ids


@pytest.mark.parametrize("tp", TP_SIZES)
def test_bf16_experts_one_token(tp):
    """bf16 experts: the summed row and each weighted slot against the torch loop."""
    gen = torch.Generator(device="cuda").manual_seed(tp)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    inter = 512 // tp
    w13 = torch.randn(256, 2 * inter, 2048, **kw) * 2048**-0.5
    w2 = torch.randn(256, 2048, inter, **kw) * inter**-0.5
    x, weights, ids = _make_token(256, gen)
    want = fused_moe.reference_moe(x, weights, ids, w13, w2)
    error = rel_l2(fused_moe.fused_moe(x, weights, ids, w13, w2), want)
    assert error < 1e-2, f"tp={tp} summed: relative L2 {error:.2e}"
    slots = fused_moe.fused_moe(x, weights, ids, w13, w2, sum_slots=False)
    error = rel_l2(slots.sum(dim=1), want)
    assert error < 1e-2, f"tp={tp} per slot: relative L2 {error:.2e}"
    assert_graph_equals_eager(lambda: fused_moe.fused_moe(x, weights, ids, w13, w2),
                              f"tp={tp} summed")
    assert_graph_equals_eager(lambda: fused_moe.fused_moe(x, weights, ids, w13, w2,
                                                          sum_slots=False), f"tp={tp} slots")


@pytest.mark.parametrize("tp", TP_SIZES)
def test_bf16_experts_with_the_shared_expert_one_token(tp):
    """The routed sum plus the gated shared expert in the row kernels' two launches, against
    the torch steps the engine's separate launches take."""
    gen = torch.Generator(device="cuda").manual_seed(20 + tp)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    inter = 512 // tp
    w13 = torch.randn(256, 2 * inter, 2048, **kw) * 2048**-0.5
    w2 = torch.randn(256, 2048, inter, **kw) * inter**-0.5
    shared = SharedExpertRows(torch.randn(2 * inter, 2048, **kw) * 2048**-0.5,
                              torch.randn(2048, inter, **kw) * inter**-0.5,
                              torch.randn(1, 2048, **kw) * 2048**-0.5)
    x, weights, ids = _make_token(256, gen)

    def run():
        return fused_moe.fused_moe(x, weights, ids, w13, w2, shared=shared)

    want = fused_moe.reference_moe_shared(x, weights, ids, w13, w2, shared)
    error = rel_l2(run(), want)
    assert error < 1e-2, f"tp={tp}: relative L2 {error:.2e}"
    assert_graph_equals_eager(run, f"tp={tp} with the shared expert")
    residual = torch.randn(1, 2048, **kw) * 4

    def with_residual():
        return fused_moe.fused_moe(x, weights, ids, w13, w2, shared=shared, residual=residual)

    error = rel_l2(with_residual(), residual + want)
    assert error < 1e-2, f"tp={tp} with the residual: relative L2 {error:.2e}"
    assert_graph_equals_eager(with_residual, f"tp={tp} with the shared expert and residual")


@pytest.mark.parametrize("tp", TP_SIZES)
def test_block_fp8_experts_one_token(tp):
    """Block-FP8 experts of rank tp-1 (at TP 8 half a 128-wide block, half a block into its
    column block), random codes and scales, against the torch loop on the dequantized
    weights in float32."""
    gen = torch.Generator(device="cuda").manual_seed(10 + tp)
    with acting_as(TPInfo(tp - 1, tp)):
        layer = BlockFP8FusedExperts(32, 2048, 512, (128, 128)).to("cuda")
    for name in ("w13_weight", "w2_weight"):
        p = getattr(layer, name)
        p.data.copy_((torch.randn(p.shape, device="cuda", generator=gen) * 64)
                     .clamp(-448, 448).to(FP8))
    for name in ("w13_weight_scale", "w2_weight_scale"):
        p = getattr(layer, name)
        p.data.copy_(torch.rand(p.shape, device="cuda", generator=gen) * 1e-3 + 1e-4)
    x, weights, ids = _make_token(32, gen)
    w13_scales, w2_scales = layer.block_scales()

    def run():
        return fused_moe.fused_moe(x, weights, ids, layer.w13_weight, layer.w2_weight,
                                   w13_scales=w13_scales, w2_scales=w2_scales)

    want = layer(x.float(), weights.float(), ids)
    error = rel_l2(run(), want)
    assert error < 1e-2, f"tp={tp}: relative L2 {error:.2e}"
    assert_graph_equals_eager(run, f"tp={tp} block FP8")
