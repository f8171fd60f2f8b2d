"""Wrong weight-only GEMMs for the quantized formats, for `--inject` (registered in
`freetoken_verify.faults.FAULTS`): each makes the engine's torch path (what CPU runs)
compute what a kernel with the bug would. The `kernels` check's quantized part must fail on
each, naming a case of the format; they are the bugs other engines shipped (one fused
segment's scale applied to all, vLLM #38517; a compressed-tensors divisor read as a
multiplier) or the indexing a partial or shared block invites."""

from __future__ import annotations

import dataclasses

import torch

from freetoken.layers.quantization.fp8 import block_linear
from freetoken.layers.quantization.fp8 import moe as fp8_moe
from freetoken.layers.quantization.fp8.moe import BlockFP8FusedExperts
from freetoken.layers.quantization.fp8.tensor_linear import FP8TensorLinear
from freetoken.layers.quantization.nvfp4.linear import NVFP4Linear
from freetoken.layers.quantization.nvfp4.moe import NVFP4FusedExperts
from freetoken_verify.faults.registry import Entry, fault


def _first_segment_for_all(method_class, index: str) -> None:
    """`method_class` dequantizes with its row-to-scale index buffer `index` pointing every
    row at the first segment's scale."""
    original = method_class.dequantize

    def dequantize(self, layer, dtype):
        rows = getattr(layer, index)
        setattr(layer, index, torch.full_like(rows, self.groups[0]))
        try:
            return original(self, layer, dtype)
        finally:
            setattr(layer, index, rows)

    method_class.dequantize = dequantize


@fault("fp8-tensor-first-scale-for-all",
       Entry("one fused segment's per-tensor FP8 scale used for every segment", "tiny-llama", (1,),
             ("kernels",),
             r"quantized GEMMs in float32: 8 / \d+ .*first: FP8 per-tensor \(modelopt\) "
             r"qkv_proj \(q \| gate \| k \| v\) tp=1 rank 0", tp1_green=False))
def fp8_tensor_first_scale_for_all() -> None:
    """FP8 per-tensor linears dequantize every output segment of a fused layer (q | k | v,
    gate | up, in_proj_qkv | in_proj_z) with the first segment's `weight_scale`."""
    _first_segment_for_all(FP8TensorLinear, "weight_scale_group")


@fault("nvfp4-linear-first-global-for-all",
       Entry("one fused segment's NVFP4 global used for every segment", "tiny-llama", (1,),
             ("kernels",),
             r"quantized GEMMs in float32: 16 / \d+ .*first: NVFP4 \(modelopt\) qkv_proj",
             tp1_green=False))
def nvfp4_linear_first_global_for_all() -> None:
    """NVFP4 dense linears apply the first checkpoint tensor's global scale to every output
    segment of a fused layer (producers usually make them equal; nothing guarantees it)."""
    _first_segment_for_all(NVFP4Linear, "weight_scale_2_group")


@fault("nvfp4-divisor-as-multiplier",
       Entry("compressed-tensors NVFP4 divisor global used as a multiplier", "tiny-llama", (1,),
             ("kernels",), r"quantized GEMMs in float32: .*first: NVFP4 \(compressed-tensors\) ",
             tp1_green=False))
def nvfp4_divisor_as_multiplier() -> None:
    """compressed-tensors' NVFP4 `weight_global_scale` (a divisor, 448 * 6 / amax) is
    multiplied like ModelOpt's `weight_scale_2`, in the dense linears and the routed experts:
    every weight comes out global^2 times too large."""
    original = NVFP4Linear.dequantize
    NVFP4Linear.dequantize = lambda self, layer, dtype: original(
        dataclasses.replace(self, reciprocal=False), layer, dtype)
    NVFP4FusedExperts.global_scales = lambda self: (self.w13_weight_scale_2.float(),
                                                    self.w2_weight_scale_2.float())


@fault("fp8-block-partial-off-by-one",
       Entry("block-FP8 partial block's scale read one block early", "tiny-llama", (1,),
             ("kernels",), r"quantized GEMMs in float32: .*first: FP8 block 24x40 \(fp8\) ",
             tp1_green=False))
def fp8_block_partial_off_by_one() -> None:
    """Block FP8 reads a partial last block's scale one block early (the previous block's
    row or column), as an index that rounds the last block down would; in the linears and
    the routed experts. Ranks whose slice ends inside a block see it too."""

    def wrap(module) -> None:
        original = module.dequantize

        def dequantize(weight, scale, block, offset=(0, 0), *args, **kwargs):
            wrong = scale.clone()
            for dim in (0, 1):
                end = weight.shape[dim] + offset[dim]
                last = -(-end // block[dim]) - 1
                if end % block[dim] and last > 0:
                    wrong.select(dim, last).copy_(scale.select(dim, last - 1))
            return original(weight, wrong, block, offset, *args, **kwargs)

        module.dequantize = dequantize

    wrap(block_linear)
    wrap(fp8_moe)


class _NextExpertScales:
    """The experts module seen through scales rolled by one expert."""

    def __init__(self, experts: BlockFP8FusedExperts):
        self._experts = experts
        self.w13_weight_scale = torch.roll(experts.w13_weight_scale, -1, 0)
        self.w2_weight_scale = torch.roll(experts.w2_weight_scale, -1, 0)

    def __getattr__(self, name):
        return getattr(self._experts, name)


@fault("fp8-moe-scale-wrong-expert",
       Entry("block-FP8 routed experts scaled by the next expert's block scales", "tiny-llama",
             (1,), ("kernels",),
             r"quantized GEMMs in float32: 4 / \d+ .*first: FP8 block 24x40 \(fp8\) routed "
             r"experts tp=1 rank 0", tp1_green=False))
def fp8_moe_scale_wrong_expert() -> None:
    """The block-FP8 routed experts dequantize expert e's weights with expert e + 1's block
    scales (an expert stride applied to the weights but not to the scales)."""
    w13, w2 = BlockFP8FusedExperts.dequantize_w13, BlockFP8FusedExperts.dequantize_w2
    BlockFP8FusedExperts.dequantize_w13 = lambda self, e, dtype: w13(_NextExpertScales(self),
                                                                     e, dtype)
    BlockFP8FusedExperts.dequantize_w2 = lambda self, e, dtype: w2(_NextExpertScales(self),
                                                                   e, dtype)
